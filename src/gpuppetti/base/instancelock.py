"""One instance per directory: an advisory lock on the directory itself, which the kernel releases when its
holder dies.

A second plugin (or driver) started on the same directory waits for the first to stop, saying so, instead of
taking its sockets over; when the first stops (or is killed), the second takes over at once. The lock is a flock
on the directory, so nothing is added to it (the kubelet's directories hold only what the kubelet expects), and it
survives PID reuse and PID namespaces; the holder's PID, from /proc/locks, is only for the message.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from gpuppetti.base.dirlock import holder, try_lock

log = logging.getLogger(__name__)

POLL_S = 0.5
REMIND_S = 30.0


class InstanceLock:
    def __init__(self, directory: Path, what: str) -> None:
        self.directory = directory
        self.what = what
        self._fd: int | None = None
        self.waiting_for: str | None = None

    def try_acquire(self) -> bool:
        if (fd := try_lock(self.directory)) is None:
            return False
        self._fd = fd
        self.waiting_for = None
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def acquire(self) -> None:
        """Take the lock, waiting for its holder to stop; logs what it waits for."""
        waited = 0.0
        reminded: float | None = None
        while not self.try_acquire():
            if reminded is None or waited - reminded >= REMIND_S:
                self.waiting_for = (f"another gpuppetti {self.what} ({holder(self.directory)}) serves "
                                    f"{self.directory}")
                log.error("%s; waiting for it to stop before taking over (two instances would steal each "
                          "other's sockets)", self.waiting_for)
                reminded = waited
            await asyncio.sleep(POLL_S)
            waited += POLL_S
        if waited:
            log.info("the other instance stopped; this %s takes over %s", self.what, self.directory)
