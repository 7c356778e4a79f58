"""A client of a ledger's socket, speaking native/vulkan-layer/ledger_protocol.h as the layer does, for the tests
that play a process of a container (and a hostile one)."""

from __future__ import annotations

import asyncio
import mmap
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpuppetti.core.model import ContainerEdits
from gpuppetti.layer.ledger import (
    ANSWER,
    DECLARE,
    DECLARE_HOLD,
    EXPORT,
    HEAP_USAGE_OFFSET,
    HELLO,
    HOLD,
    RELEASE,
    REQUEST,
    RESERVE,
    SHARED_HEADER,
    SLICE_OFFSET,
    SLICE_STRIDE,
    SOCKET_NAME,
    TERMS,
    TOTAL_OFFSET,
    UNHOLD,
    VERSION,
    WAITED_OFFSET,
    SliceUse,
    Terms,
)
from gpuppetti.layer.ledgers import Ledgers
from gpuppetti.layer.vulkan import LayerDir, terms
from gpuppetti.sharing.budgets import Budget

T = TypeVar("T")


def connect(path: Path) -> socket.socket:
    """A socket connected to the ledger at ``path`` (a socket, or the directory holding it), however long."""
    if path.is_dir():
        path = path / SOCKET_NAME
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)
    return sock


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the ledger closed the connection")
        data += chunk
    return data


class Process:
    """One process's connection, as the layer holds it."""

    def __init__(self, path: Path) -> None:
        self.sock = connect(path)
        self.sock.sendall(REQUEST.pack(HELLO, 0, 0, 0, VERSION, 0, 0))
        message, fds, _, _ = socket.recv_fds(self.sock, ANSWER.size + TERMS.size * 64, 4)
        if len(message) < ANSWER.size or not fds:
            raise ConnectionError("no answer to HELLO")
        status, count, size = ANSWER.unpack_from(message)
        rest = message[ANSWER.size:]
        while len(rest) < TERMS.size * count:
            rest += _exactly(self.sock, TERMS.size * count - len(rest))
        self.status = status
        self.terms = [TERMS.unpack_from(rest, TERMS.size * i) for i in range(count)]
        self.page_fd = fds[0]
        for extra in fds[1:]:
            os.close(extra)
        self.page = mmap.mmap(self.page_fd, size)

    def send(self, op: int, slice_index: int = 0, heap: int = 0, size: int = 0, key: tuple[int, int] = (0, 0),
             zero: int = 0) -> None:
        self.sock.sendall(REQUEST.pack(op, slice_index, heap, zero, size, *key))

    def answer(self) -> tuple[int, int]:
        status, _, value = ANSWER.unpack(_exactly(self.sock, ANSWER.size))
        return status, value

    def reserve(self, size: int, slice_index: int = 0, heap: int = 0) -> bool:
        self.send(RESERVE, slice_index, heap, size)
        return self.answer()[0] == 0

    def release(self, size: int, slice_index: int = 0, heap: int = 0) -> None:
        self.send(RELEASE, slice_index, heap, size)

    def export(self, size: int, key: tuple[int, int], slice_index: int = 0, heap: int = 0) -> None:
        self.send(EXPORT, slice_index, heap, size, key)

    def hold(self, key: tuple[int, int], slice_index: int = 0) -> bool:
        self.send(HOLD, slice_index, 0, 0, key)
        return self.answer()[0] == 0

    def unhold(self, key: tuple[int, int], slice_index: int = 0) -> None:
        self.send(UNHOLD, slice_index, 0, 0, key)

    def declare(self, size: int, slice_index: int = 0, heap: int = 0) -> None:
        self.send(DECLARE, slice_index, heap, size)

    def declare_hold(self, size: int, key: tuple[int, int], slice_index: int = 0, heap: int = 0) -> None:
        self.send(DECLARE_HOLD, slice_index, heap, size, key)

    def sync(self) -> None:
        """Wait until the ledger has handled everything sent before (a reservation of 0 is answered in order)."""
        self.reserve(0)

    def total(self, slice_index: int = 0) -> int:
        value: int = struct.unpack_from("<q", self.page, SLICE_OFFSET + SLICE_STRIDE * slice_index + TOTAL_OFFSET)[0]
        return value

    def heap_usage(self, heap: int, slice_index: int = 0) -> int:
        offset = SLICE_OFFSET + SLICE_STRIDE * slice_index + HEAP_USAGE_OFFSET + 8 * heap
        value: int = struct.unpack_from("<q", self.page, offset)[0]
        return value

    def set_waited(self, nanoseconds: int, slice_index: int = 0) -> None:
        struct.pack_into("<q", self.page, SLICE_OFFSET + SLICE_STRIDE * slice_index + WAITED_OFFSET, nanoseconds)

    def header(self) -> tuple[bytes, int, int]:
        magic, version, slices = SHARED_HEADER.unpack_from(self.page)
        return magic, version, slices

    def close(self) -> None:
        self.sock.close()
        self.page.close()
        os.close(self.page_fd)


