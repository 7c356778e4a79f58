"""A lock on a directory, taken for each change of what the directory holds and released after it: two instances
of a daemon serving one directory (the old and the new pod of a rolling update) take turns, each change whole.

A flock on the directory itself, so that nothing is added to it, which the kernel releases when its holder dies;
it is the same lock earlier versions held for their whole life, so an instance of this version waits for one of
those to stop before it changes anything. Taken without blocking the event loop: tried, then tried again after a
short sleep (a change takes milliseconds, and a wait is rare: only while two instances serve at once); a waiter
cancelled meanwhile holds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

log = logging.getLogger(__name__)

FIRST_WAIT_S = 0.002
LONGEST_WAIT_S = 0.1
# A wait this long is said in the log (and again as often), with who holds the lock.
REMIND_S = 10.0


def holder(directory: Path) -> str:
    """The PID that holds a flock on ``directory``, as /proc/locks tells it (as far as this PID namespace sees)."""
    with contextlib.suppress(OSError, ValueError):
        st = directory.stat()
        wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == wanted:
                return f"pid {int(fields[4])}"
    return "another process"


def try_lock(directory: Path) -> int | None:
    """The directory's flock, taken without waiting: the descriptor that holds it (closing it releases it), or None
    where another holds it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class DirectoryLock:
    def __init__(self, directory: Path, what: str) -> None:
        self.directory = directory
        self.what = what
        # What a wait in progress is for (for /healthz); None when nobody waits.
        self.waiting_for: str | None = None

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Hold the lock for the body. Raises OSError when the directory cannot be opened."""
        delay = FIRST_WAIT_S
        waited = reminded = 0.0
        while (fd := try_lock(self.directory)) is None:
            if waited - reminded >= REMIND_S:
                self.waiting_for = f"another {self.what} ({holder(self.directory)}) holds {self.directory}"
                log.warning("%s; waiting for it to finish its change (or to stop)", self.waiting_for)
                reminded = waited
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, LONGEST_WAIT_S)
        self.waiting_for = None
        try:
            yield
        finally:
            os.close(fd)
