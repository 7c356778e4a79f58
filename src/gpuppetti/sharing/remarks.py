"""What a config does on these GPUs that its author may not expect: the time-slicing entries that match nothing
or promise too much, and a DRA pool that will cost the scheduler far more than it needs to."""

from __future__ import annotations

from collections.abc import Sequence

from gpuppetti.core.config import Config, DraSection
from gpuppetti.core.model import Gpu
from gpuppetti.sharing.pool import build_pool
from gpuppetti.sharing.replicas import Remark, plan_remarks

# Measured with a real scheduler over simulated nodes (make bench-scale, docs/scale.md): 120 devices per node cost
# it about 3 times what 8 do per pod, and any device that consumes shared counters 40 to 1,900 times.
MAX_DEVICES_PER_NODE = 64


def config_remarks(gpus: Sequence[Gpu], config: Config) -> list[Remark]:
    return [*plan_remarks(gpus, config.sharing.time_slicing), *pool_remarks(gpus, config.dra)]


def pool_remarks(gpus: Sequence[Gpu], dra: DraSection) -> list[Remark]:
    if not gpus:
        return []
    pool = build_pool(gpus, dra)
    remarks: list[Remark] = []
    if pool.counter_sets:
        path = "dra.partitionLayout" if dra.partition_layout == "counters" else "dra.partitions"
        why = ("this GPU's memory is unknown, so its partitions are published as devices that consume shared "
               "counters" if dra.partition_layout == "capacity" else "partitions published as devices that consume "
               "shared counters")
        remarks.append(Remark(path, f"{why} ({len(pool.devices)} devices on this node): the scheduler spends 40 to "
                              "1,900 times the CPU of a whole-GPU claim on each claim, more the more nodes the "
                              "cluster has (docs/scale.md); partitionLayout: capacity gives claims the same sizes at "
                              "a whole GPU's cost", True))
    elif len(pool.devices) > MAX_DEVICES_PER_NODE:
        remarks.append(Remark("dra.slicing", f"{len(pool.devices)} devices on this node, more than the "
                              f"{MAX_DEVICES_PER_NODE} the scheduler handles cheaply at cluster scale "
                              "(docs/scale.md)", True))
    return remarks
