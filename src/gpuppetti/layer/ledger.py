"""The ledger: each allocation's slices, and what each of its processes holds, kept by the daemon that made it.

The Vulkan layer, in a container's processes, reaches its allocation's ledger through one Unix socket
(``ledger.sock`` in a directory of the daemon's that the container mounts read-only): it reserves before
``vkAllocateMemory`` hands out memory and releases at ``vkFreeMemory``. The wire protocol is
native/vulkan-layer/ledger_protocol.h; this module speaks exactly that, and layer/ledgers.py serves one per allocation.

Why a socket and not a file the container writes: a tenant then has nothing writable on the node, and the kernel
says when a process is gone (its connection closes, however it dies), so what it held comes back at once; exported
memory is charged to its object for as long as a connection of the allocation holds it. What each submit needs (the
compute share's duty cycle) stays out of the socket's way: the daemon hands each process the allocation's shared
page, a memfd sealed so that it can be neither grown nor shrunk, which only that allocation's processes map.

Everything a connection sends is hostile. A request that does not parse closes that connection; an allocation
accepts at most ``MAX_CONNECTIONS`` connections and ``MAX_OBJECTS`` exported objects; a peer that does not read its
answers stops being read (its answers are bounded by what it sent); no figure passes 2**63 - 1. Nothing a connection
does waits on another: each request is handled as it arrives, on the event loop, in constant time.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

VERSION = 1
SOCKET_NAME = "ledger.sock"
MAX_SLICES = 64
HEAPS = 16

HELLO, RESERVE, RELEASE, EXPORT, HOLD, UNHOLD, DECLARE, DECLARE_HOLD = range(1, 9)
OK, REFUSED = 0, 1

REQUEST = struct.Struct("<IIIIQQQ")
ANSWER = struct.Struct("<IIQ")
TERMS = struct.Struct("<qq")

SHARED_MAGIC = b"GPPTLD01"
SHARED_SIZE = 20480
SHARED_HEADER = struct.Struct("<8sII")
SLICE_OFFSET = 64
SLICE_STRIDE = 256
WAITED_OFFSET = 8
TOTAL_OFFSET = 16
HEAP_USAGE_OFFSET = 24

# The most one figure may say: a size past it is refused (a reservation) or clamped (what the page says).
FIGURE_LIMIT = (1 << 63) - 1
# Per allocation: connections (a container's processes; more are closed as they come) and exported objects.
MAX_CONNECTIONS = 256
MAX_OBJECTS = 4096
# A peer whose unread answers pass this stops being read until it reads them.
WRITE_HIGH_WATER = 64 << 10
# How many requests one read may carry before the loop turns to others.
MAX_REQUESTS_PER_READ = 1024
# A connection that has not said HELLO by then is closed: it would hold one of its allocation's connections.
HELLO_TIMEOUT_S = 10.0
# A ledger served again after the daemon restarted answers no reservation for this long: the processes that held
# memory before reconnect as soon as its socket is back (the layer watches its connection) and declare what they
# hold first, so that a process that comes meanwhile cannot take what they hold.
RESTORE_GRACE_S = 2.0


@dataclass(frozen=True)
class Terms:
    """One slice of an allocation: its memory budget (0: a whole GPU, not limited) and its share of the GPU's time
    in thousandths (1000: not throttled; 0: not known to the daemon, the container's env says it)."""

    budget: int
    compute: int = 1000


@dataclass(frozen=True)
class SliceUse:
    """What the ledger says of one slice: its budget, what the allocation's live processes hold (and the exported
    memory one of them still holds), and how long their submits waited for the slice's share of the GPU's time
    (read from the shared page, which the allocation's processes write: clamped)."""

    index: int
    budget: int
    used: int
    waited_seconds: float


def _clamp(value: int) -> int:
    return min(max(value, 0), FIGURE_LIMIT)


class _Object:
    """Exported memory: charged once to its slice while any connection holds it."""

    __slots__ = ("heap", "holders", "size", "slice")

    def __init__(self, slice_index: int, heap: int, size: int) -> None:
        self.slice = slice_index
        self.heap = heap
        self.size = size
        self.holders: set[Connection] = set()


class Ledger:
    """One allocation's ledger: its slices' terms, what each connection holds, its exported objects, and the shared
    page handed to each process."""

    def __init__(self, allocation: str, terms: Sequence[Terms], restored: bool = False) -> None:
        if not 0 < len(terms) <= MAX_SLICES:
            raise ValueError(f"an allocation has 1 to {MAX_SLICES} slices, not {len(terms)}")
        self.allocation = allocation
        self.terms = list(terms)
        self.totals = [0] * len(terms)
        self.heaps = [[0] * HEAPS for _ in terms]
        self.connections: set[Connection] = set()
        self.objects: dict[tuple[int, int], _Object] = {}
        # Until when reservations wait for the processes of before a restart to declare what they hold.
        self.grace_until = time.monotonic() + RESTORE_GRACE_S if restored else 0.0
        self.page_fd = os.memfd_create(f"gpuppetti-ledger-{allocation}"[:200],
                                       os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.page_fd, SHARED_SIZE)
            self.page = mmap.mmap(self.page_fd, SHARED_SIZE)
            SHARED_HEADER.pack_into(self.page, 0, SHARED_MAGIC, VERSION, len(terms))
            fcntl.fcntl(self.page_fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        except OSError:
            os.close(self.page_fd)
            raise

    def retune(self, terms: Sequence[Terms]) -> None:
        """New terms for the same slices (an allocation made again with other budgets): what is held stays."""
        if len(terms) == len(self.terms):
            self.terms = list(terms)

    def usage(self) -> list[SliceUse]:
        uses = []
        for index, terms in enumerate(self.terms):
            waited: int = struct.unpack_from("<q", self.page, SLICE_OFFSET + SLICE_STRIDE * index + WAITED_OFFSET)[0]
            uses.append(SliceUse(index, terms.budget, _clamp(self.totals[index]), _clamp(waited) / 1e9))
        return uses

    def close(self) -> None:
        # Its connections learn of it after this returns (the loop calls their connection_lost): nothing is left
        # for them to give back.
        connections, self.connections = self.connections, set()
        for connection in connections:
            connection.abort()
        self.page.close()
        os.close(self.page_fd)

    # -- what the requests do ----------------------------------------------------------------------------------

    def _change(self, slice_index: int, heap: int, delta: int) -> None:
        total = self.totals[slice_index] = _clamp(self.totals[slice_index] + delta)
        usage = self.heaps[slice_index][heap] = _clamp(self.heaps[slice_index][heap] + delta)
        base = SLICE_OFFSET + SLICE_STRIDE * slice_index
        struct.pack_into("<q", self.page, base + TOTAL_OFFSET, total)
        struct.pack_into("<q", self.page, base + HEAP_USAGE_OFFSET + 8 * heap, usage)

    def reserve(self, connection: Connection, slice_index: int, heap: int, size: int) -> bool:
        budget = self.terms[slice_index].budget
        if budget > 0 and size > budget - self.totals[slice_index]:
            return False
        self._change(slice_index, heap, size)
        connection.add(slice_index, heap, size)
        return True

    def declare(self, connection: Connection, slice_index: int, heap: int, size: int) -> None:
        self._change(slice_index, heap, size)
        connection.add(slice_index, heap, size)

    def release(self, connection: Connection, slice_index: int, heap: int, size: int) -> None:
        self._change(slice_index, heap, -connection.take(slice_index, heap, size))

    def export(self, connection: Connection, slice_index: int, heap: int, size: int, key: tuple[int, int]) -> None:
        """Move what the connection holds into the object (charged once, whoever holds it)."""
        if key in self.objects or len(self.objects) >= MAX_OBJECTS:
            return  # known already (exported twice), or too many: it stays the connection's, charged all the same
        moved = connection.take(slice_index, heap, size)
        charge = _Object(slice_index, heap, moved)
        self.objects[key] = charge
        self.hold(connection, key)

    def hold(self, connection: Connection, key: tuple[int, int]) -> bool:
        charge = self.objects.get(key)
        if charge is None:
            return False
        charge.holders.add(connection)
        connection.objects.add(key)
        return True

    def declare_hold(self, connection: Connection, slice_index: int, heap: int, size: int,
                     key: tuple[int, int]) -> None:
        if key not in self.objects:
            if len(self.objects) >= MAX_OBJECTS:
                self.declare(connection, slice_index, heap, size)
                return
            self.objects[key] = _Object(slice_index, heap, size)
            self._change(slice_index, heap, size)
        self.hold(connection, key)

    def unhold(self, connection: Connection, key: tuple[int, int]) -> None:
        connection.objects.discard(key)
        charge = self.objects.get(key)
        if charge is None:
            return
        charge.holders.discard(connection)
        if not charge.holders:
            del self.objects[key]
            self._change(charge.slice, charge.heap, -charge.size)

    def drop(self, connection: Connection) -> None:
        """A connection closed: its process is gone (or has let go), and everything it held comes back."""
        self.connections.discard(connection)
        for (slice_index, heap), size in connection.held.items():
            self._change(slice_index, heap, -size)
        connection.held.clear()
        for key in list(connection.objects):
            self.unhold(connection, key)


class Connection(asyncio.Protocol):
    """One process's connection to its allocation's ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.greeted = False
        self.held: dict[tuple[int, int], int] = {}
        self.objects: set[tuple[int, int]] = set()
        self.paused = False
        self.closed = False

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    def add(self, slice_index: int, heap: int, size: int) -> None:
        key = (slice_index, heap)
        self.held[key] = _clamp(self.held.get(key, 0) + size)

    def take(self, slice_index: int, heap: int, size: int) -> int:
        """Up to ``size`` of what this connection holds on the slice's heap, no longer held; how much."""
        key = (slice_index, heap)
        held = self.held.get(key, 0)
        taken = min(held, size)
        if taken == held:
            self.held.pop(key, None)
        else:
            self.held[key] = held - taken
        return taken

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        ledger = self.ledger
        if len(ledger.connections) >= MAX_CONNECTIONS:
            log.debug("allocation %s: more than %d connections to its ledger; closing one", ledger.allocation,
                      MAX_CONNECTIONS)
            self.closed = True
            transport.abort()
            return
        ledger.connections.add(self)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self._hello_due)

    def _hello_due(self) -> None:
        if not self.greeted:
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.ledger.connections:
            self.ledger.drop(self)

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    def pause_writing(self) -> None:
        # It sends and does not read: what it sends waits in its own socket until it reads.
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
            self._handle()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._handle()

    def _handle(self) -> None:
        handled = 0
        size = REQUEST.size
        while len(self.buffer) >= size and not self.paused and not self.closed:
            fields = REQUEST.unpack_from(self.buffer)
            if fields[0] in (RESERVE, HOLD) and self._waits():
                return
            del self.buffer[:size]
            if not self._request(*fields):
                log.debug("allocation %s: a request its ledger does not understand; closing its connection",
                          self.ledger.allocation)
                self.abort()
                return
            handled += 1
            if handled >= MAX_REQUESTS_PER_READ and self.transport is not None:
                # The rest after the loop has served others.
                self.transport.pause_reading()
                asyncio.get_running_loop().call_soon(self._resume_reading)
                return

    def _waits(self) -> bool:
        """Whether a reservation must wait for the ledger's grace after a restart; if so, it is handled then."""
        left = self.ledger.grace_until - time.monotonic()
        if left <= 0 or self.transport is None:
            return False
        self.transport.pause_reading()
        asyncio.get_running_loop().call_later(left, self._resume_reading)
        return True

    def _resume_reading(self) -> None:
        if self.transport is not None and not self.closed and not self.paused:
            self.transport.resume_reading()
            self._handle()

    def _answer(self, status: int, count: int = 0, value: int = 0) -> None:
        if self.transport is not None:
            self.transport.write(ANSWER.pack(status, count, value))

    def _request(self, op: int, slice_index: int, heap: int, zero: int, size: int, key_dev: int,
                 key_ino: int) -> bool:
        """Handle one request; False where it does not parse (the connection is then closed)."""
        ledger = self.ledger
        if not self.greeted:
            return op == HELLO and size == VERSION and self._hello()
        if op == HELLO or zero != 0 or op > DECLARE_HOLD or slice_index >= len(ledger.terms) or heap >= HEAPS:
            return False
        key = (key_dev, key_ino)
        if op == RESERVE:
            granted = size <= FIGURE_LIMIT and ledger.reserve(self, slice_index, heap, size)
            self._answer(OK if granted else REFUSED, 0, ledger.totals[slice_index])
        elif op == RELEASE:
            ledger.release(self, slice_index, heap, size)
        elif op == EXPORT:
            ledger.export(self, slice_index, heap, size, key)
        elif op == HOLD:
            self._answer(OK if ledger.hold(self, key) else REFUSED, 0, ledger.totals[slice_index])
        elif op == UNHOLD:
            ledger.unhold(self, key)
        elif op == DECLARE:
            ledger.declare(self, slice_index, heap, min(size, FIGURE_LIMIT))
        else:
            ledger.declare_hold(self, slice_index, heap, min(size, FIGURE_LIMIT), key)
        return True

    def _hello(self) -> bool:
        """The answer, the slices' terms and the shared page's descriptor, in one message: the first this
        connection is sent, so nothing of the transport's can be queued before it."""
        assert self.transport is not None
        ledger = self.ledger
        message = ANSWER.pack(OK, len(ledger.terms), SHARED_SIZE) + b"".join(
            TERMS.pack(terms.budget, terms.compute) for terms in ledger.terms)
        raw = self.transport.get_extra_info("socket")
        try:
            with socket.socket(fileno=os.dup(raw.fileno())) as sock:
                sent = socket.send_fds(sock, [message], [ledger.page_fd])
        except OSError:
            return False
        if sent != len(message):
            # A socket just made holds far more than this: a peer that shrank its buffer to nothing gets nothing.
            return False
        self.greeted = True
        return True
