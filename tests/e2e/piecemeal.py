"""An HTTP server that answers in pieces: what a client meets on a real network, through ``kubectl port-forward``,
or on loopback once an answer is larger than a socket buffer. Raw asyncio on 127.0.0.1, so that the pieces and the
pauses between them are the test's, not a framework's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from types import TracebackType
from typing import Self


class PiecemealServer:
    """Answers GET ``path`` with ``bodies[path]``, ``piece`` bytes at a time, ``pause`` seconds apart; 404 for any
    other path. With ``content_length`` False the body ends where the connection closes; ``head``, when given, is
    sent instead of the status line and headers (a server that does not speak HTTP)."""

    def __init__(self, bodies: Mapping[str, bytes], piece: int = 1024, pause: float = 0.02,
                 content_length: bool = True, content_type: str = "application/json",
                 head: bytes | None = None) -> None:
        self.bodies = bodies
        self.head = head
        self.piece = piece
        self.pause = pause
        self.content_length = content_length
        self.content_type = content_type
        self.pieces_sent = 0
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            path = request.split(b" ", 2)[1].decode()
            body = self.bodies.get(path)
            status = "200 OK" if body is not None else "404 Not Found"
            body = body if body is not None else b"not found\n"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {self.content_type}\r\nConnection: close\r\n"
            if self.content_length:
                head += f"Content-Length: {len(body)}\r\n"
            writer.write(self.head if self.head is not None else f"{head}\r\n".encode())
            await writer.drain()
            for start in range(0, len(body), self.piece):
                await asyncio.sleep(self.pause)
                writer.write(body[start:start + self.piece])
                await writer.drain()
                self.pieces_sent += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up (a body over its bound): nothing more to send
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
