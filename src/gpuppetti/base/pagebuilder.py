"""A page built in a thread, one build at a time, for as many requests as arrive meanwhile.

A scrape's page can take a good part of a second to build (it reads every slice's accounting), and the event loop's
default executor is where the daemons write their checkpoints and CDI specs: pages built there, one per request,
would queue a Prepare behind every scrape that anyone started. So the pages have a thread of their own; the requests
that arrive while a page is being built share the next build, which starts once the running one is done (each
request gets a page built after it arrived); and a queued build that every request waiting for it gave up on does
not run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Generic, TypeVar

T = TypeVar("T")


class PageBuilder(Generic[T]):
    """``build`` run in ``executor`` (give several builders one thread and they take turns)."""

    def __init__(self, build: Callable[[], T], executor: Executor) -> None:
        self._build = build
        self._executor = executor
        self._running: asyncio.Future[T] | None = None
        self._next: asyncio.Future[T] | None = None
        self._waiting_for_next = 0
        self.builds = 0

    async def get(self) -> T:
        """A page built after this call began. Cancelling the call leaves a running build to the others."""
        if self._running is None:
            page = self._begin(asyncio.get_running_loop().create_future())
            queued = False
        else:
            if self._next is None:
                self._next = asyncio.get_running_loop().create_future()
                self._waiting_for_next = 0
            page, queued = self._next, True
            self._waiting_for_next += 1
        try:
            return await asyncio.shield(page)
        except asyncio.CancelledError:
            if queued and page is self._next:
                self._waiting_for_next -= 1
            raise

    def _begin(self, page: asyncio.Future[T]) -> asyncio.Future[T]:
        self._running = page
        self.builds += 1
        # Read, so that a failure that nobody waits for any more is not reported as never retrieved.
        page.add_done_callback(lambda done: done.cancelled() or done.exception())
        work = asyncio.wrap_future(self._executor.submit(self._build))
        work.add_done_callback(lambda done: self._built(page, done))
        return page

    def _built(self, page: asyncio.Future[T], work: asyncio.Future[T]) -> None:
        self._running = None
        if work.cancelled():
            page.cancel()
        elif (error := work.exception()) is not None:
            page.set_exception(error)
        else:
            page.set_result(work.result())
        queued, self._next = self._next, None
        if queued is not None:
            if self._waiting_for_next > 0:
                self._begin(queued)
            else:
                queued.cancel()
