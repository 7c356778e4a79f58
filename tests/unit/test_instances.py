"""What lets two instances of a daemon serve one node during a rolling update: sockets named for each instance, the
leftovers of a killed one removed (a live one's never), the directory's lock taken per change, the checkpoint read
again where the other instance wrote it, a stop that waits for its hand-over, and a port waited for."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuppetti.base import runtime as runtime_module
from gpuppetti.base.dirlock import DirectoryLock
from gpuppetti.base.runtime import Runtime
from gpuppetti.base.sockets import SOCKET_PATH_MAX, listening
from gpuppetti.dra.checkpoint import COMPLETED, Checkpoint, ClaimRecord
from gpuppetti.kit.instances import instance_socket, remove_stale, sockets_like
from gpuppetti.node import httpserver
from gpuppetti.node.httpserver import HttpServer
from gpuppetti.node.metrics import Metrics

UID = "0b3f1d6e-2a4c-4e8f-9a1b-3c5d7e9f1a2b"


@pytest.fixture
def short() -> Iterator[Path]:
    """A directory whose path leaves room for a socket's name (pytest's own may not)."""
    path = Path(tempfile.mkdtemp(prefix="gpi-", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def _dead(path: Path) -> Path:
    with socket.socket(socket.AF_UNIX) as left:
        left.bind(str(path))  # bound and closed, never listened on: what a killed process leaves
    return path


def test_an_instance_names_its_sockets_and_a_long_name_becomes_a_digest(short: Path) -> None:
    tmp_path = short
    assert instance_socket(tmp_path, "dra", None, ".sock") == tmp_path / "dra.sock"
    assert instance_socket(tmp_path, "dra", UID, ".sock") == tmp_path / f"dra-{UID}.sock"
    # Room for the digest's name (41 bytes) but not for the UID's (61).
    deep = tmp_path / ("d" * (60 - len(str(tmp_path)) - 1))
    long = instance_socket(deep, "gpu.example.com", UID, "-reg.sock")
    assert len(str(long)) <= SOCKET_PATH_MAX
    assert long != instance_socket(deep, "gpu.example.com", UID.replace("0", "1"), "-reg.sock")
    assert sockets_like(deep, "gpu.example.com", "-reg.sock") == []
    deep.mkdir()
    _dead(long)
    assert sockets_like(deep, "gpu.example.com", "-reg.sock") == [long]


def test_only_a_killed_instances_sockets_are_removed(short: Path) -> None:
    tmp_path = short
    dead = [_dead(tmp_path / f"dra-{UID}.sock"), _dead(tmp_path / "dra.sock")]
    with socket.socket(socket.AF_UNIX) as live:
        live_path = tmp_path / "dra-1f2e3d4c5b6a7988.sock"
        live.bind(str(live_path))
        live.listen()
        own = _dead(tmp_path / "dra-aaaaaaaaaaaaaaaa.sock")
        others = [_dead(tmp_path / "dra-someone.sock"), _dead(tmp_path / "drax-1f2e3d4c5b6a7988.sock")]
        (tmp_path / "dra-bbbbbbbbbbbbbbbb.sock").write_text("not a socket")
        candidates = sockets_like(tmp_path, "dra", ".sock")
        assert set(candidates) == {*dead, live_path, own, tmp_path / "dra-bbbbbbbbbbbbbbbb.sock"}
        assert listening(live_path) and not listening(dead[0]) and not listening(tmp_path / "missing.sock")
        assert sorted(remove_stale(candidates, [own])) == sorted(dead)
        assert live_path.exists() and own.exists() and all(path.exists() for path in others)


async def test_the_directory_lock_is_taken_in_turns_and_a_cancelled_waiter_holds_nothing(tmp_path: Path) -> None:
    first, second = DirectoryLock(tmp_path, "test"), DirectoryLock(tmp_path, "test")
    order: list[str] = []
    async with first.held():
        waiter = asyncio.create_task(_hold(second, order))
        await asyncio.sleep(0.05)
        assert order == [], "the second waits while the first holds the lock"
        order.append("first done")
    await waiter
    assert order == ["first done", "second"]
    async with first.held():
        cancelled = asyncio.create_task(_hold(second, order))
        await asyncio.sleep(0.02)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
    async with asyncio.timeout(1):
        async with second.held():
            pass


async def _hold(lock: DirectoryLock, order: list[str]) -> None:
    async with lock.held():
        order.append("second")


def test_a_checkpoint_is_read_again_only_where_another_process_wrote_it(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    mine, theirs = Checkpoint(path), Checkpoint(path)
    mine.load()
    theirs.load()
    record = ClaimRecord("uid-1", "default", "one", COMPLETED)
    theirs.save({"uid-1": record})
    assert "uid-1" not in mine.claims
    mine.refresh()
    assert set(mine.claims) == {"uid-1"}
    mine.save({**mine.claims, "uid-2": ClaimRecord("uid-2", "default", "two", COMPLETED)})
    path.write_text("not read again: this process wrote the file last")
    path.unlink()
    mine.save({"uid-2": mine.claims["uid-2"]})
    mine.refresh()
    assert set(mine.claims) == {"uid-2"}
    theirs.refresh()
    assert set(theirs.claims) == {"uid-2"}


async def test_a_stop_waits_for_the_hand_over_before_any_duty_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    async def duty() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            events.append("duty cancelled")

    async def hand_over() -> None:
        events.append("hand-over begins")
        await asyncio.sleep(0.05)
        events.append("hand-over done")

    async def never_done() -> None:
        await asyncio.Event().wait()

    async def start(process: Runtime) -> None:
        process.spawn("duty", duty())
        process.before_stop(hand_over)
        process.before_stop(never_done)
        asyncio.get_running_loop().call_later(0.05, process.request_stop, "asked")

    monkeypatch.setattr(runtime_module, "HANDOVER_S", 0.1)
    await Runtime(whole_process=False).run(start)
    assert events == ["hand-over begins", "hand-over done", "duty cancelled"]


async def test_the_port_another_instance_holds_is_served_once_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpserver, "PORT_POLL_S", 0.02)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    server = HttpServer(Metrics())
    serving = asyncio.create_task(server.serve_once_free(f"127.0.0.1:{port}"))
    await asyncio.sleep(0.1)
    assert not serving.done()
    holder.close()
    async with asyncio.timeout(5):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.02)
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
