"""A small HTTP server in the event loop: GET-only routes, one request per connection, bounded in time and size.

Every connection is handled on its own; a request must arrive whole within a deadline and stay small, and each
answer closes the connection. So idle or dripping connections cannot take a liveness probe down, and nothing here
blocks the loop. HTTP itself is h11's: it parses and frames the messages. aiohttp would do it too, but importing it
builds TLS contexts from the system's CA store, which costs the device plugin a tenth of a second at start and a
fifth of its memory, for an endpoint that speaks plain HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import h11

log = logging.getLogger(__name__)

# A request must arrive whole within this long, and be at most this big: a GET has no body.
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 16 * 1024
SEND_TIMEOUT_S = 10.0


class AddressError(ValueError):
    pass


def parse_address(text: str, what: str = "address") -> tuple[str | None, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every address, IPv4 and IPv6). Raises AddressError."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise AddressError(f"{what}: expected HOST:PORT such as 127.0.0.1:9400, [::1]:9400 or :9400, got {text!r}")
    if host.startswith("["):
        if not host.endswith("]"):
            raise AddressError(f"{what}: unbalanced brackets in {text!r}")
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(f"{what}: {host!r} in brackets is not an IPv6 address (in {text!r})") from None
    elif ":" in host:
        raise AddressError(f"{what}: write an IPv6 address in brackets, as [{host}]:{port}")
    elif host and not _is_host(host):
        raise AddressError(f"{what}: {host!r} is not an IP address or host name (in {text!r})")
    return (host or None), int(port)


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        labels = text.rstrip(".").split(".")
        return all(label and len(label) <= 63 and label.replace("-", "").isalnum() for label in labels)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def text(cls, status: int, text: str) -> Answer:
        return cls(status, text.encode())

    @classmethod
    def json(cls, document: Any, status: int = 200) -> Answer:
        return cls(status, json.dumps(document).encode(), "application/json")


Handler = Callable[[], Awaitable[Answer]]
# Sees the request (its headers, path and peer) before any handler; an Answer refuses it.
Guard = Callable[[Mapping[str, str], str, str], Answer | None]


class Server:
    """GET-only routes on a TCP address, one task per connection (asyncio's), one request per connection."""

    def __init__(self, routes: Mapping[str, Handler], guard: Guard | None = None) -> None:
        self._routes = routes
        self._guard = guard
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self, host: str | None, port: int) -> str:
        """Listen; returns the address bound (for ``:0`` and every address, one that reaches it)."""
        self._server = await asyncio.start_server(self._connection, host, port, reuse_address=True,
                                                  limit=MAX_REQUEST_BYTES)
        bound = self._server.sockets[0].getsockname()
        bound_host = str(bound[0])
        if host is None:
            bound_host = "::1" if self._server.sockets[0].family == socket.AF_INET6 else "127.0.0.1"
        self.address = format_address(bound_host, int(bound[1]))
        return self.address

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        try:
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    request = await self._read(connection, reader)
            except TimeoutError:
                return  # a peer that says nothing, or too slowly, gets nothing
            except h11.RemoteProtocolError as exc:
                answer = Answer.text(exc.error_status_hint, f"bad request: {exc}\n")
            else:
                if request is None:
                    return
                peer = writer.get_extra_info("peername")
                answer = await self._answer(request, str(peer[0]) if peer else "?")
            # h11 frames an answer after a protocol error too (a 400 for a request it could not parse).
            headers = [("content-type", answer.content_type), ("content-length", str(len(answer.body))),
                       ("connection", "close"), *answer.headers.items()]
            data = connection.send(h11.Response(status_code=answer.status, headers=headers))
            data += connection.send(h11.Data(data=answer.body)) + connection.send(h11.EndOfMessage())
            writer.write(data)
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await writer.drain()
        except (ConnectionError, TimeoutError, h11.LocalProtocolError) as exc:
            log.debug("http: connection dropped: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read(self, connection: h11.Connection, reader: asyncio.StreamReader) -> h11.Request | None:
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(4096)
                connection.receive_data(data)
                if not data and connection.their_state is not h11.DONE:
                    return None
                continue
            if isinstance(event, h11.Request):
                return event
            if isinstance(event, h11.ConnectionClosed):
                return None

    async def _answer(self, request: h11.Request, peer: str) -> Answer:
        method = request.method.decode()
        target = request.target.decode(errors="replace")
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return Answer(405, b"only GET\n", headers={"allow": "GET, HEAD"})
        if self._guard is not None:
            headers = {name.decode().lower(): value.decode(errors="replace") for name, value in request.headers}
            refused = self._guard(headers, path, peer)
            if refused is not None:
                return refused
        handler = self._routes.get(path)
        if handler is None:
            return Answer.text(404, f"not found: try {', '.join(self._routes)}\n")
        try:
            return await handler()
        except Exception:
            log.exception("http: %s failed", path)
            return Answer.text(500, "internal error\n")
