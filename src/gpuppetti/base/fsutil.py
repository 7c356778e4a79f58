"""Writing files and making directories safely: atomic, with explicit modes, and never through a planted link.

Temporary files get a random name created with O_EXCL (which also refuses a symlink at that name), their mode is
set on the open file whatever the process's umask, and the rename replaces whatever sits at the final name rather
than following it. So a symlink planted in a directory cannot redirect a write, and a crash leaves either the old
content or the new one, never a torn file.

A directory that others could write (a container's, in an earlier version) is removed a level at a time with
directory descriptors, never by path and never through a link, with a bound on the descriptors it holds and the
entries it takes per call.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# Directories a removal holds open at once: a deeper one is moved up to the top of the tree and removed from there.
REMOVE_DEPTH = 32
# Entries a removal takes per call: a tree with more is left for a later call.
REMOVE_ENTRIES = 100_000


def sync_directory(directory: Path) -> None:
    """Make renames in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_directory(path: Path | str, mode: int = 0o755) -> None:
    """Create ``path`` and its missing parents with ``mode``, whatever the umask; an existing one is left alone.

    Never through a link that it did not make: ``path`` itself must not be a link, and each missing directory is
    made in its parent's descriptor and opened from there without following a link, so that a link planted at its
    name meanwhile is refused, not followed. The links among the parents that were there already are the node's
    layout (``/var/run`` to ``/run``), and are followed. Raises NotADirectoryError naming what is in the way."""
    target = os.path.abspath(path)
    missing: list[str] = []
    existing = target
    while True:
        try:
            found = os.lstat(existing)
        except FileNotFoundError:
            head, name = os.path.split(existing)
            if head == existing:
                raise
            missing.append(name)
            existing = head
            continue
        break
    if not missing:
        if stat.S_ISLNK(found.st_mode):
            raise NotADirectoryError(f"{target} is a link: not following it")
        if not stat.S_ISDIR(found.st_mode):
            raise NotADirectoryError(f"{target} is not a directory")
        return
    fd = os.open(existing, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in reversed(missing):
            made = True
            try:
                os.mkdir(name, mode, dir_fd=fd)
            except FileExistsError:
                made = False
            existing = os.path.join(existing, name)
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotADirectoryError(f"{existing} is a link or not a directory: not following it") from None
                raise
            os.close(fd)
            fd = child
            if made:
                os.fchmod(fd, mode)
    finally:
        os.close(fd)


def atomic_write(path: Path | str, data: bytes | Iterable[bytes], mode: int = 0o644, durable: bool = True,
                 make_parent: bool = True) -> None:
    """Write ``data`` to ``path`` atomically: readers see the old content or the new, never half of it. ``data``
    may come in pieces, so that a large file is never held whole in memory.

    ``durable`` also fsyncs the file and the directory, so the new content survives a power cut; files that are
    re-derived from durable state at start can skip that cost. Concurrent writers to one path are safe: each
    thread of each process has its own temporary file, and the last rename wins. A caller writing many files into
    one directory it made sure of passes ``make_parent=False``.
    """
    # Strings rather than Path objects: a CDI spec per claim, a thousand claims per call, and Path costs add up.
    target = os.fspath(path)
    directory, name = os.path.split(target)
    if make_parent:
        make_directory(Path(directory))
    temporary = f"{directory}/.{name}.{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        # O_EXCL creates the file or fails, and never follows a symlink planted at that name.
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        # Left by a crash, or planted: not ours to trust. A random name instead.
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        try:
            os.fchmod(fd, mode)
            if isinstance(data, bytes):
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            else:
                with open(fd, "wb", closefd=False) as stream:
                    for piece in data:
                        stream.write(piece)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    if durable:
        sync_directory(Path(directory))


def open_untrusted(path: str) -> int | None:
    """``path``, in a directory others can write, open for reading: None unless it is a regular file (never
    through a link, never blocking on a FIFO). The caller closes the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def read_untrusted(path: str, limit: int) -> bytes | None:
    """The first ``limit`` bytes of ``path``, as open_untrusted opens it; None where it does not."""
    fd = open_untrusted(path)
    if fd is None:
        return None
    try:
        return os.pread(fd, limit, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


# A sysfs or cgroup file the daemons read is a line or a few hundred: what is past this is not read.
HOST_FILE_LIMIT = 64 * 1024


def read_host_file(path: Path | str, limit: int = HOST_FILE_LIMIT) -> str | None:
    """The text of a file of the host's, as read_host_bytes reads it; None where it does not."""
    data = read_host_bytes(path, limit)
    return None if data is None else data.decode(errors="replace")


def read_host_bytes(path: Path | str, limit: int = HOST_FILE_LIMIT) -> bytes | None:
    """The first ``limit`` bytes of a file of the host's (under ``--host-root``: sysfs, cgroupfs), or None where it
    is not a regular file or cannot be read. Its path may go through links, as sysfs's do; but what is opened must
    be a regular file (sysfs's attributes are), opened without blocking (a FIFO would hang the read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        left = limit
        while left > 0 and (chunk := os.read(fd, min(left, 65536))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def remove_file(path: Path) -> bool:
    """Remove ``path`` if it is there (a symlink itself, never its target); whether something was removed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


@dataclass
class _Level:
    """A directory being emptied: its descriptor, its name in the level above, the subdirectories still to go."""

    fd: int
    name: str
    subdirectories: list[str] = field(default_factory=list)


def remove_tree(path: Path | str, limit: int = REMOVE_ENTRIES) -> str | None:
    """Remove ``path`` and all it holds, in a directory others can write: None once it is gone (or was never there),
    otherwise why some of it is left (call again later). Never raises, never follows a link, never crosses into
    another filesystem, holds at most REMOVE_DEPTH directories open, and takes at most ``limit`` entries."""
    parent, name = os.path.split(os.fspath(path))
    try:
        parent_fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot open {parent}: {exc.strerror or exc}"
    try:
        return _remove_at(parent_fd, name, limit)
    finally:
        os.close(parent_fd)


def _remove_at(parent_fd: int, name: str, limit: int) -> str | None:
    try:
        os.unlink(name, dir_fd=parent_fd)
        return None
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        pass
    except OSError as exc:
        return f"{exc.strerror or exc}"
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{exc.strerror or exc}"
    levels = [_Level(fd, name)]
    try:
        device = os.fstat(fd).st_dev
        return _empty(parent_fd, levels, device, limit)
    except OSError as exc:
        return f"{exc.strerror or exc}"
    finally:
        for level in levels:
            os.close(level.fd)


def _empty(parent_fd: int, levels: list[_Level], device: int, limit: int) -> str | None:
    # Iterative, depth first: a tree as deep as a tenant likes costs no recursion, and its deepest levels are moved
    # up to the top one instead of each holding a descriptor.
    problem: str | None = None
    # Entries given up on this call (inode numbers): not tried again, so that the walk ends.
    stuck: set[int] = set()
    taken = _scan(levels[0], stuck, limit)
    if taken < 0:
        return f"more than {limit} entries: the rest is left for later"
    while levels:
        level = levels[-1]
        if level.subdirectories:
            child = level.subdirectories.pop()
            if len(levels) >= REMOVE_DEPTH:
                moved = f".removing-{secrets.token_hex(8)}"
                try:
                    os.rename(child, moved, src_dir_fd=level.fd, dst_dir_fd=levels[0].fd)
                except OSError as exc:
                    problem = problem or f"{child}: {exc.strerror or exc}"
                    continue
                levels[0].subdirectories.append(moved)
                continue
            try:
                fd = os.open(child, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=level.fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                problem = problem or f"{child}: {exc.strerror or exc}"
                continue
            info = os.fstat(fd)
            if info.st_dev != device:
                os.close(fd)
                problem = problem or f"{child}: another filesystem is mounted there"
                continue
            levels.append(_Level(fd, child))
            count = _scan(levels[-1], stuck, limit - taken)
            if count < 0:
                return f"more than {limit} entries: the rest is left for later"
            taken += count
            continue
        levels.pop()
        os.close(level.fd)
        above = levels[-1].fd if levels else parent_fd
        try:
            os.rmdir(level.name, dir_fd=above)
        except FileNotFoundError:
            pass
        except OSError as exc:
            problem = problem or f"{level.name}: {exc.strerror or exc}"
    return problem


def _scan(level: _Level, stuck: set[int], limit: int) -> int:
    """Unlink what ``level`` holds but directories, which it keeps to descend into; the entries taken, or -1 past
    ``limit``. A file that cannot be unlinked is left (its directory's removal then says why)."""
    taken = 0
    with os.scandir(level.fd) as entries:
        for entry in entries:
            taken += 1
            if taken > limit:
                return -1
            inode = entry.inode()
            if inode in stuck:
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    level.subdirectories.append(entry.name)
                else:
                    os.unlink(entry.name, dir_fd=level.fd)
            except FileNotFoundError:
                pass
            except OSError:
                stuck.add(inode)
    return taken
