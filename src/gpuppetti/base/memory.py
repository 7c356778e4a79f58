"""Giving freed memory back to the system after a burst of work.

Publishing 10,000 devices or preparing a thousand claims in one call builds megabytes of transient objects; once
they are freed, glibc keeps the pages of its heap for the next burst, and a DaemonSet's resident memory stays at
its peak for the process's whole life. ``malloc_trim`` returns the free pages (a few milliseconds). Elsewhere (musl,
macOS) there is no such call, and nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        # The process's own symbols, the C library's among them: no search for the library's file.
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]  # int malloc_trim(size_t pad)
    trim.restype = ctypes.c_int
    found: Callable[[int], int] = trim
    return found


def give_back_free_memory() -> None:
    """Return the heap's free pages to the system, where the C library can."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
