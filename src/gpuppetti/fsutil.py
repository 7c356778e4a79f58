"""Writing files so that a crash leaves either the old content or the new one, never a torn file."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def sync_directory(directory: Path) -> None:
    """Make renames in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o644, durable: bool = True) -> None:
    """Write to a temporary file beside ``path`` and rename it over ``path``: readers see old or new, never half.

    ``durable`` also fsyncs the file and the directory, so the new content survives a power cut; files that are
    re-derived from durable state at start can skip that cost. Callers serialise their writes to one path
    (the temporary name is fixed).
    """
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{path.name}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    if durable:
        sync_directory(directory)
