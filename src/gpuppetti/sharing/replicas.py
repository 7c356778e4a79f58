"""The device plugin's units: each GPU whole, or time-sliced into replicas, under an extended resource name."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuppetti.core.config import ConfigError, ReplicatedResource, TimeSlicing, resource_name_problem
from gpuppetti.core.model import Gpu
from gpuppetti.sharing.size import Size


def replicas_for(entry: ReplicatedResource, gpu: Gpu) -> int:
    """How many replicas ``entry`` makes of ``gpu``: its count, or one per ``replicasPerCores`` of the GPU's cores."""
    if entry.replicas is not None:
        return entry.replicas
    assert entry.replicas_per_cores is not None
    return max(1, (gpu.cores or 0) // entry.replicas_per_cores)

MAX_DEVICE_ID_LENGTH = 63


@dataclass(frozen=True, slots=True)
class Unit:
    """An allocatable unit: a whole GPU, or one time-sliced replica of it, with its size.

    The id is the GPU id for a whole GPU, and ``<gpu-id>::<n>`` for replica n, as the NVIDIA plugin names them,
    so that tooling which strips the suffix keeps working.
    """

    id: str
    gpu_id: str
    resource: str
    replicas: int
    replica: int | None = None
    size: Size | None = field(default=None, compare=False)

    @property
    def shared(self) -> bool:
        return self.replicas > 1


def replica_unit_id(gpu_id: str, replica: int) -> str:
    return f"{gpu_id}::{replica}"


@dataclass(frozen=True)
class ResourcePlan:
    """The units advertised under one extended resource name."""

    name: str
    units: tuple[Unit, ...]
    by_id: Mapping[str, Unit] = field(compare=False, repr=False)
    # The units of each GPU, GPUs in order: what a device list is built from, one block per GPU.
    by_gpu: tuple[tuple[str, tuple[Unit, ...]], ...] = field(compare=False, repr=False, default=())

    @classmethod
    def of(cls, name: str, units: Iterable[Unit]) -> ResourcePlan:
        ordered = tuple(units)
        per_gpu: dict[str, list[Unit]] = {}
        for unit in ordered:
            per_gpu.setdefault(unit.gpu_id, []).append(unit)
        return cls(name=name, units=ordered, by_id=MappingProxyType({unit.id: unit for unit in ordered}),
                   by_gpu=tuple((gpu_id, tuple(units)) for gpu_id, units in per_gpu.items()))


def _matches(device: str | int, gpu: Gpu) -> bool:
    text = str(device)
    return text == str(gpu.index) or text == gpu.id


def build_plan(gpus: Sequence[Gpu], time_slicing: TimeSlicing, source: str) -> dict[str, ResourcePlan]:
    """Turn GPUs into units per resource name, honouring per-GPU ``devices`` and ``rename``.

    Raises ConfigError when the sharing section cannot be applied to these GPUs, e.g. a ``devices`` entry that
    names no GPU, or a GPU that two entries claim.
    """
    problems: list[tuple[str, str]] = []
    entries = list(enumerate(time_slicing.resources))
    units: dict[str, list[Unit]] = {}
    used_devices: set[tuple[int, int]] = set()

    for gpu in gpus:
        base = gpu.resource_name
        specific = [
            (i, e) for i, e in entries
            if e.name == base and e.devices is not None and any(_matches(d, gpu) for d in e.devices)
        ]
        catch_all = [(i, e) for i, e in entries if e.name == base and e.devices is None]
        if len(specific) > 1:
            where = ", ".join(f"resources[{i}]" for i, _ in specific)
            problems.append((
                f"sharing.timeSlicing.resources[{specific[1][0]}].devices",
                f"GPU {gpu.index} ({gpu.id}) is claimed by more than one entry: {where}",
            ))
            continue
        chosen = specific or catch_all
        for i, e in specific:
            assert e.devices is not None
            used_devices.update((i, j) for j, d in enumerate(e.devices) if _matches(d, gpu))
        replicas = 1
        name = base
        if chosen:
            entry = chosen[0][1]
            replicas = replicas_for(entry, gpu)
            if entry.rename:
                name = entry.rename
            elif time_slicing.rename_by_default and replicas > 1:
                name = f"{base}.shared"
        size = Size.part(gpu, replicas)
        if chosen and chosen[0][1].slice_memory is not None and replicas > 1:
            size = dataclasses.replace(size, memory=chosen[0][1].slice_memory)
        if replicas == 1:
            gpu_units = [Unit(id=gpu.id, gpu_id=gpu.id, resource=name, replicas=1, size=size)]
        else:
            gpu_units = [
                Unit(id=replica_unit_id(gpu.id, n), gpu_id=gpu.id, resource=name, replicas=replicas, replica=n,
                     size=size)
                for n in range(replicas)
            ]
        longest = max(gpu_units, key=lambda u: len(u.id)).id
        if len(longest) > MAX_DEVICE_ID_LENGTH:
            problems.append(
                ("", f"device id {longest!r} is longer than the kubelet's {MAX_DEVICE_ID_LENGTH} characters")
            )
        units.setdefault(name, []).extend(gpu_units)

    for i, entry in entries:
        if entry.devices is None:
            continue
        for j, device in enumerate(entry.devices):
            if (i, j) not in used_devices:
                problems.append((
                    f"sharing.timeSlicing.resources[{i}].devices[{j}]",
                    f"no {entry.name} GPU has index or id {device!r}",
                ))
    for name in units:
        if (problem := resource_name_problem(name)) is not None:
            problems.append(("sharing.timeSlicing", problem))
    if problems:
        raise ConfigError(source, problems)
    return {name: ResourcePlan.of(name, resource_units) for name, resource_units in sorted(units.items())}


@dataclass(frozen=True)
class Remark:
    """Something in a config that does nothing on these GPUs, or costs more than it needs to. A warning where it is
    surely a mistake; a note where it is what a config shared by nodes of several vendors does (an entry for a
    vendor not here)."""

    path: str
    why: str
    warning: bool


def plan_remarks(gpus: Sequence[Gpu], time_slicing: TimeSlicing) -> list[Remark]:
    if not gpus:
        return []
    offered = sorted({gpu.resource_name for gpu in gpus})
    remarks: list[Remark] = []
    for i, entry in enumerate(time_slicing.resources):
        where = f"sharing.timeSlicing.resources[{i}]"
        matching = [gpu for gpu in gpus if gpu.resource_name == entry.name
                    and (entry.devices is None or any(_matches(d, gpu) for d in entry.devices))]
        if not matching:
            remarks.append(Remark(f"{where}.name", f"no GPU here is offered as {entry.name} (here: "
                                  f"{', '.join(offered)}); the entry applies to none on this node", False))
            continue
        if entry.slice_memory is not None:
            for gpu in matching:
                replicas = replicas_for(entry, gpu)
                if gpu.memory_bytes is not None and entry.slice_memory * replicas > gpu.memory_bytes:
                    remarks.append(Remark(f"{where}.sliceMemory", f"{replicas} slices of {entry.slice_memory} bytes "
                                          f"promise more than GPU {gpu.id}'s {gpu.memory_bytes} bytes", True))
        if entry.replicas_per_cores is None:
            continue
        for gpu in matching:
            if gpu.cores is None:
                remarks.append(Remark(f"{where}.replicasPerCores", f"GPU {gpu.id} has no known core count, so it "
                                      "gets 1 replica; give its cores in the config (simulated or virtio), or use "
                                      "replicas", True))
    return remarks
