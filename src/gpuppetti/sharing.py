"""The sharing policy: how GPUs become allocatable units, and which units to prefer for a request."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gpuppetti.config import ConfigError, TimeSlicing, resource_name_problem
from gpuppetti.model import Gpu, Unit, replica_unit_id

AllocationPolicy = Literal["distributed", "packed"]
MAX_DEVICE_ID_LENGTH = 63


@dataclass(frozen=True)
class ResourcePlan:
    """The units advertised under one extended resource name."""

    name: str
    units: tuple[Unit, ...]
    by_id: dict[str, Unit] = field(compare=False, repr=False)

    @classmethod
    def of(cls, name: str, units: Iterable[Unit]) -> ResourcePlan:
        ordered = tuple(units)
        return cls(name=name, units=ordered, by_id={unit.id: unit for unit in ordered})


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
            replicas = entry.replicas_for(gpu.cores)
            if entry.rename:
                name = entry.rename
            elif time_slicing.rename_by_default and replicas > 1:
                name = f"{base}.shared"
        if replicas == 1:
            gpu_units = [Unit(id=gpu.id, gpu_id=gpu.id, resource=name, replicas=1)]
        else:
            gpu_units = [
                Unit(id=replica_unit_id(gpu.id, n), gpu_id=gpu.id, resource=name, replicas=replicas, replica=n)
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


def preferred_allocation(
    plan: ResourcePlan,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    policy: AllocationPolicy,
) -> list[str]:
    """Choose ``size`` unit ids from ``available``, always keeping ``must_include``.

    ``distributed`` spreads replicas over GPUs, least-used GPU first, so that time-sliced pods contend less.
    ``packed`` fills the most-used GPU first, keeping whole GPUs free for larger requests.
    A GPU's use is its replicas that are not available (the kubelet holds them) plus those chosen here.
    Unknown ids are ignored: the kubelet may send ids from an older list, and the answer is only a preference.
    """
    chosen: list[str] = []
    for unit_id in must_include:
        if unit_id in plan.by_id and unit_id not in chosen:
            chosen.append(unit_id)
    if len(chosen) >= size:
        return chosen[:size] if size > 0 else chosen

    free: dict[str, list[Unit]] = {}
    for unit_id in available:
        unit = plan.by_id.get(unit_id)
        if unit is not None and unit_id not in chosen:
            free.setdefault(unit.gpu_id, [])
            if unit not in free[unit.gpu_id]:
                free[unit.gpu_id].append(unit)
    for gpu_units in free.values():
        gpu_units.sort(key=lambda u: (u.replica if u.replica is not None else -1, u.id))

    total = Counter(unit.gpu_id for unit in plan.units)
    in_use = Counter({gpu_id: total[gpu_id] - len(free.get(gpu_id, [])) for gpu_id in total})
    # must_include ids are part of `available` but not of `free`, so in_use already counts them.
    order: dict[str, int] = {}
    for unit in plan.units:
        order.setdefault(unit.gpu_id, len(order))

    while len(chosen) < size:
        candidates = [gpu_id for gpu_id, gpu_units in free.items() if gpu_units]
        if not candidates:
            break
        if policy == "packed":
            gpu_id = min(candidates, key=lambda g: (-in_use[g], order[g]))
        else:
            gpu_id = min(candidates, key=lambda g: (in_use[g], order[g]))
        unit = free[gpu_id].pop(0)
        chosen.append(unit.id)
        in_use[gpu_id] += 1
    return chosen
