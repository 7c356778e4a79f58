"""Keeps the inventory true to the hardware: polls the polling backends, and applies pushed health events.

A GPU that vanishes stays listed as Unhealthy (pods using it keep their allocation, and the kubelet sees capacity
drop to zero healthy); one that appears is added. A GPU marked unhealthy by an event (an NVML XID) stays so until
a quiet period passes without another event, then recovers: NVIDIA's plugin never recovers, and its users have to
restart it by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Sequence

from gpuppetti.config import ConfigError
from gpuppetti.discovery import Backend, EventSource, discover
from gpuppetti.hostagent.client import HostAgentSource
from gpuppetti.inventory import Inventory
from gpuppetti.model import Gpu, Health, HealthEvent

log = logging.getLogger(__name__)

STATIC_BACKENDS = frozenset({"simulated"})


@dataclasses.dataclass
class _Fault:
    reason: str
    at: float


class HealthMonitor:
    def __init__(
        self, inventory: Inventory, backends: Sequence[Backend], agent: HostAgentSource | None = None
    ) -> None:
        self._inventory = inventory
        self._backends = list(backends)
        self.agent = agent
        self._faults: dict[str, _Fault] = {}
        self._recoveries: dict[str, asyncio.Task[None]] = {}

    def set_backends(self, backends: Sequence[Backend]) -> None:
        """Called after a config reload, which may change what is discovered and how."""
        self._backends = list(backends)

    @property
    def polling(self) -> bool:
        return any(backend.name not in STATIC_BACKENDS for backend in self._backends)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._poll(), name="health-poll")
            events: asyncio.Queue[HealthEvent] = asyncio.Queue()
            for backend in self._backends:
                if isinstance(backend, EventSource):
                    group.create_task(self._watch(backend, events), name=f"health-events {backend.name}")
            group.create_task(self._apply_events(events), name="health-apply")
            if self.agent is not None:
                interval = self._inventory.config.host_agent.poll_interval
                group.create_task(self.agent.poll(interval, self.refresh), name="host-agent")

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
        try:
            found = await asyncio.to_thread(discover, self._backends)
        except Exception as exc:  # a backend failing must not take the plugin down with it
            log.error("discovery failed: %s", exc)
            return
        await self.reconcile(found)

    async def reconcile(self, found: Sequence[Gpu]) -> None:
        current = self._inventory.gpus
        seen = {gpu.id for gpu in found}
        result: list[Gpu] = []
        for gpu in found:
            fault = self._faults.get(gpu.id)
            if fault is not None and gpu.health is Health.HEALTHY:
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
            await self._inventory.update_gpus(result)
        except ConfigError as exc:
            log.error("the GPUs changed, but the sharing config does not fit them; keeping the old list:\n%s", exc)

    async def _watch(self, source: EventSource, events: asyncio.Queue[HealthEvent]) -> None:
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def emit(event: HealthEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        watcher = asyncio.create_task(asyncio.to_thread(source.watch, emit, stop))
        try:
            await asyncio.shield(watcher)
        except asyncio.CancelledError:
            stop.set()
            with contextlib.suppress(Exception):
                await watcher
            raise

    async def _apply_events(self, events: asyncio.Queue[HealthEvent]) -> None:
        try:
            while True:
                event = await events.get()
                await self.apply(event)
        finally:
            for task in self._recoveries.values():
                task.cancel()

    async def apply(self, event: HealthEvent) -> None:
        if event.health is Health.HEALTHY:
            self._faults.pop(event.gpu_id, None)
            await self._inventory.set_health(event.gpu_id, Health.HEALTHY, event.reason)
            return
        self._faults[event.gpu_id] = _Fault(event.reason, event.at)
        await self._inventory.set_health(event.gpu_id, Health.UNHEALTHY, event.reason)
        period = self._inventory.config.health.recovery_period
        if period <= 0:
            return
        previous = self._recoveries.pop(event.gpu_id, None)
        if previous is not None:
            previous.cancel()
        self._recoveries[event.gpu_id] = asyncio.create_task(
            self._recover_after(event.gpu_id, period), name=f"recover {event.gpu_id}"
        )

    async def _recover_after(self, gpu_id: str, period: float) -> None:
        await asyncio.sleep(period)
        fault = self._faults.pop(gpu_id, None)
        self._recoveries.pop(gpu_id, None)
        if fault is not None:
            await self._inventory.set_health(
                gpu_id, Health.HEALTHY, f"no new fault for {period:g}s since {fault.reason}"
            )
