"""The process runtime, in-process: duties as named tasks of one group, and a stop that names what is late."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

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


async def test_a_process_lets_what_a_library_left_running_end_before_it_returns() -> None:
    # As gRPC's per-call tasks do: one ends a moment after the duty that made it has stopped. Cancelled by the loop's
    # close instead, gRPC logs it as an error with a traceback.
    ended: list[str] = []
    left: set[asyncio.Task[None]] = set()

    async def a_call() -> None:
        await asyncio.sleep(0.05)
        ended.append("call")

    async def start(process: Runtime) -> None:
        left.add(asyncio.get_running_loop().create_task(a_call()))
        process.request_stop("test")

    async with asyncio.timeout(5):
        await Runtime().run(start)
    assert ended == ["call"]


async def test_a_runtime_that_is_not_its_process_leaves_its_signals_and_umask_and_releases_at_the_end() -> None:
    """What a test's in-process daemon runs in: stopped through on_signal, what the exit would release released
    once every duty has stopped."""
    loop = asyncio.get_running_loop()
    umask = os.umask(0o022)
    os.umask(umask)
    events: list[str] = []

    async def duty() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            events.append("duty stopped")

    async def start(process: Runtime) -> None:
        process.spawn("duty", duty())
        process.at_end(lambda: events.append("released"))
        assert not loop.remove_signal_handler(signal.SIGTERM), "no handler of its own"
        process.on_signal(signal.SIGTERM)

    runtime = Runtime(whole_process=False)
    async with asyncio.timeout(5):
        await runtime.run(start)
    assert events == ["duty stopped", "released"]
    assert runtime.stop_reason == "received SIGTERM"
    assert os.umask(umask) == umask


def test_a_daemon_raises_its_soft_limit_on_open_files_to_the_hard_one() -> None:
    # In a process of its own, started at a container runtime's soft limit of 1,024.
    import resource
    import subprocess
    import sys

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit on open files here is {hard}: nothing to raise")
    code = ("import asyncio, resource\n"
            "from gpuppetti.base.runtime import Runtime\n"
            "async def start(runtime): runtime.request_stop('done')\n"
            "asyncio.run(Runtime().run(start))\n"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))).stdout
    soft, after_hard = map(int, out.split())
    assert soft == after_hard == hard
