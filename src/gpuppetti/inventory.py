"""The one shared state: the node's GPUs, the config, and the units derived from them.

Consumers never poll it: they wait for the version to move past the one they last saw.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Mapping

from gpuppetti.config import Config
from gpuppetti.model import Gpu, Health
from gpuppetti.sharing import ResourcePlan, build_plan

log = logging.getLogger(__name__)


class Inventory:
    def __init__(self, config: Config, gpus: Iterable[Gpu]) -> None:
        gpu_list = list(gpus)
        self._config = config
        self._gpus: dict[str, Gpu] = {gpu.id: gpu for gpu in gpu_list}
        # Raises ConfigError before anything starts if the sharing section does not fit these GPUs.
        self._plan = build_plan(gpu_list, config.sharing.time_slicing, config.source)
        self._version = 0
        self._changed = asyncio.Condition()

    @property
    def version(self) -> int:
        return self._version

    @property
    def config(self) -> Config:
        return self._config

    @property
    def gpus(self) -> Mapping[str, Gpu]:
        return self._gpus

    @property
    def plan(self) -> Mapping[str, ResourcePlan]:
        return self._plan

    def resource(self, name: str) -> ResourcePlan | None:
        return self._plan.get(name)

    async def replace(self, config: Config, gpus: Iterable[Gpu]) -> None:
        """Swap in a new config and GPU list. Raises ConfigError, leaving the old state, if they do not fit."""
        gpu_list = list(gpus)
        plan = build_plan(gpu_list, config.sharing.time_slicing, config.source)
        new_gpus = {gpu.id: gpu for gpu in gpu_list}
        unchanged = config == self._config and new_gpus == self._gpus
        self._config, self._gpus, self._plan = config, new_gpus, plan
        if unchanged:
            # Telemetry and where facts came from are not part of a GPU's identity: keep them fresh, wake no one.
            return
        await self._bump()

    async def update_gpus(self, gpus: Iterable[Gpu]) -> None:
        await self.replace(self._config, gpus)

    async def set_health(self, gpu_id: str, health: Health, reason: str = "") -> bool:
        """Mark one GPU; returns whether anything changed."""
        gpu = self._gpus.get(gpu_id)
        if gpu is None or gpu.health == health:
            return False
        self._gpus[gpu_id] = dataclasses.replace(gpu, health=health)
        log.warning("GPU %s (%s) is now %s%s", gpu_id, gpu.model, health, f": {reason}" if reason else "")
        await self._bump()
        return True

    async def wait_for_change(self, seen: int) -> int:
        """Wait until the version differs from ``seen`` and return the new version."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._version != seen)
            return self._version

    async def _bump(self) -> None:
        async with self._changed:
            self._version += 1
            self._changed.notify_all()
