"""Pages built in a thread of their own, one build at a time, shared by the requests that wait for them."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpuppetti.base.pagebuilder import PageBuilder


class _Slow:
    """A build that waits for the test's word, and counts how many run at once."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.running = 0
        self.most_at_once = 0
        self.made = 0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self.go.wait(5)
        with self._lock:
            self.running -= 1
            self.made += 1
            return self.made


async def test_requests_during_a_build_share_the_next_one_and_never_two_run_at_once() -> None:
    build = _Slow()
    with ThreadPoolExecutor(4) as executor:
        pages = PageBuilder(build, executor)
        first = asyncio.create_task(pages.get())
        await asyncio.sleep(0.05)
        # A hundred requests while the first build runs: one more build, after it, serves them all.
        later = [asyncio.create_task(pages.get()) for _ in range(100)]
        await asyncio.sleep(0.05)
        build.go.set()
        assert await first == 1
        assert set(await asyncio.gather(*later)) == {2}
    assert pages.builds == 2 and build.most_at_once == 1


async def test_a_queued_build_that_every_request_gave_up_on_does_not_run() -> None:
    build = _Slow()
    with ThreadPoolExecutor(1) as executor:
        pages = PageBuilder(build, executor)
        first = asyncio.create_task(pages.get())
        await asyncio.sleep(0.05)
        abandoned = [asyncio.create_task(pages.get()) for _ in range(50)]
        await asyncio.sleep(0.05)
        for request in abandoned:
            request.cancel()
        # The one whose client went away during the build still lets the build finish for the others.
        first.cancel()
        build.go.set()
        await asyncio.gather(*abandoned, first, return_exceptions=True)
        await asyncio.sleep(0.1)
        assert pages.builds == 1 and build.made == 1
        assert await pages.get() == 2, "the next request builds anew"


async def test_a_failed_build_fails_its_requests_and_the_next_one_builds_again() -> None:
    calls = 0

    def build() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("unreadable")
        return "page"

    with ThreadPoolExecutor(1) as executor:
        pages = PageBuilder(build, executor)
        with pytest.raises(OSError, match="unreadable"):
            await pages.get()
        assert await pages.get() == "page"
