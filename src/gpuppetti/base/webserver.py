"""A small HTTP server in the event loop: GET-only routes, one request per connection, bounded in time and size.

Every connection is handled on its own; a request must arrive whole within a deadline and stay small, and each
answer closes the connection. The connections are capped: at the cap, the one that has waited longest for its
request is closed for the newcomer, so connections held open cannot take a liveness probe down, nor use up the
process's file descriptors, which the kubelet's calls need. A client that goes away before its answer is ready
cancels its handler, so abandoned requests build no pages. Nothing here blocks the loop. HTTP itself is h11's: it
parses and frames the messages. aiohttp would do it too, but importing it builds TLS contexts from the system's CA
store, which costs the device plugin a tenth of a second at start and a fifth of its memory, for an endpoint that
speaks plain HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import h11

log = logging.getLogger(__name__)

# A request must arrive whole within this long, and be at most this big: a GET has no body.
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 16 * 1024
SEND_TIMEOUT_S = 10.0
# Probes, a Prometheus and a few `gpuppetti top`s need a handful of connections; the cap keeps the process's
# descriptors for the kubelet's calls, the checkpoint and the files it writes.
MAX_CONNECTIONS = 128
BACKLOG = 128
# Where accept() finds the process (or the system) out of descriptors, it tries again after this pause.
ACCEPT_PAUSE_S = 0.1
SHORT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# A connection that the peer reset before it was accepted: the next one is still there.
TRANSIENT_ACCEPT_ERRORS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})


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
    """GET-only routes on a TCP address, one request per connection. ``start`` listens; ``serve`` accepts and
    answers, each connection a task of its own TaskGroup, until cancelled."""

    def __init__(self, routes: Mapping[str, Handler], guard: Guard | None = None) -> None:
        self._routes = routes
        self._guard = guard
        self._sockets: list[socket.socket] = []
        self.address = ""
        # Every open connection, and, in the order they came, those still waiting for their request.
        self._open: set[asyncio.Task[None]] = set()
        self._reading: dict[asyncio.Task[None], None] = {}
        self._short_of_descriptors_since: float | None = None
        self._refused_while_short = 0

    async def start(self, host: str | None, port: int) -> str:
        """Listen; returns the address bound (for ``:0`` and every address, one that reaches it)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                self._sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    # Each family its own socket, as asyncio binds them: the IPv6 one must leave IPv4 to the other.
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except OSError:
            self._close_sockets()
            raise
        first = self._sockets[0]
        bound = first.getsockname()
        bound_host = str(bound[0])
        if host is None:
            bound_host = "::1" if first.family == socket.AF_INET6 else "127.0.0.1"
        self.address = format_address(bound_host, int(bound[1]))
        return self.address

    async def serve(self) -> None:
        """Accept and answer until cancelled; then close the listeners and every connection."""
        try:
            async with asyncio.TaskGroup() as group:
                for sock in self._sockets:
                    group.create_task(self._accept(sock, group), name=f"http-accept-{sock.getsockname()[1]}")
        finally:
            self._close_sockets()

    async def stop(self) -> None:
        """Close the listeners (``serve``'s end does it too)."""
        self._close_sockets()

    def _close_sockets(self) -> None:
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()

    async def _accept(self, listener: socket.socket, group: asyncio.TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno not in SHORT_OF_RESOURCES:
                    if exc.errno in TRANSIENT_ACCEPT_ERRORS:
                        continue
                    raise
                # The connections are refused in the kernel's backlog meanwhile; one line says so, not one a try.
                self._short_of_descriptors(exc)
                await asyncio.sleep(ACCEPT_PAUSE_S)
                continue
            self._descriptors_back()
            if len(self._open) >= MAX_CONNECTIONS and not self._make_room():
                sock.close()
                continue
            task = group.create_task(self._connection(sock), name="http-connection")
            self._open.add(task)
            self._reading[task] = None
            task.add_done_callback(self._closed)

    def _make_room(self) -> bool:
        """At the cap, the connection that has waited longest for its request gives way: a probe's request comes at
        once, so what gives way is a connection held open by a client that says nothing."""
        if not self._reading:
            return False
        oldest = next(iter(self._reading))
        del self._reading[oldest]
        oldest.cancel()
        return True

    def _closed(self, task: asyncio.Task[None]) -> None:
        self._open.discard(task)
        self._reading.pop(task, None)

    def _short_of_descriptors(self, exc: OSError) -> None:
        self._refused_while_short += 1
        if self._short_of_descriptors_since is None:
            self._short_of_descriptors_since = time.monotonic()
            log.warning("http: cannot accept connections (%s) with %d open; trying again until one can be",
                        exc.strerror or exc, len(self._open))

    def _descriptors_back(self) -> None:
        if self._short_of_descriptors_since is not None:
            log.warning("http: accepting connections again after %.1fs (%d tries refused)",
                        time.monotonic() - self._short_of_descriptors_since, self._refused_while_short)
            self._short_of_descriptors_since = None
            self._refused_while_short = 0

    async def _connection(self, sock: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_REQUEST_BYTES)
        except OSError:
            sock.close()
            return
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
                self._reading.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
                peer = writer.get_extra_info("peername")
                given = await self._answer_while_there(request, str(peer[0]) if peer else "?", reader)
                if given is None:
                    return  # the client went away before its answer was ready
                answer = given
            # h11 frames an answer after a protocol error too (a 400 for a request it could not parse).
            headers = [("content-type", answer.content_type), ("content-length", str(len(answer.body))),
                       ("connection", "close"), *answer.headers.items()]
            data = connection.send(h11.Response(status_code=answer.status, headers=headers))
            data += connection.send(h11.Data(data=answer.body)) + connection.send(h11.EndOfMessage())
            writer.write(data)
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await writer.drain()
        except (OSError, TimeoutError, h11.LocalProtocolError) as exc:
            log.debug("http: connection dropped: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
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

    async def _answer_while_there(self, request: h11.Request, peer: str,
                                  reader: asyncio.StreamReader) -> Answer | None:
        """The answer, or None where the client closed its side first: a scrape that was given up on costs no
        page. (A GET's client sends nothing more until it has its answer; one that half-closes after its request
        would be taken as gone.)"""
        async with asyncio.TaskGroup() as group:
            answering = group.create_task(self._answer(request, peer))
            watching = group.create_task(_until_closed(reader))
            answering.add_done_callback(lambda _: watching.cancel())
            watching.add_done_callback(lambda done: done.cancelled() or answering.cancel())
        return None if answering.cancelled() else answering.result()

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


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Returns once the peer has closed its side (whatever it sent after its request is read and dropped)."""
    with contextlib.suppress(OSError):
        while await reader.read(4096):
            pass
