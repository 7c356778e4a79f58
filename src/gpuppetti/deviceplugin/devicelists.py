"""ListAndWatch device lists, kept encoded: the kubelet gets bytes joined from per-GPU blocks.

A ListAndWatchResponse is a repeated Device field, so its encoding is the concatenation of each device's framed
encoding. Each GPU's block (the framed Devices of its units) is encoded once and kept while the GPU's health,
NUMA node and units stay the same; a health change re-encodes that GPU's block only, and a list of 10,000 units is
a join of a few hundred byte strings. The wire format is the device plugin's alone: the inventory's snapshot holds
the plan, and this front end encodes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.core.model import Gpu
from gpuppetti.node.inventory import Snapshot
from gpuppetti.sharing.replicas import ResourcePlan, Unit

_BlockKey = tuple[str, str, int | None, tuple[str, ...]]


class DeviceLists:
    """Every resource's encoded list for the newest snapshot asked about, from per-GPU blocks shared by every
    snapshot of one process."""

    def __init__(self) -> None:
        self._blocks: dict[_BlockKey, bytes] = {}
        # The plan and version the lists were encoded for (a snapshot that only refreshes telemetry keeps both).
        self._plan: Mapping[str, ResourcePlan] | None = None
        self._version = -1
        self._lists: dict[str, bytes] = {}

    def of(self, snapshot: Snapshot, resource: str) -> bytes:
        """The encoded ListAndWatchResponse for ``resource`` in ``snapshot`` (empty when it is not advertised)."""
        if snapshot.plan is not self._plan or snapshot.version != self._version:
            self._lists = self._encode(snapshot.plan, snapshot.gpus)
            self._plan, self._version = snapshot.plan, snapshot.version
        return self._lists.get(resource, b"")

    def _block(self, gpu: Gpu, units: Sequence[Unit], fresh: dict[_BlockKey, bytes]) -> bytes:
        key = (gpu.id, str(gpu.health), gpu.numa_node, tuple(unit.id for unit in units))
        block = self._blocks.get(key)
        if block is None:
            devices = []
            for unit in units:
                device = pb.Device(ID=unit.id, health=str(gpu.health))
                if gpu.numa_node is not None and gpu.numa_node >= 0:
                    device.topology.nodes.add(ID=gpu.numa_node)
                devices.append(device)
            block = pb.ListAndWatchResponse(devices=devices).SerializeToString()
        fresh[key] = block
        return block

    def _encode(self, plans: Mapping[str, ResourcePlan], gpus: Mapping[str, Gpu]) -> dict[str, bytes]:
        """Every resource's encoded ListAndWatchResponse. Blocks no longer used are forgotten."""
        fresh: dict[_BlockKey, bytes] = {}
        lists: dict[str, bytes] = {}
        for name, plan in plans.items():
            lists[name] = b"".join(self._block(gpus[gpu_id], units, fresh) for gpu_id, units in plan.by_gpu)
        self._blocks = fresh
        return lists
