"""The ledger: each allocation's slices and what each of its processes holds, kept by the daemon and reached through
a socket (layer/ledger.py), played here by processes speaking the layer's protocol, honest and hostile."""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuppetti.layer import ledger as ledger_module
from gpuppetti.layer.ledger import (
    MAX_CONNECTIONS,
    REQUEST,
    RESERVE,
    SHARED_MAGIC,
    SHARED_SIZE,
    SOCKET_NAME,
    Terms,
)
from tests.ledger_client import LedgerThread, Process, connect

MIB = 1 << 20
BUDGET = 256 * MIB


@pytest.fixture
def served(tmp_path: Path) -> Iterator[LedgerThread]:
    ledgers = LedgerThread(tmp_path / "ledgers")
    yield ledgers
    ledgers.stop()


def used(served: LedgerThread, allocation: str = "a") -> list[int]:
    return [use.used for use in served.usage(allocation)]


def test_hello_names_the_slices_and_hands_over_a_sealed_page(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET, 500), Terms(0)])
    info = os.stat(directory)
    assert stat.S_IMODE(info.st_mode) == 0o755
    assert stat.S_ISSOCK(os.stat(directory / SOCKET_NAME).st_mode)
    assert stat.S_IMODE(os.stat(directory / SOCKET_NAME).st_mode) == 0o666
    process = Process(directory)
    assert process.terms == [(BUDGET, 500), (0, 1000)]
    assert process.header() == (SHARED_MAGIC, 1, 2)
    seals = fcntl.fcntl(process.page_fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL
    with pytest.raises(OSError):
        os.ftruncate(process.page_fd, SHARED_SIZE * 100)
    with pytest.raises(OSError):
        os.ftruncate(process.page_fd, 0)
    process.close()


def test_two_processes_share_the_budget_to_the_byte(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    first, second = Process(directory), Process(directory)
    assert first.reserve(100 * MIB)
    assert second.reserve(BUDGET - 100 * MIB)
    assert not second.reserve(1)
    assert not first.reserve(1)
    assert first.total() == BUDGET == second.total()
    first.release(10 * MIB)
    assert second.reserve(10 * MIB)
    assert not first.reserve(1)
    assert used(served) == [BUDGET]


def test_a_process_that_goes_gives_back_all_it_held_at_once(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    killed, other = Process(directory), Process(directory)
    assert killed.reserve(200 * MIB, heap=0)
    assert killed.reserve(50 * MIB, heap=3)
    assert not other.reserve(10 * MIB)
    killed.sock.close()  # what SIGKILL does to it: the kernel closes the connection
    deadline = time.monotonic() + 5
    while not other.reserve(BUDGET) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert other.total() == BUDGET
    assert other.heap_usage(3) == 0


def test_a_release_gives_back_at_most_what_the_process_holds(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    holder, thief = Process(directory), Process(directory)
    assert holder.reserve(BUDGET)
    thief.release(BUDGET)
    thief.release(BUDGET, heap=5)
    thief.sync()
    assert not thief.reserve(1)
    assert used(served) == [BUDGET]


def test_exported_memory_is_charged_once_while_any_process_holds_it(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    exporter, importer, other = Process(directory), Process(directory), Process(directory)
    key = (64, 123456)
    assert exporter.reserve(100 * MIB)
    exporter.export(100 * MIB, key)
    assert importer.hold(key)
    assert used(served) == [100 * MIB]
    exporter.close()  # the exporter exits: the importer still holds it
    importer.sync()
    assert used(served) == [100 * MIB]
    assert not other.reserve(BUDGET - 100 * MIB + 1)
    importer.unhold(key)
    importer.sync()
    assert used(served) == [0]
    assert other.reserve(BUDGET)


def test_a_process_holding_an_export_that_dies_lets_it_go(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    exporter = Process(directory)
    assert exporter.reserve(64 * MIB)
    exporter.export(64 * MIB, (1, 2))
    exporter.sync()
    assert used(served) == [64 * MIB]
    exporter.close()
    deadline = time.monotonic() + 5
    while used(served) != [0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert used(served) == [0]


def test_memory_not_the_slices_is_not_counted_when_imported(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    importer = Process(directory)
    assert not importer.hold((9, 9))
    assert used(served) == [0]


def test_a_restarted_daemon_learns_what_each_process_declares(served: LedgerThread, tmp_path: Path) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    process = Process(directory)
    assert process.reserve(100 * MIB)
    served.close("a")  # the daemon stops: the connection closes
    with pytest.raises(ConnectionError):
        process.reserve(1)
    again = LedgerThread(tmp_path / "ledgers")
    try:
        again.open("a", [Terms(BUDGET)], restored=True)
        newcomer = Process(directory)
        began = time.monotonic()
        newcomer.send(RESERVE, 0, 0, BUDGET)  # a process that comes before the others have declared: it waits
        back = Process(directory)
        back.declare(100 * MIB)
        back.declare_hold(20 * MIB, (5, 6))
        assert newcomer.answer()[0] == 1, "refused: what the others declared counts"
        assert time.monotonic() - began >= ledger_module.RESTORE_GRACE_S * 0.9
        other = Process(directory)
        assert other.hold((5, 6))
        back.sync()
        assert used(again) == [120 * MIB]
        assert not back.reserve(BUDGET - 120 * MIB + 1)
        back.close()
        other.sync()
        assert used(again) == [20 * MIB]
    finally:
        again.stop()


def test_reservations_of_nothing_and_of_everything(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET), Terms(0)])
    process = Process(directory)
    assert process.reserve(0)
    assert not process.reserve((1 << 64) - 1)
    assert not process.reserve(1 << 63)
    assert not process.reserve(BUDGET + 1)
    # A whole GPU is not limited, and its figures never wrap.
    assert process.reserve((1 << 63) - 1, slice_index=1)
    assert process.reserve((1 << 63) - 1, slice_index=1)
    assert process.total(1) == (1 << 63) - 1
    assert used(served) == [0, (1 << 63) - 1]


@pytest.mark.parametrize("garbage", [
    b"\x00" * 40,
    REQUEST.pack(RESERVE, 0, 0, 0, 1, 0, 0),  # before HELLO
    REQUEST.pack(1, 0, 0, 0, 99, 0, 0),  # a version it does not speak
])
def test_garbage_first_closes_that_connection_only(served: LedgerThread, garbage: bytes) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    honest = Process(directory)
    hostile = connect(directory)
    hostile.sendall(garbage)
    assert hostile.recv(16) == b""
    assert honest.reserve(BUDGET)


@pytest.mark.parametrize("request_fields", [
    (99, 0, 0, 0, 1, 0, 0),  # no such op
    (2, 5, 0, 0, 1, 0, 0),  # no such slice
    (2, 0, 16, 0, 1, 0, 0),  # no such heap
    (2, 0, 0, 7, 1, 0, 0),  # the word that must be 0
    (1, 0, 0, 0, 1, 0, 0),  # HELLO again
])
def test_a_request_that_does_not_parse_closes_its_connection_and_releases_it(
        served: LedgerThread, request_fields: tuple[int, ...]) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    hostile, honest = Process(directory), Process(directory)
    assert hostile.reserve(BUDGET)
    hostile.sock.sendall(REQUEST.pack(*request_fields))
    assert hostile.sock.recv(16) == b""
    deadline = time.monotonic() + 5
    while not honest.reserve(BUDGET) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert honest.total() == BUDGET


def test_ten_thousand_connections_leave_the_others_served(served: LedgerThread) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 12000:
        pytest.skip(f"needs 12,000 descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    hostile_dir = served.open("hostile", [Terms(BUDGET)])
    honest_dir = served.open("honest", [Terms(BUDGET)])
    sockets = []
    try:
        for _ in range(10_000):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            # Where the backlog is full the kernel refuses it, and the daemon never sees it.
            with contextlib.suppress(BlockingIOError, ConnectionRefusedError):
                sock.connect(str(hostile_dir / SOCKET_NAME))
            sockets.append(sock)
        honest = Process(honest_dir)
        assert honest.reserve(BUDGET)
        # The hostile allocation's ledger holds at most its share of connections.
        held = served.run(lambda: len(served.ledgers._open["hostile"][0].connections))
        assert held <= MAX_CONNECTIONS
        # A process of the hostile allocation that comes later is turned away at once (its allocation's own doing),
        # never left hanging.
        began = time.monotonic()
        with pytest.raises(ConnectionError):
            Process(hostile_dir)
        assert time.monotonic() - began < 2
    finally:
        for sock in sockets:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_connection_that_never_says_hello_is_closed(served: LedgerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ledger_module, "HELLO_TIMEOUT_S", 0.2)
    directory = served.open("a", [Terms(BUDGET)])
    silent = connect(directory)
    assert silent.recv(16) == b""
    assert served.run(lambda: len(served.ledgers._open["a"][0].connections)) == 0


def test_a_peer_that_never_reads_stalls_no_one(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    other_dir = served.open("b", [Terms(BUDGET)])
    greedy = Process(directory)
    greedy.sock.setblocking(False)
    request = REQUEST.pack(RESERVE, 0, 0, 0, 0, 0, 0) * 1024
    sent = 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        try:
            sent += greedy.sock.send(request)
        except BlockingIOError:
            time.sleep(0.01)
    assert sent > 64 << 10, "the daemon stopped reading too early to tell"
    # Its answers pile up in its own socket, not in the daemon: the daemon stops reading from it.
    honest = Process(other_dir)
    began = time.monotonic()
    assert honest.reserve(BUDGET)
    assert time.monotonic() - began < 1
    neighbour = Process(directory)
    assert neighbour.reserve(BUDGET)


def test_a_process_that_forks_five_hundred_times_stalls_no_one(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    other_dir = served.open("b", [Terms(BUDGET)])
    parent = Process(directory)
    assert parent.reserve(64 * MIB)
    children = []
    try:
        for _ in range(500):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                try:
                    # Each child shares its parent's connection, sends on it, and waits to be killed.
                    parent.sock.send(REQUEST.pack(RESERVE, 0, 0, 0, MIB, 0, 0))
                    signal.pause()
                finally:
                    os._exit(0)
            children.append(pid)
        honest = Process(other_dir)
        assert honest.reserve(BUDGET)
        neighbour = Process(directory)
        assert not neighbour.reserve(BUDGET)
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        for pid in children:
            os.waitpid(pid, 0)
    parent.close()
    neighbour.sync()
    deadline = time.monotonic() + 5
    while not neighbour.reserve(BUDGET) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert used(served, "a") == [BUDGET]


def test_the_waiting_a_process_writes_is_read_clamped(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET, 250)])
    process = Process(directory)
    process.set_waited(3_000_000_000)
    assert served.usage("a")[0].waited_seconds == 3.0
    process.set_waited(-5)
    assert served.usage("a")[0].waited_seconds == 0.0


def test_a_ledger_closed_disconnects_its_processes_and_its_directory_goes(served: LedgerThread) -> None:
    directory = served.open("a", [Terms(BUDGET)])
    process = Process(directory)
    served.close("a")
    served.run(lambda: served.ledgers.remove("a"))
    assert process.sock.recv(16) == b""
    assert not directory.exists()


def test_a_socket_whose_path_is_too_long_to_bind_is_bound_short_and_moved_into_place(tmp_path: Path) -> None:
    # A DRA request's name may take 63 bytes: its allocation's socket path passes the 107 a socket's may have.
    root = tmp_path / ("d" * max(1, 90 - len(str(tmp_path)))) / "ledgers"
    root.parent.mkdir()
    allocation = f"dra-00000000-0000-0000-0000-000000000000-{'r' * 63}"
    assert len(str(root / allocation / SOCKET_NAME)) > 107
    served = LedgerThread(root)
    try:
        directory = served.open(allocation, [Terms(BUDGET)])
        process = Process(directory)
        assert process.reserve(BUDGET) and not process.reserve(1)
        assert [entry.name for entry in root.parent.iterdir()] == ["ledgers"], "no short name left behind"
        # Served again (a restarted daemon), the socket is replaced in place.
        served.close(allocation)
        served.open(allocation, [Terms(BUDGET)])
        assert Process(directory).reserve(BUDGET)
    finally:
        served.stop()
