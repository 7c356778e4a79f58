"""One runtime per process: every duty is a named task of one TaskGroup, and all of them stop on one path.

The signal handlers are the first thing installed, so a signal at any moment is handled: SIGTERM and SIGINT ask
for a stop (during start-up too, which is then cut short), and SIGHUP asks for a reload, which the process's
reload duty carries out once it runs (a SIGHUP during start-up is deferred, not fatal). A duty that fails stops the
process: the others are cancelled, each cleans up in its own ``finally``, and the failure is reported once.
Duties that must stop in a given order (unregister before the service goes away) are one duty.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from gpuppetti.base import earlysignals

log = logging.getLogger(__name__)

# Sockets, checkpoints and directories get explicit modes; anything else the process creates is private.
UMASK = 0o077
# How long the duties have to finish once cancelled before the ones still running are named in the log and
# cancelled again (a duty that swallowed its cancellation, or waits on something that never comes).
STOP_DEADLINE_S = 10.0
# The longest a stop waits for what runs before it (before_stop), within the pod's 30 s of grace.
HANDOVER_S = 10.0
# How long what the libraries left running once every duty stopped has to end before the loop closes (see
# _let_the_rest_end).
REST_S = 1.0


# Where the hard limit is unlimited (macOS), the most a soft limit may be there (OPEN_MAX).
OPEN_MAX = 10240


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one. Container runtimes and launchd start processes at a soft
    limit of 1,024 or 256 for the sake of select()-era programs; the daemons use epoll and kqueue, and every
    connection to their endpoint, every gRPC stream and every file they write takes a descriptor."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return
    for target in (hard, OPEN_MAX) if hard == resource.RLIM_INFINITY else (hard,):
        if target == resource.RLIM_INFINITY or (soft != resource.RLIM_INFINITY and soft < target):
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError):
                continue  # macOS refuses unlimited, or more than kern.maxfilesperproc: try less
            log.debug("open files: soft limit raised from %s to %s", soft, target)
            return


class StartupError(Exception):
    """A long-running command cannot start; the message says why and what to do."""


class Runtime:
    """``whole_process``: the runtime owns the process's signals and umask, as a daemon's does. A test that runs a
    daemon in its own event loop runs it in a runtime that owns neither, and asks it to stop or reload through
    ``on_signal``, the handler a signal would have called."""

    def __init__(self, whole_process: bool = True) -> None:
        self.whole_process = whole_process
        self.stopping = asyncio.Event()
        self.reload_requested = asyncio.Event()
        self.stop_reason: str | None = None
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._at_end: list[Callable[[], None]] = []
        self._before_stop: list[Callable[[], Awaitable[None]]] = []

    def request_stop(self, why: str) -> None:
        if not self.stopping.is_set():
            log.info("%s; stopping", why)
            self.stop_reason = why
        self.stopping.set()

    def on_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            log.info("received SIGHUP; reloading")
            self.reload_requested.set()
        else:
            self.request_stop(f"received {signal.Signals(signum).name}")

    def at_end(self, release: Callable[[], None]) -> None:
        """Release something that the process's exit would release (a lock), once every duty has stopped: a daemon
        that runs in a test's event loop outlives its runtime."""
        self._at_end.append(release)

    def before_stop(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Await ``hook`` when a stop is asked for, before any duty is cancelled, for at most HANDOVER_S: what a
        process hands to the next one (a rolling update's) while it still serves. Not on a failure."""
        self._before_stop.append(hook)

    def spawn(self, name: str, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Start a duty as a named task of the process's TaskGroup."""
        if self._group is None:
            coroutine.close()
            raise RuntimeError(f"cannot start {name}: the runtime is not running")
        task = self._group.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self, start: Callable[[Runtime], Awaitable[None]]) -> None:
        """Run ``start`` (which builds the process and spawns its duties), then serve until a stop is asked for or
        a duty fails; then cancel every duty and wait for all of them to finish."""
        loop = asyncio.get_running_loop()
        if self.whole_process:
            os.umask(UMASK)
            raise_open_files_limit()
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.add_signal_handler(signum, self.on_signal, signum)
            if earlysignals.take_pending_hangup():
                log.info("received SIGHUP during start-up; reloading once started")
                self.reload_requested.set()
        # The stop deadline's watchdog runs outside the group: the group's exit is what it watches.
        stragglers: asyncio.Task[None] | None = None
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                starting = self.spawn("start", self._start(start))
                await self.stopping.wait()
                for hook in self._before_stop:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(HANDOVER_S):
                            await hook()
                starting.cancel()
                for task in list(self._tasks):
                    task.cancel()
                stragglers = asyncio.create_task(self._report_stragglers(), name="stop-deadline")
        finally:
            if stragglers is not None:
                stragglers.cancel()
            self._group = None
            for release in reversed(self._at_end):
                release()
            if self.whole_process:
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    loop.remove_signal_handler(signum)
                await self._let_the_rest_end(stragglers)

    @staticmethod
    async def _let_the_rest_end(stragglers: asyncio.Task[None] | None) -> None:
        """A process's last moment: tasks that libraries left running are given a moment to end by themselves.
        gRPC's per-call tasks can finish a little after their server has stopped (under load, the call's last event
        is still on its way); cancelled instead by the loop's close, each is logged as an error with a traceback."""
        current = asyncio.current_task()
        rest = {task for task in asyncio.all_tasks() if task is not current and task is not stragglers}
        if rest:
            await asyncio.wait(rest, timeout=REST_S)

    async def _report_stragglers(self) -> None:
        """Outside the group: at each deadline, name the duties that are still stopping and cancel them again."""
        while self._tasks:
            await asyncio.sleep(STOP_DEADLINE_S)
            late = sorted(task.get_name() for task in self._tasks if not task.done())
            if late:
                log.error("still stopping after %.0fs: %s; cancelling them again", STOP_DEADLINE_S, ", ".join(late))
                for task in list(self._tasks):
                    task.cancel()

    async def _start(self, start: Callable[[Runtime], Awaitable[None]]) -> None:
        await start(self)
        if self.whole_process:
            # Everything built at start lives as long as the process: keep the collector from scanning it again.
            gc.freeze()

    async def reloads(self, reload: Callable[[], Awaitable[None]]) -> None:
        """The reload duty: one reload per SIGHUP (several while one runs make one more)."""
        while True:
            await self.reload_requested.wait()
            self.reload_requested.clear()
            await reload()
