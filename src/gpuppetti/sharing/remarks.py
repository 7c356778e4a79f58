"""What a config does on these GPUs that its author may not expect: the time-slicing entries that match nothing
or promise too much, and a DRA pool that will cost the scheduler far more than it needs to."""

from __future__ import annotations

from collections.abc import Sequence

from gpuppetti.core.config import Config, DraSection
from gpuppetti.core.model import Gpu, Serves
from gpuppetti.sharing.pool import Pool, build_pool
from gpuppetti.sharing.replicas import Remark, plan_remarks

# Past this many devices per node, the scheduler's cost per pod grows well beyond what a few devices cost it, as
# make bench-scale measured with a real scheduler (docs/scale.md has the figures).
MAX_DEVICES_PER_NODE = 64


def config_remarks(gpus: Sequence[Gpu], config: Config, serves: Serves = Serves.BOTH,
                   pool: Pool | None = None) -> list[Remark]:
    """The remarks on the sections that what is served reads (a DRA driver has no time-slicing to remark on).
    ``pool`` is these GPUs' pool where the caller has built it already (on a large node, not a cost to pay twice)."""
    remarks = plan_remarks(gpus, config.sharing.time_slicing) if Serves.UNITS in serves else []
    if Serves.POOL in serves:
        remarks += pool_remarks(pool if pool is not None else build_pool(gpus, config.dra), config.dra)
    return remarks


def pool_remarks(pool: Pool, dra: DraSection) -> list[Remark]:
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
