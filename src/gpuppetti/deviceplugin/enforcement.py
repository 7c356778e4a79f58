"""The device plugin's side of enforced slices: a layer directory per Allocate, gone once the kubelet frees its units.

The Device Plugin API never says when a container's units are freed. The kubelet's PodResources API does, on
asking: which device ids of which resource are assigned to containers now. A duty asks it every
``CHECK_INTERVAL_S`` and removes the directories of allocations none of whose units is assigned any more. Units
are exclusive, so an Allocate of a unit also removes any earlier allocation that had it; at start, directories of
units the plugin no longer advertises go.

Which units an allocation was made for comes from the plugin's own record (LayerDir.records), never from the
directory its container can write. A directory without one (made by an earlier version, which kept the units in the
directory) is unknown until the kubelet says which container holds it: an allocation's name is a digest of its
units, so the container whose units of one resource digest to the name is its holder; none does, it goes.
A directory whose removal cannot finish (a file that cannot go, more entries than one pass takes) is tried again at
each check.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from gpuppetti._proto.podresources.v1 import api_pb2 as pb
from gpuppetti._proto.podresources.v1 import api_pb2_grpc as pb_grpc
from gpuppetti.core.model import ContainerEdits
from gpuppetti.layer.vulkan import MAX_SLICES_READ, LayerDir
from gpuppetti.node.metrics import SliceRow
from gpuppetti.sharing.budgets import Budget
from gpuppetti.sharing.replicas import Unit

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 30.0
# After an Allocate, how long before the kubelet is asked whose container its units went to (for /metrics).
OWNERS_DELAY_S = 2.0
# A directory this young may belong to an Allocate the kubelet has not recorded yet.
GRACE_S = 60.0
PREFIX = "dp-"


def allocation_id(unit_ids: Sequence[str]) -> str:
    digest = hashlib.sha256("\n".join(sorted(unit_ids)).encode()).hexdigest()
    return f"{PREFIX}{digest[:24]}"


def pod_resources_socket(device_plugin_dir: Path) -> Path:
    """Beside the device plugin directory, as the kubelet keeps them (/var/lib/kubelet/pod-resources)."""
    return device_plugin_dir.parent / "pod-resources" / "kubelet.sock"


class Enforcer:
    """Allocation directories in an installed layer directory (layer.vulkan.install_layer)."""

    def __init__(self, layer: LayerDir, pod_resources: Path, interval: float = CHECK_INTERVAL_S,
                 grace: float = GRACE_S) -> None:
        self.layer = layer
        self.pod_resources = pod_resources
        self.interval = interval
        self.grace = grace
        # Allocation -> (its units, when it was made, monotonic).
        self._allocations: dict[str, tuple[frozenset[str], float]] = {}
        # Allocation -> each slice's GPU and units, in the order of its accounting files (for /metrics).
        self._slices: dict[str, list[tuple[str, str]]] = {}
        # Unit -> the (namespace, pod, container) the kubelet last said it is assigned to.
        self._owners: dict[str, tuple[str, str, str]] = {}
        # Allocation -> when it was found without the plugin's record of its units (monotonic): see the module.
        self._unknown: dict[str, float] = {}
        # Allocations freed whose directories are not all removed yet.
        self._leftover: set[str] = set()
        # Allocation -> the units of one resource the kubelet last said a container holds, named as Allocate names
        # them (for the unknown directories).
        self._held: dict[str, frozenset[str]] = {}
        self._said_no_pod_resources = False
        # Set by an Allocate: the kubelet is asked, shortly after, whose container the units went to.
        self._allocated = asyncio.Event()

    async def start(self, advertised: set[str]) -> None:
        """Forget the allocations of units no longer advertised."""
        existing = await asyncio.to_thread(self.layer.existing)
        for allocation, units in existing.items():
            if not allocation.startswith(PREFIX):
                continue
            if units and set(units) <= advertised:
                # Possibly still in use: the PodResources check decides once its grace has passed.
                self._allocations[allocation] = (frozenset(units), time.monotonic() - self.grace)
            elif not units:
                self._unknown[allocation] = time.monotonic() - self.grace
            elif not await asyncio.to_thread(self.layer.remove, allocation):
                self._leftover.add(allocation)

    async def allocate(self, given: Sequence[Unit], budgets: Sequence[Budget]) -> ContainerEdits:
        """The allocation's directory, made anew, and the edits that put its container under the layer."""
        allocation = allocation_id([unit.id for unit in given])
        units = frozenset(unit.id for unit in given)
        freed = [other for other, (theirs, _) in self._allocations.items() if other != allocation and theirs & units]
        memories = [budget.memory for budget in budgets]
        left = await asyncio.to_thread(self._replace, allocation, memories, sorted(units), freed)
        self._leftover.update(left)
        self._leftover.discard(allocation)
        self._unknown.pop(allocation, None)
        for other in freed:
            self._allocations.pop(other, None)
            self._slices.pop(other, None)
        self._allocations[allocation] = (units, time.monotonic())
        self._allocated.set()
        self._slices[allocation] = [
            (budget.gpu.id, ",".join(sorted(unit.id for unit in given if unit.gpu_id == budget.gpu.id)))
            for budget in budgets]
        return self.layer.edits(allocation, budgets)

    def slice_uses(self) -> list[SliceRow]:
        """Each held slice, as its accounting file says, labelled with who holds it (metrics.SliceUses). Blocks:
        it reads the files (in a thread, at scrape time)."""
        found = []
        owners = self._owners
        for allocation, (units, _) in list(self._allocations.items()):
            holder = next((owners[unit] for unit in sorted(units) if unit in owners), ("", "", ""))
            where = self._slices.get(allocation, [])
            for use in self.layer.usage(allocation, len(where) or MAX_SLICES_READ):
                gpu, unit = where[use.index] if use.index < len(where) else ("", ",".join(sorted(units)))
                found.append(SliceRow(*holder, gpu, unit, use))
        return found

    def _replace(self, allocation: str, memories: list[int], units: list[str], freed: list[str]) -> list[str]:
        """Make the allocation's directory anew, removing those of the ``freed``; those not all removed yet."""
        left = [other for other in freed if not self.layer.remove(other)]
        self.layer.create(allocation, memories, units)
        return left

    async def keep_in_use(self) -> None:
        """Duty: ask the kubelet which units are assigned (and to whom, for /metrics), and remove the directories of
        the others."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._allocated.wait()
            if self._allocated.is_set():
                # The kubelet records an assignment once Allocate has answered: ask a moment later.
                self._allocated.clear()
                await asyncio.sleep(OWNERS_DELAY_S)
            if self._allocations or self._unknown or self._leftover:
                await self.check()

    async def check(self) -> None:
        for allocation in sorted(self._leftover):
            if await asyncio.to_thread(self.layer.remove, allocation):
                self._leftover.discard(allocation)
                log.info("removed the rest of the layer directory of allocation %s", allocation)
        assigned = await self._assigned()
        if assigned is None:
            return
        now = time.monotonic()
        for allocation in [a for a in self._unknown if a in self._held]:
            del self._unknown[allocation]
            self._allocations[allocation] = (self._held[allocation], now - self.grace)
            log.info("allocation %s, made by an earlier version, is held by a container: kept", allocation)
        gone = [allocation for allocation, (units, made) in self._allocations.items()
                if now - made >= self.grace and not units & assigned]
        unheld = [allocation for allocation, found in self._unknown.items() if now - found >= self.grace]
        for allocation in gone + unheld:
            if not await asyncio.to_thread(self.layer.remove, allocation):
                self._leftover.add(allocation)
            self._allocations.pop(allocation, None)
            self._unknown.pop(allocation, None)
            self._slices.pop(allocation, None)
        if gone or unheld:
            log.info("removed the layer directories of %d freed allocation(s)", len(gone) + len(unheld))

    async def _assigned(self) -> set[str] | None:
        if not self.pod_resources.exists():
            if not self._said_no_pod_resources:
                log.info("no kubelet PodResources socket at %s: the layer directories of freed units are removed "
                         "when the units are allocated again", self.pod_resources)
                self._said_no_pod_resources = True
            return None
        try:
            async with grpc.aio.insecure_channel(f"unix:{self.pod_resources}") as channel:
                answer = await pb_grpc.PodResourcesListerStub(channel).List(pb.ListPodResourcesRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            log.warning("asking the kubelet's PodResources API which units are assigned failed: %s: %s",
                        exc.code().name, exc.details())
            return None
        self._owners = {device_id: (pod.namespace, pod.name, container.name) for pod in answer.pod_resources
                        for container in pod.containers for devices in container.devices
                        for device_id in devices.device_ids}
        if self._unknown:
            # The kubelet may list a container's units of one resource in several entries (one per NUMA node).
            groups: dict[tuple[str, str, str, str], set[str]] = {}
            for pod in answer.pod_resources:
                for container in pod.containers:
                    for devices in container.devices:
                        key = (pod.namespace, pod.name, container.name, devices.resource_name)
                        groups.setdefault(key, set()).update(devices.device_ids)
            self._held = {allocation_id(list(units)): frozenset(units) for units in groups.values()}
        return set(self._owners)
