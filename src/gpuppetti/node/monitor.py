"""Keeps the inventory true to the hardware: polls the polling backends, and applies pushed health events.

A GPU that vanishes stays listed as Unhealthy (pods using it keep their allocation, and the kubelet sees capacity
drop to zero healthy); one that appears is added. A GPU marked unhealthy by an event (an NVML XID) stays so until
a quiet period passes without another event, then recovers: NVIDIA's plugin never recovers, and its users have to
restart it by hand.

Its duties (polling, one watcher per event source, applying events, recoveries, the host agent) are spawned by the
process's runtime, as named tasks of its one TaskGroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from gpuppetti.core.config import ConfigError
from gpuppetti.core.model import Gpu, Health, HealthEvent
from gpuppetti.discovery import Backend, EventSource, discover
from gpuppetti.hostagent.client import HostAgentSource
from gpuppetti.node.inventory import Inventory

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Fault:
    reason: str
    at: float
    # When the GPU recovers without a new fault (monotonic time); None never.
    recover_at: float | None


class HealthMonitor:
    def __init__(
        self, inventory: Inventory, backends: Sequence[Backend], agent: HostAgentSource | None = None
    ) -> None:
        self._inventory = inventory
        self._backends = list(backends)
        self.agent = agent
        self._faults: dict[str, _Fault] = {}
        self._events: asyncio.Queue[HealthEvent] = asyncio.Queue()
        # Wakes the recovery duty when a fault's deadline moves.
        self._faults_changed = asyncio.Event()
        # Held by whoever discovers and applies what it found: the health poll's and the host agent's refreshes, a
        # config reload. One at a time, each reading the agent's facts once it holds this: a slow discovery begun
        # before the agent answered (or with the backends a reload replaced) must not land after a newer one.
        self.discovering = asyncio.Lock()

    def set_backends(self, backends: Sequence[Backend]) -> None:
        """Called after a config reload, which may change what is discovered and how."""
        self._backends = list(backends)

    @property
    def polling(self) -> bool:
        return any(backend.polls for backend in self._backends)

    def duties(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """The named duties to spawn; event sources are those of the backends at start."""
        duties: list[tuple[str, Coroutine[Any, Any, None]]] = [
            ("health-poll", self._poll()),
            ("health-apply", self._apply_events()),
            ("health-recovery", self._recover()),
        ]
        for backend in self._backends:
            if isinstance(backend, EventSource):
                duties.append((f"health-events {backend.name}", self._watch(backend)))
        if self.agent is not None:
            interval = self._inventory.config.host_agent.poll_interval
            duties.append(("host-agent", self.agent.poll(interval, self.refresh)))
        return duties

    async def _poll(self) -> None:
        while True:
            interval = self._inventory.config.health.poll_interval
            if not self.polling:
                # Nothing here can change by itself; a reload (which may add a real backend) wakes us.
                await self._inventory.wait_for_change(self._inventory.version)
                continue
            await asyncio.sleep(interval)
            await self.refresh()

    async def refresh(self) -> None:
        """Discover again and reconcile with what the inventory holds."""
        async with self.discovering:
            facts = self.agent.current() if self.agent is not None else None
            try:
                found = await asyncio.to_thread(discover, self._backends, facts)
            except Exception as exc:  # a backend failing must not take the plugin down with it
                log.error("discovery failed: %s", exc)
                return
            await self.reconcile(found)

    async def reconcile(self, found: Sequence[Gpu]) -> None:
        current = self._inventory.gpus
        seen = {gpu.id for gpu in found}
        result: list[Gpu] = []
        for gpu in found:
            if gpu.id in self._faults and gpu.health is Health.HEALTHY:
                gpu = dataclasses.replace(gpu, health=Health.UNHEALTHY)
            if gpu.id not in current:
                log.info("GPU %s (%s) appeared", gpu.id, gpu.model)
            elif current[gpu.id].health != gpu.health:
                log.warning("GPU %s (%s) is now %s", gpu.id, gpu.model, gpu.health)
            result.append(gpu)
        for gpu_id, gpu in current.items():
            if gpu_id in seen:
                continue
            if gpu.health is Health.HEALTHY:
                log.warning("GPU %s (%s) vanished; marking it Unhealthy", gpu_id, gpu.model)
            result.append(dataclasses.replace(gpu, health=Health.UNHEALTHY))
        try:
            self._inventory.update_gpus(result)
        except ConfigError as exc:
            log.error("the GPUs changed, but the sharing config does not fit them; keeping the old list:\n%s", exc)

    async def _watch(self, source: EventSource) -> None:
        """A blocking event source (NVML's XID wait) runs in a thread; its events come back to the loop."""
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def emit(event: HealthEvent) -> None:
            loop.call_soon_threadsafe(self._events.put_nowait, event)

        try:
            await asyncio.to_thread(source.watch, emit, stop)
        finally:
            # Cancelled: the thread sees this within its wait timeout and returns; the loop's executor waits for it.
            stop.set()

    async def _apply_events(self) -> None:
        while True:
            await self.apply(await self._events.get())

    async def apply(self, event: HealthEvent) -> None:
        if event.health is Health.HEALTHY:
            self._faults.pop(event.gpu_id, None)
            self._faults_changed.set()
            self._inventory.set_health(event.gpu_id, Health.HEALTHY, event.reason)
            return
        period = self._inventory.config.health.recovery_period
        recover_at = time.monotonic() + period if period > 0 else None
        self._faults[event.gpu_id] = _Fault(event.reason, event.at, recover_at)
        self._faults_changed.set()
        self._inventory.set_health(event.gpu_id, Health.UNHEALTHY, event.reason)

    async def _recover(self) -> None:
        """One timer for every fault: a GPU is healthy again once its quiet period passed without a new fault."""
        while True:
            self._faults_changed.clear()
            now = time.monotonic()
            due = [(gpu_id, fault) for gpu_id, fault in self._faults.items()
                   if fault.recover_at is not None and fault.recover_at <= now]
            for gpu_id, fault in due:
                del self._faults[gpu_id]
                period = self._inventory.config.health.recovery_period
                self._inventory.set_health(gpu_id, Health.HEALTHY,
                                                 f"no new fault for {period:g}s since {fault.reason}")
            deadlines = [f.recover_at for f in self._faults.values() if f.recover_at is not None]
            wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._faults_changed.wait()
