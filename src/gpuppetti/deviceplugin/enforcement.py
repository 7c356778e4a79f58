"""The device plugin's side of enforced slices: a ledger per Allocate, gone once the kubelet frees its units.

The Device Plugin API never says when a container's units are freed. The kubelet's PodResources API does, on
asking: which device ids of which resource are assigned to containers now. A duty asks it every
``CHECK_INTERVAL_S`` and closes the ledgers of allocations none of whose units is assigned any more. Units are
exclusive, so an Allocate of a unit also closes any earlier allocation that had it; at start, the ledgers of the
allocations the plugin recorded are served again (their containers' processes reconnect and declare what they hold),
except those of units it no longer advertises.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc

from gpuppetti._proto.podresources.v1 import api_pb2 as pb
from gpuppetti._proto.podresources.v1 import api_pb2_grpc as pb_grpc
from gpuppetti.core.model import ContainerEdits
from gpuppetti.layer.ledgers import Ledgers
from gpuppetti.layer.vulkan import LayerDir, Record, terms
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
# How often the records are looked at again while another instance of the plugin serves.
TAKE_OVER_POLL_S = 0.25


def allocation_id(unit_ids: Sequence[str]) -> str:
    digest = hashlib.sha256("\n".join(sorted(unit_ids)).encode()).hexdigest()
    return f"{PREFIX}{digest[:24]}"


async def _no_other() -> bool:
    return False


def pod_resources_socket(device_plugin_dir: Path) -> Path:
    """Beside the device plugin directory, as the kubelet keeps them (/var/lib/kubelet/pod-resources)."""
    return device_plugin_dir.parent / "pod-resources" / "kubelet.sock"


class Enforcer:
    """Allocations' ledgers in an installed layer directory (layer.vulkan.install_layer)."""

    def __init__(self, layer: LayerDir, ledgers: Ledgers, pod_resources: Path, interval: float = CHECK_INTERVAL_S,
                 grace: float = GRACE_S) -> None:
        self.layer = layer
        self.ledgers = ledgers
        self.pod_resources = pod_resources
        self.interval = interval
        self.grace = grace
        # Allocation -> (its units, when it was made, monotonic).
        self._allocations: dict[str, tuple[frozenset[str], float]] = {}
        # Allocation -> each slice's GPU and units, in the order of its slices (for /metrics).
        self._slices: dict[str, list[tuple[str, str]]] = {}
        # Unit -> the (namespace, pod, container) the kubelet last said it is assigned to.
        self._owners: dict[str, tuple[str, str, str]] = {}
        self._said_no_pod_resources = False
        # Set by an Allocate: the kubelet is asked, shortly after, whose container the units went to.
        self._allocated = asyncio.Event()
        # Units the plugin advertises (start's), the ledgers another instance serves now, and whether another
        # instance of the plugin serves at all (the plugin's manager says; see take_over).
        self._advertised: set[str] = set()
        self.elsewhere: set[str] = set()
        self.others_serving: Callable[[], Awaitable[bool]] = _no_other

    async def start(self, advertised: set[str]) -> None:
        """Serve again the ledgers of the recorded allocations whose units are still advertised; forget the rest.
        Those another instance serves now (the other pod of a rolling update) stay its own (``elsewhere``)."""
        self._advertised = advertised
        records = await asyncio.to_thread(self.layer.read_records)
        elsewhere: set[str] = set()
        for allocation, record in records.items():
            if not allocation.startswith(PREFIX) or allocation in self._allocations:
                continue
            if await asyncio.to_thread(self.ledgers.served_elsewhere, allocation):
                elsewhere.add(allocation)
                continue
            if record is not None and record.units and set(record.units) <= advertised:
                try:
                    await self.ledgers.open(allocation, record.terms, restored=True)
                except (OSError, ValueError) as exc:
                    log.error("cannot serve the ledger of allocation %s again: %s", allocation, exc)
                    continue
                # Possibly still in use: the PodResources check decides once its grace has passed.
                self._allocations[allocation] = (frozenset(record.units), time.monotonic() - self.grace)
            else:
                await asyncio.to_thread(self._remove, allocation)
        stray = [a for a in await asyncio.to_thread(self.ledgers.on_disk)
                 if a.startswith(PREFIX) and a not in self._allocations and a not in elsewhere and a not in records]
        for allocation in stray:
            await asyncio.to_thread(self._remove, allocation)
        self.elsewhere = elsewhere

    async def take_over(self) -> None:
        """Duty, done once nothing is left to take: while another instance of the plugin serves (the old pod of a
        rolling update, which may still make allocations), look at the records again, and serve each of its ledgers
        once it has stopped serving it: the processes connected there declare what they hold to this one."""
        while await self._others_hold_any():
            await asyncio.sleep(TAKE_OVER_POLL_S)
            before = set(self.elsewhere)
            await self.start(self._advertised)
            if taken := before - self.elsewhere - self._gone(before):
                log.info("took over the ledger(s) of %d allocation(s) from the plugin's other instance", len(taken))

    async def _others_hold_any(self) -> bool:
        return bool(self.elsewhere) or await self.others_serving()

    def _gone(self, allocations: set[str]) -> set[str]:
        return {allocation for allocation in allocations if allocation not in self._allocations}

    async def allocate(self, given: Sequence[Unit], budgets: Sequence[Budget]) -> ContainerEdits:
        """The allocation's ledger, served, and the edits that put its container under the layer."""
        allocation = allocation_id([unit.id for unit in given])
        units = frozenset(unit.id for unit in given)
        freed = [other for other, (theirs, _) in self._allocations.items() if other != allocation and theirs & units]
        for other in freed:
            self._close(other)
        kept = terms(budgets)
        # One trip to a thread: the freed allocations' files go, this one's socket is bound and its record written.
        listener = await asyncio.to_thread(self._make, allocation, Record(sorted(units), kept), freed)
        if listener is None:
            await self.ledgers.open(allocation, kept)
        else:
            await self.ledgers.serve(allocation, listener, kept)
        self._allocations[allocation] = (units, time.monotonic())
        self._allocated.set()
        self._slices[allocation] = [
            (budget.gpu.id, ",".join(sorted(unit.id for unit in given if unit.gpu_id == budget.gpu.id)))
            for budget in budgets]
        return self.layer.edits(allocation, budgets)

    def slice_uses(self) -> list[SliceRow]:
        """Each held slice, as its ledger says, labelled with who holds it (metrics.SliceUses)."""
        found = []
        owners = self._owners
        for allocation, (units, _) in list(self._allocations.items()):
            holder = next((owners[unit] for unit in sorted(units) if unit in owners), ("", "", ""))
            where = self._slices.get(allocation, [])
            for use in self.ledgers.usage(allocation):
                gpu, unit = where[use.index] if use.index < len(where) else ("", ",".join(sorted(units)))
                found.append(SliceRow(*holder, gpu, unit, use))
        return found

    def _make(self, allocation: str, record: Record, freed: Sequence[str]) -> socket.socket | None:
        """Blocks: the freed allocations' socket and record removed, this one's record written and, where its
        ledger is not served yet, its socket bound."""
        for other in freed:
            self._remove(other)
        self.layer.write_record(allocation, record)
        return None if allocation in self.ledgers else self.ledgers.bind(allocation)

    def _close(self, allocation: str) -> None:
        self.ledgers.close(allocation)
        self._allocations.pop(allocation, None)
        self._slices.pop(allocation, None)

    async def _forget(self, allocation: str) -> None:
        self._close(allocation)
        await asyncio.to_thread(self._remove, allocation)

    def _remove(self, allocation: str) -> None:
        self.ledgers.remove(allocation)
        self.layer.remove_record(allocation)

    async def keep_in_use(self) -> None:
        """Duty: ask the kubelet which units are assigned (and to whom, for /metrics), and close the ledgers of the
        others."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._allocated.wait()
            if self._allocated.is_set():
                # The kubelet records an assignment once Allocate has answered: ask a moment later.
                self._allocated.clear()
                await asyncio.sleep(OWNERS_DELAY_S)
            if self._allocations:
                await self.check()

    async def check(self) -> None:
        assigned = await self._assigned()
        if assigned is None:
            return
        now = time.monotonic()
        gone = [allocation for allocation, (units, made) in self._allocations.items()
                if now - made >= self.grace and not units & assigned]
        for allocation in gone:
            await self._forget(allocation)
        if gone:
            log.info("closed the ledgers of %d freed allocation(s)", len(gone))

    async def _assigned(self) -> set[str] | None:
        if not self.pod_resources.exists():
            if not self._said_no_pod_resources:
                log.info("no kubelet PodResources socket at %s: the ledgers of freed units are closed when the units "
                         "are allocated again", self.pod_resources)
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
        return set(self._owners)
