"""Unix sockets: how long a path may be, and whether a process listens on one."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

# The longest path a Unix socket may be bound at: sun_path holds 108 bytes on Linux, with its terminating NUL.
SOCKET_PATH_MAX = 107


def listening(path: Path) -> bool:
    """Whether a process listens on the Unix socket at ``path`` (a full backlog counts: it is alive). One
    connect(2), which never waits for the listener: the socket is non-blocking."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC) as probe:
        try:
            probe.connect(str(path))
        except BlockingIOError:
            return True
        except OSError as exc:
            # Refused: a socket file whose listener is gone. Anything else (EACCES, ...) is not ours to judge, and
            # counts as alive.
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK, errno.ENOTDIR)
    return True
