"""Which units to prefer for a request: spread over GPUs, or packed onto as few as possible."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from gpuppetti.core.config import AllocationPolicy
from gpuppetti.sharing.replicas import ResourcePlan, Unit


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
