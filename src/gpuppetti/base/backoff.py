"""Exponential backoff: the one helper every retry loop uses (registration, the API, the CDI directory)."""

from __future__ import annotations

import asyncio
import contextlib
import random


class Backoff:
    """Delays that double from ``initial`` up to ``maximum``, with a little jitter so that many instances
    retrying the same API server do not move in step."""

    def __init__(self, initial: float = 0.1, maximum: float = 5.0, jitter: float = 0.1) -> None:
        self._initial, self._maximum, self._jitter = initial, maximum, jitter
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._maximum)
        return delay * (1 + random.uniform(0, self._jitter))

    def reset(self) -> None:
        self._next = self._initial

    @property
    def at_maximum(self) -> bool:
        return self._next >= self._maximum

    async def wait(self, wake: asyncio.Event | None = None) -> float:
        """Sleep for the next delay, or until ``wake`` is set; returns the delay it meant to sleep."""
        delay = self.next()
        if wake is None:
            await asyncio.sleep(delay)
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await wake.wait()
        return delay
