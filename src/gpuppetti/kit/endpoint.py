"""A gRPC server on a Unix socket of ours, as the kubelet's plugins serve: the device plugin's resources, the DRA
service and the DRA registration all serve through it.

What it guards against: a path too long for a Unix socket, a file or directory where ours goes (said, and kept: it
may be someone's), a stale socket or a symbolic link (dangling or not) left at our name by an earlier instance
(replaced: the name is ours, named for this instance or waited for until no other listens on it; the link itself
goes, never what it points to), the socket deleted or replaced
between bind and chmod (the kubelet empties its directories when it starts), and removing at stop a socket that a
newer instance owns now.

The server binds a hidden name of its own in the same directory, made root-only there, and that name is renamed onto
the socket's path: the socket appears whole, already private (the kubelet's plugin watcher ignores hidden names, and
takes a rename as a creation), and gRPC, which unlinks the path it bound when its server stops, then unlinks nothing
of anyone else's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

import grpc

from gpuppetti.base.grpcutil import new_server
from gpuppetti.base.sockets import SOCKET_PATH_MAX

log = logging.getLogger(__name__)



class SocketError(Exception):
    """The socket cannot be served at its path now; the message says why. A state to wait out, or to report."""


class UnixEndpoint:
    """One grpc.aio server on one Unix socket; ``setup`` adds the services to each new server."""

    def __init__(self, path: Path, setup: Callable[[grpc.aio.Server], None], grace_s: float) -> None:
        self.path = path
        self._setup = setup
        self._grace_s = grace_s
        self._server: grpc.aio.Server | None = None
        self._inode: int | None = None
        # Why the socket could not be served at the last try (for /healthz); None once it is served.
        self.problem: str | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    def intact(self) -> bool:
        """Whether our socket file is still there, and still the one our server bound."""
        if self._server is None or self._inode is None:
            return False
        try:
            st = self.path.lstat()
        except OSError:
            return False
        return stat.S_ISSOCK(st.st_mode) and st.st_ino == self._inode

    async def start(self) -> None:
        """Serve on a fresh socket (stopping a server of ours first). Raises SocketError."""
        await self.stop()
        bound = self.path.with_name(f".gp-{secrets.token_hex(4)}.sock")
        for path in (self.path, bound):
            if len(str(path)) > SOCKET_PATH_MAX:
                which = "socket path" if path == self.path else "the name the socket is first bound at,"
                raise SocketError(f"{which} {path} is {len(str(path))} bytes; Unix sockets allow {SOCKET_PATH_MAX}")
        try:
            st = self.path.lstat()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise SocketError(f"cannot look at {self.path}: {exc.strerror}") from exc
        else:
            if stat.S_ISDIR(st.st_mode) or not (stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a file that is not a socket"
                raise SocketError(f"{self.path} is {kind}; the socket cannot be created there")
            # A socket or a link left at our name by an earlier instance: nobody listens on our name but us. A link
            # goes itself (unlink never follows it), whatever it points to, if anything.
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        server = new_server()
        self._setup(server)
        try:
            server.add_insecure_port(f"unix:{bound}")
        except RuntimeError as exc:
            raise SocketError(f"cannot create socket {self.path}: {exc}") from exc
        await server.start()
        try:
            # Only the kubelet (root) has any business on this socket.
            os.chmod(bound, 0o600, follow_symlinks=False)
            self._inode = bound.lstat().st_ino
            os.rename(bound, self.path)
        except OSError as exc:
            # The directory emptied (or replaced) as the socket was made.
            await server.stop(0)
            with contextlib.suppress(OSError):
                bound.unlink()
            raise SocketError(f"{self.path} vanished as it was created ({exc.strerror})") from exc
        self._server = server

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        await server.stop(self._grace_s)
        # Remove the socket only if it is still ours: a newer instance may own the name now.
        with contextlib.suppress(OSError):
            if self.path.lstat().st_ino == self._inode:
                self.path.unlink()
        self._inode = None
