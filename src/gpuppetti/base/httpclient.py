"""One bounded HTTP GET, for the few places gpuppetti asks another process something: the host agent, and a
running daemon's endpoint from ``discover --from`` and ``doctor``.

Bounded in time (connect to last byte) and in size, never through a proxy from the environment (these are local
addresses), never following a redirect.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

TIMEOUT_S = 5.0
MAX_BYTES = 256 * 1024


class FetchError(Exception):
    """No usable answer; the message says why, after the URL."""


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    body: bytes


async def get(url: str, headers: Mapping[str, str] | None = None, timeout: float = TIMEOUT_S,
              limit: int = MAX_BYTES) -> Reply:
    # Only where something is asked: importing aiohttp costs a tenth of a second and megabytes.
    import aiohttp

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), trust_env=False) as session,
            session.get(url, headers=dict(headers or {}), allow_redirects=False) as response,
        ):
            if (response.content_length or 0) > limit:
                raise FetchError(f"{url} sent {response.content_length} bytes; at most {limit} are read")
            body = await response.content.read(limit + 1)
            if len(body) > limit:
                raise FetchError(f"{url} sent more than {limit} bytes")
            return Reply(response.status, response.content_type, body)
    except TimeoutError:
        raise FetchError(f"{url} did not answer within {timeout:g}s") from None
    except aiohttp.ClientError as exc:
        raise FetchError(f"{url} did not answer: {exc}") from None
