"""Writing files and making directories safely: atomic, with explicit modes, and never through a planted link.

Temporary files get a random name created with O_EXCL (which also refuses a symlink at that name), their mode is
set on the open file whatever the process's umask, and the rename replaces whatever sits at the final name rather
than following it. So a symlink planted in a directory cannot redirect a write, and a crash leaves either the old
content or the new one, never a torn file.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path


def sync_directory(directory: Path) -> None:
    """Make renames in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_directory(path: Path, mode: int = 0o755) -> None:
    """Create ``path`` and its missing parents with ``mode``, whatever the umask; an existing one is left alone."""
    if os.path.isdir(path):
        return
    missing: list[Path] = []
    current = path
    while not current.exists() and current != current.parent:
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, mode)
            os.chmod(directory, mode, follow_symlinks=False)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")


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


def create_file(path: str, data: bytes, mode: int, size: int = 0) -> None:
    """Create ``path`` afresh (whatever sat at that name, a planted link included, is removed, never followed):
    ``data``, then zeros up to ``size``, with ``mode`` whatever the umask. Not atomic: for files nobody reads until
    the caller has answered."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        if size:
            os.ftruncate(fd, size)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def read_untrusted(path: str, limit: int) -> bytes | None:
    """The first ``limit`` bytes of ``path``, in a directory others can write: None unless it is a regular file
    (never through a link, never blocking on a FIFO)."""
    spans = read_untrusted_spans(path, [(0, limit)])
    return spans[0] if spans is not None else None


def read_untrusted_spans(path: str, spans: Sequence[tuple[int, int]]) -> list[bytes] | None:
    """The bytes at each (offset, length) of ``path``, with read_untrusted's care; a span past the end is short."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return [os.pread(fd, length, offset) for offset, length in spans]
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
