"""One bounded HTTP GET, for the few places gpuppetti asks another process something: the host agent, and a
running daemon's endpoint from ``top``, ``discover --from`` and ``doctor``.

Bounded in time (connect to last byte) and in size, never through a proxy from the environment (these are local
addresses), never following a redirect. The body is read to its end, however many pieces it arrives in: on a real
network, through ``kubectl port-forward``, or on loopback once it is larger than a socket buffer, an answer comes
in pieces, and one read returns only those that have arrived.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

TIMEOUT_S = 5.0
MAX_BYTES = 256 * 1024
# What one read asks for: aiohttp returns what has arrived, up to this.
CHUNK_BYTES = 64 * 1024


class FetchError(Exception):
    """No usable answer; the message says why, after the URL."""


class Unreachable(FetchError):
    """Nothing listens at ``address`` (HOST:PORT): the connection was refused."""

    def __init__(self, message: str, address: str) -> None:
        super().__init__(message)
        self.address = address


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    body: bytes


async def get(url: str, headers: Mapping[str, str] | None = None, timeout: float = TIMEOUT_S,
              limit: int = MAX_BYTES) -> Reply:
    """GET ``url``; the whole body, at most ``limit`` bytes of it. Raises FetchError (Unreachable when nothing
    listens)."""
    # Only where something is asked: importing aiohttp costs a daemon start-up time and memory it need not spend.
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), trust_env=False) as session,
            session.get(url, headers=dict(headers or {}), allow_redirects=False) as response,
        ):
            if (response.content_length or 0) > limit:
                raise FetchError(f"{url} sent {response.content_length} bytes; at most {limit} are read")
            body = bytearray()
            while chunk := await response.content.read(CHUNK_BYTES):
                body += chunk
                if len(body) > limit:
                    raise FetchError(f"{url} sent more than {limit} bytes")
            return Reply(response.status, response.content_type, bytes(body))
    except TimeoutError:
        raise FetchError(f"{url} did not answer within {timeout:g}s") from None
    except aiohttp.ClientConnectorError as exc:
        # aiohttp's own words name its TLS context (ssl:default) even for plain HTTP: say what was tried instead.
        address = f"[{exc.host}]:{exc.port}" if ":" in exc.host else f"{exc.host}:{exc.port}"
        if isinstance(exc.os_error, ConnectionRefusedError):
            raise Unreachable(f"{url} did not answer: cannot connect to {address}: nothing listens there",
                              address) from None
        why = exc.os_error.strerror or str(exc.os_error)
        raise FetchError(f"{url} did not answer: cannot connect to {address}: {why}") from None
    except aiohttp.ClientError as exc:
        raise FetchError(f"{url} did not answer: {exc}") from None
