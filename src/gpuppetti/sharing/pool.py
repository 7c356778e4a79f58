"""The DRA driver's devices: each GPU whole, as partitions, or as consumable capacity.

Partitions come in two layouts. ``capacity``: one device per GPU that many claims share, its memory taken only in
the partitions' sizes (a request policy's validValues), so that a claim gets one partition's worth of the GPU.
``counters``: a device per partition, each consuming the GPU's shared counters (the API's partitionable devices).
Both give a claim the same sizes; the scheduler pays 40 to 1,900 times more per pod for counters (docs/scale.md).

Every device carries its size, computed here once: the ResourceSlices advertise it, and a claim's container is
told it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType

from gpuppetti.core.config import DraSection
from gpuppetti.core.model import Gpu
from gpuppetti.sharing.size import Size, part_size

# The smallest amount of each capacity a consumable claim can take, and the step it takes it in.
CONSUMABLE_STEP: Mapping[str, Fraction] = MappingProxyType(
    {"share": Fraction(1, 1000), "cores": Fraction(1), "memory": Fraction(2**20)})


@dataclass(frozen=True, slots=True)
class Capacity:
    """One capacity of a device; for a consumable device, also what a claim takes by default and the step."""

    name: str
    value: Fraction
    default: Fraction | None = None
    step: Fraction | None = None
    # Instead of a step: the only amounts a claim may take, ascending (the scheduler rounds a request up to one).
    valid_values: tuple[Fraction, ...] = ()


@dataclass(frozen=True, slots=True)
class PoolDevice:
    """One device of the pool: a whole GPU, or partition ``part`` of ``partitions`` equal ones."""

    name: str
    gpu_id: str
    size: Size
    capacity: tuple[Capacity, ...]
    partitions: int = 1
    part: int = 0
    consumable: bool = False
    # Partitions, counters layout: the counter set every device of this GPU draws from.
    counter_set: str | None = None
    # Partitions, capacity layout: the numbers of equal parts a claim may take this GPU in (1: all of it).
    part_counts: tuple[int, ...] = ()
    # Partitions: whether a claim that names no partition (a plain resources.limits among them) gets this device;
    # None where the node has no partitions.
    by_default: bool | None = None


@dataclass(frozen=True)
class CounterSet:
    name: str
    gpu_id: str
    counters: Mapping[str, Fraction]


@dataclass(frozen=True)
class Pool:
    slicing: str
    devices: Mapping[str, PoolDevice]
    counter_sets: tuple[CounterSet, ...] = ()


def gpu_device_name(gpu: Gpu) -> str:
    # A DNS label that stays put while the GPU does: GPU ids (UUIDs, PCI addresses) are not DNS labels.
    return f"gpu-{gpu.vendor.value}-{gpu.index}"


def counter_set_name(gpu: Gpu) -> str:
    return f"{gpu_device_name(gpu)}-counters"


@functools.cache
def _partition_capacity(memory: int, counts: tuple[int, ...], plain: int) -> tuple[Capacity, ...]:
    """A GPU's memory, taken in one of its partitions' sizes; by default that of ``plain`` parts (dra.
    defaultPartition). Memory, because its sizes are whole numbers of bytes: the API compares valid values as
    integers, so fractions of a share or of a core would collide."""
    values = tuple(sorted({Fraction(memory // count) for count in counts}))
    return (Capacity("memory", Fraction(memory), Fraction(memory // plain), valid_values=values),)


def partition_counts(device: PoolDevice, memory: Fraction) -> int | None:
    """How many equal parts of its GPU ``memory`` of a capacity-layout device is; None when it is none of them."""
    total = next((c.value for c in device.capacity if c.name == "memory"), None)
    for count in device.part_counts:
        if total is not None and memory == total // count:
            return count
    return None


@functools.cache
def _plain(cores: int | None, memory: int | None, parts: int) -> tuple[Capacity, ...]:
    return tuple(Capacity(name, value) for name, value in part_size(cores, memory, parts).amounts().items())


def consumable_capacity(gpu: Gpu, shares: int) -> tuple[Capacity, ...]:
    return _consumable(gpu.cores, gpu.memory_bytes, shares)


@functools.cache
def _consumable(cores: int | None, memory: int | None, shares: int) -> tuple[Capacity, ...]:
    """Each capacity with a request policy. A claim that names none takes 1/shares of each; a claim that names some
    takes what it names, and of the others only the minimum: the scheduler charges a capacity's default to every
    claim that leaves it out, so a default share of 1/shares would cap a GPU at ``shares`` claims however little
    each asks for. ``share`` then keeps its 1/shares default only for a GPU whose cores and memory are unknown."""
    whole = part_size(cores, memory, 1).amounts()
    default = part_size(cores, memory, shares).amounts()
    measured = "cores" in whole or "memory" in whole
    capacity = []
    for name, total in whole.items():
        if total <= 0:
            continue
        step = min(CONSUMABLE_STEP[name], total)
        wanted = step if name == "share" and measured else max(default[name], step)
        capacity.append(Capacity(name, total, wanted, step))
    return tuple(capacity)


def build_pool(gpus: Iterable[Gpu], section: DraSection) -> Pool:
    devices: dict[str, PoolDevice] = {}
    counter_sets: list[CounterSet] = []
    for gpu in gpus:
        base = gpu_device_name(gpu)
        whole = Size.whole(gpu)
        plain = _plain(gpu.cores, gpu.memory_bytes, 1)
        if section.slicing == "consumable":
            devices[base] = PoolDevice(base, gpu.id, whole, consumable_capacity(gpu, section.shares),
                                       consumable=True)
            continue
        if section.slicing == "whole":
            devices[base] = PoolDevice(base, gpu.id, whole, plain)
            continue
        counts = tuple(sorted({1, *section.partitions}))
        default = section.plain_partition
        if section.partition_layout == "capacity" and gpu.memory_bytes:
            devices[base] = PoolDevice(base, gpu.id, whole, _partition_capacity(gpu.memory_bytes, counts, default),
                                       consumable=True, part_counts=counts, by_default=True)
            continue
        # The counters layout, and a GPU whose memory is not known (nothing to take the partitions' sizes of).
        counters = counter_set_name(gpu)
        counter_sets.append(CounterSet(counters, gpu.id, MappingProxyType(whole.amounts())))
        devices[base] = PoolDevice(base, gpu.id, whole, plain, counter_set=counters, by_default=default == 1)
        for count in sorted(set(section.partitions)):
            size = Size.part(gpu, count)
            capacity = _plain(gpu.cores, gpu.memory_bytes, count)
            for part in range(count):
                name = f"{base}-p{count}-{part}"
                devices[name] = PoolDevice(name, gpu.id, size, capacity, count, part, counter_set=counters,
                                           by_default=default == count)
    return Pool(section.slicing, MappingProxyType(devices), tuple(counter_sets))
