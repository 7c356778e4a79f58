from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from gpuppetti.dra.state import _collector_paused, _run_to_the_end


def test_the_collector_is_held_off_while_any_call_runs_and_only_then() -> None:
    assert gc.isenabled()
    with _collector_paused():
        assert not gc.isenabled()
        with _collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "the outer call still runs"
    assert gc.isenabled()
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled(), "held off by someone else: left so"
    finally:
        gc.enable()


async def test_a_cancelled_caller_waits_for_its_thread_to_finish() -> None:
    finished = threading.Event()

    def commit() -> None:
        time.sleep(0.3)
        finished.set()

    task = asyncio.ensure_future(_run_to_the_end(commit))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set(), "the lock it holds would otherwise be released while the thread still saves"
