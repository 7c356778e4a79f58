"""The kit's Unix-socket endpoint, in-process: what both front ends' sockets are guarded against."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpuppetti.base.sockets import SOCKET_PATH_MAX
from gpuppetti.kit.endpoint import SocketError, UnixEndpoint
from tests.helpers import short_tmpdir


def nothing(server: grpc.aio.Server) -> None:
    pass


@pytest.fixture
def directory() -> Iterator[Path]:
    path = short_tmpdir("gp-kit-")
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


async def test_serves_a_socket_only_root_can_use_and_removes_it_at_stop(directory: Path) -> None:
    endpoint = UnixEndpoint(directory / "a.sock", nothing, 0)
    await endpoint.start()
    st = (directory / "a.sock").lstat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert endpoint.intact() and endpoint.serving
    assert [entry.name for entry in directory.iterdir()] == ["a.sock"], "nothing but the socket is left"
    await endpoint.stop()
    assert not (directory / "a.sock").exists() and not endpoint.serving


async def test_a_stale_socket_is_replaced(directory: Path) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(directory / "a.sock"))
    stale.close()
    endpoint = UnixEndpoint(directory / "a.sock", nothing, 0)
    await endpoint.start()
    assert endpoint.intact()
    await endpoint.stop()


@pytest.mark.parametrize("what", ["file", "directory"])
async def test_something_that_is_not_a_socket_is_said_and_kept(directory: Path, what: str) -> None:
    path = directory / "a.sock"
    path.write_text("mine") if what == "file" else path.mkdir()
    with pytest.raises(SocketError, match=r"is (a directory|a file that is not a socket)"):
        await UnixEndpoint(path, nothing, 0).start()
    assert path.exists()
    if what == "directory":
        path.rmdir()


async def test_a_path_too_long_for_a_unix_socket_is_said(directory: Path) -> None:
    path = directory / ("x" * (SOCKET_PATH_MAX - len(str(directory))))
    with pytest.raises(SocketError, match="Unix sockets allow 107"):
        await UnixEndpoint(path, nothing, 0).start()


async def test_a_socket_deleted_between_bind_and_chmod_is_a_state_to_wait_out(
        directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = UnixEndpoint(directory / "a.sock", nothing, 0)
    real_chmod = os.chmod

    def vanished(path: Path, mode: int, *, follow_symlinks: bool = True) -> None:
        for entry in directory.iterdir():
            entry.unlink()  # the kubelet emptied its directory at that moment
        real_chmod(path, mode, follow_symlinks=follow_symlinks)

    monkeypatch.setattr("gpuppetti.kit.endpoint.os.chmod", vanished)
    with pytest.raises(SocketError, match="vanished as it was created"):
        await endpoint.start()
    assert not endpoint.serving
    assert not list(directory.iterdir())
    monkeypatch.undo()
    await endpoint.start()
    assert endpoint.intact()
    await endpoint.stop()


async def test_stop_leaves_a_socket_that_a_newer_instance_owns(directory: Path) -> None:
    endpoint = UnixEndpoint(directory / "a.sock", nothing, 0)
    await endpoint.start()
    (directory / "a.sock").unlink()
    newer = socket.socket(socket.AF_UNIX)
    newer.bind(str(directory / "a.sock"))
    assert not endpoint.intact()
    await endpoint.stop()
    assert (directory / "a.sock").exists(), "gRPC unlinks the path it bound: that must not be the socket's"
    assert [entry.name for entry in directory.iterdir()] == ["a.sock"]
    newer.close()


@pytest.mark.parametrize("points_to", ["nothing", "a file"])
async def test_a_link_left_at_our_name_is_replaced_and_what_it_points_to_is_left(
        directory: Path, points_to: str) -> None:
    target = directory / "target"
    if points_to == "a file":
        target.write_text("someone's")
    (directory / "a.sock").symlink_to(target)
    endpoint = UnixEndpoint(directory / "a.sock", nothing, 0)
    await endpoint.start()
    assert endpoint.intact() and stat.S_ISSOCK((directory / "a.sock").lstat().st_mode)
    if points_to == "a file":
        assert target.read_text() == "someone's"
    else:
        assert not target.exists()
    await endpoint.stop()
    if points_to == "a file":
        target.unlink()
