"""The one shared state: a frozen snapshot of the node's GPUs, the config, and everything derived from them.

The inventory publishes a new snapshot per change, and every reader uses the snapshot it holds: ListAndWatch,
Allocate, DRA prepare, the slice publisher, the health stream, metrics, reports and the HTTP endpoint. A
health-only change keeps the plan and the pool (they do not depend on health). The snapshot holds no front end's
wire format: each front end encodes what it serves (the device plugin its ListAndWatch lists, the DRA driver its
ResourceSlices). Consumers never poll: they wait for the version to move past the one they last saw.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gpuppetti.core.config import Config
from gpuppetti.core.model import Gpu, Health, Serves
from gpuppetti.sharing.pool import Pool, build_pool
from gpuppetti.sharing.replicas import ResourcePlan, build_plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    version: int
    config: Config
    gpus: Mapping[str, Gpu]
    plan: Mapping[str, ResourcePlan]
    pool: Pool

    def resource(self, name: str) -> ResourcePlan | None:
        return self.plan.get(name)


def _same_but_health(new: Mapping[str, Gpu], old: Mapping[str, Gpu]) -> bool:
    """Whether the GPUs differ at most in health: what the plan and the pool depend on is everything else."""
    if new.keys() != old.keys():
        return False
    for gpu_id, gpu in new.items():
        before = old[gpu_id]
        if gpu != before and dataclasses.replace(gpu, health=before.health) != before:
            return False
    return True


class Inventory:
    """``serves`` says what is derived: the device plugin has no pool and the DRA driver no units (on a large node
    either costs time and memory, for nothing to the front end that does not serve it); the other is then empty."""

    def __init__(self, config: Config, gpus: Iterable[Gpu], serves: Serves = Serves.BOTH) -> None:
        self.serves = serves
        # Raises ConfigError before anything starts if the sharing section does not fit these GPUs.
        self._snapshot = self._build(0, config, {gpu.id: gpu for gpu in gpus}, None)
        self._changed = asyncio.Event()

    def _build(self, version: int, config: Config, gpus: dict[str, Gpu], previous: Snapshot | None) -> Snapshot:
        same_gpus = previous is not None and _same_but_health(gpus, previous.gpus)
        gpu_list = list(gpus.values())
        plan: Mapping[str, ResourcePlan] = MappingProxyType({})
        pool = Pool(config.dra.slicing, MappingProxyType({}))
        if Serves.UNITS in self.serves:
            if previous is not None and same_gpus and config.sharing == previous.config.sharing:
                plan = previous.plan
            else:
                plan = MappingProxyType(build_plan(gpu_list, config.sharing.time_slicing, config.source))
        if Serves.POOL in self.serves:
            if previous is not None and same_gpus and config.dra == previous.config.dra:
                pool = previous.pool
            else:
                pool = build_pool(gpu_list, config.dra)
        return Snapshot(version, config, MappingProxyType(gpus), plan, pool)

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    @property
    def version(self) -> int:
        return self._snapshot.version

    @property
    def config(self) -> Config:
        return self._snapshot.config

    @property
    def gpus(self) -> Mapping[str, Gpu]:
        return self._snapshot.gpus

    @property
    def plan(self) -> Mapping[str, ResourcePlan]:
        return self._snapshot.plan

    def resource(self, name: str) -> ResourcePlan | None:
        return self._snapshot.resource(name)

    def _publish(self, config: Config, gpus: dict[str, Gpu]) -> None:
        self._snapshot = self._build(self._snapshot.version + 1, config, gpus, self._snapshot)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def replace(self, config: Config, gpus: Iterable[Gpu]) -> None:
        """Swap in a new config and GPU list. Raises ConfigError, leaving the old state, if they do not fit."""
        new_gpus = {gpu.id: gpu for gpu in gpus}
        current = self._snapshot
        if config == current.config and new_gpus == dict(current.gpus):
            # Telemetry and where facts came from are not part of a GPU's identity: keep them fresh, wake no one.
            self._snapshot = dataclasses.replace(current, gpus=MappingProxyType(new_gpus))
            return
        self._publish(config, new_gpus)

    def update_gpus(self, gpus: Iterable[Gpu]) -> None:
        self.replace(self._snapshot.config, gpus)

    def set_health(self, gpu_id: str, health: Health, reason: str = "") -> bool:
        """Mark one GPU; returns whether anything changed."""
        gpu = self._snapshot.gpus.get(gpu_id)
        if gpu is None or gpu.health == health:
            return False
        gpus = dict(self._snapshot.gpus)
        gpus[gpu_id] = dataclasses.replace(gpu, health=health)
        log.warning("GPU %s (%s) is now %s%s", gpu_id, gpu.model, health, f": {reason}" if reason else "")
        self._publish(self._snapshot.config, gpus)
        return True

    async def wait_for_change(self, seen: int) -> int:
        """Wait until the version differs from ``seen`` and return the new version."""
        while self._snapshot.version == seen:
            await self._changed.wait()
        return self._snapshot.version
