"""Waiting for a condition on state that changes in callbacks: the emulators' observation primitive."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Changes:
    def __init__(self) -> None:
        self._condition = asyncio.Condition()

    async def notify(self) -> None:
        async with self._condition:
            self._condition.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until ``predicate()`` holds; it is re-checked after every notify."""
        async with asyncio.timeout(timeout), self._condition:
            await self._condition.wait_for(predicate)
