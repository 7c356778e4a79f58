"""The process runtime, in-process: duties as named tasks of one group, and a stop that names what is late."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from gpuppetti.base import runtime as runtime_module
from gpuppetti.base.runtime import Runtime


async def test_a_failing_duty_stops_the_others_and_is_reported() -> None:
    stopped: list[str] = []

    async def waits(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(name)

    async def fails() -> None:
        raise RuntimeError("broken")

    async def start(process: Runtime) -> None:
        process.spawn("a", waits("a"))
        process.spawn("b", fails())

    with pytest.raises(ExceptionGroup) as failed:
        await Runtime().run(start)
    assert [str(e) for e in failed.value.exceptions] == ["broken"]
    assert stopped == ["a"]


async def test_a_duty_that_will_not_stop_is_named_and_cancelled_again(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(runtime_module, "STOP_DEADLINE_S", 0.05)
    cancellations = 0

    async def stubborn() -> None:
        nonlocal cancellations
        while cancellations < 2:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
            cancellations += 1

    async def start(process: Runtime) -> None:
        process.spawn("stubborn-duty", stubborn())
        process.request_stop("test")

    async with asyncio.timeout(5):
        await Runtime().run(start)
    assert cancellations == 2
    assert "still stopping after 0s: stubborn-duty; cancelling them again" in caplog.text