class LedgerThread:
    """The daemon's ledgers served on an event loop of their own, in a thread: a test then plays the containers'
    processes with blocking calls, as they are."""

    def __init__(self, root: Path) -> None:
        self.ledgers = Ledgers(root)
        self.loop = asyncio.new_event_loop()
        # What the loop would only have logged (an exception in a callback): stop() fails on it.
        self.errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _, context: self.errors.append(context))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def run(self, function: Callable[[], T]) -> T:
        """``function`` on the ledgers' loop, between two of its callbacks."""
        async def inside() -> T:
            return function()
        return self.call(inside())

    def open(self, allocation: str, terms: Sequence[Terms], restored: bool = False) -> Path:
        self.call(self.ledgers.open(allocation, terms, restored))
        return self.ledgers.directory(allocation)

    def close(self, allocation: str) -> None:
        self.run(lambda: self.ledgers.close(allocation))

    def usage(self, allocation: str) -> list[SliceUse]:
        return self.run(lambda: self.ledgers.usage(allocation))

    def stop(self) -> None:
        self.run(self.ledgers.close_all)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        assert not self.errors, self.errors


class ServedLayer:
    """An installed layer directory whose allocations' ledgers are served in a thread (LedgerThread), as a daemon
    serves them: what a test, a tool or the bench hands a workload that it then waits on with blocking calls."""

    def __init__(self, path: Path, built: Path | None = None) -> None:
        self.layer = LayerDir(path)
        if built is None:
            self.layer.install()
        else:
            self.layer.install(built)
        self.served = LedgerThread(self.layer.ledgers)

    def allocation(self, budgets: Sequence[Budget]) -> tuple[str, ContainerEdits]:
        """A fresh allocation held to ``budgets``: its name, and its container's edits."""
        name = f"t-{secrets.token_hex(4)}"
        self.served.open(name, terms(budgets))
        return name, self.layer.edits(name, budgets)

    def host_env(self, name: str, edits: ContainerEdits) -> dict[str, str]:
        """The edits' env for a process of this host (no container): the ledger named where it is here."""
        return {**edits.env, "GPUPPETTI_VK_LEDGER": str(self.layer.ledgers / name / SOCKET_NAME)}

    def usage(self, name: str) -> list[SliceUse]:
        return self.served.usage(name)

    def stop(self) -> None:
        self.served.stop()


async def handed_over(tenant: Process, ledger: Path, new: Any) -> None:
    """After the old instance stopped: its process ``tenant`` lost its connection, the new instance ``new`` (a
    Daemon) says it took the ledger over, and a process started now reaches it at the same path."""
    with pytest.raises((ConnectionError, OSError)):
        await asyncio.to_thread(tenant.sync)
    tenant.close()
    await new.wait_for_log("took over the ledger")
    later = await asyncio.to_thread(Process, ledger)
    await asyncio.to_thread(later.sync)
    later.close()
