"""Giving freed memory back to the system after a burst of work.

Publishing 10,000 devices or preparing a thousand claims in one call builds megabytes of transient objects; once
they are freed, glibc keeps the pages of its heap for the next burst, and a DaemonSet's resident memory stays at
its peak for the process's whole life. ``malloc_trim`` returns the free pages (a few milliseconds). Elsewhere (musl,
macOS) there is no such call, and nothing is done.

glibc also gives each thread that allocates a heap (an arena) of its own, for threads that allocate at once. A
daemon's threads run blocking calls for an event loop, one at a time under the interpreter's lock, so they gain
nothing from it, and what a thread leaves in its own heap (a checkpoint written from one: megabytes of encoding,
freed, around the few blocks kept) stays resident beside the main heap: ``one_heap`` has them all share it.
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


# mallopt's parameter for the most arenas (malloc.h).
_M_ARENA_MAX = -8


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # int mallopt(int param, int value)
    mallopt.restype = ctypes.c_int
    found: Callable[[int, int], int] = mallopt
    return found


def one_heap() -> None:
    """Have every thread allocate from the main heap, where the C library can; call it before starting threads
    (a thread that already has its own heap keeps it)."""
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, 1)


def give_back_free_memory() -> None:
    """Return the heap's free pages to the system, where the C library can."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
