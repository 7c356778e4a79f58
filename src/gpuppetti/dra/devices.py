"""The DRA view of the inventory: which devices a node publishes, and what each one is a share of."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from gpuppetti.config import DraSection
from gpuppetti.model import Gpu


@dataclass(frozen=True)
class DraDevice:
    """One device of the pool: a whole GPU, or partition ``part`` of ``partitions`` equal ones."""

    name: str
    gpu_id: str
    partitions: int = 1
    part: int = 0

    @property
    def fraction(self) -> Fraction:
        return Fraction(1, self.partitions)


def gpu_device_name(gpu: Gpu) -> str:
    # A DNS label that stays put while the GPU does: GPU ids (UUIDs, PCI addresses) are not DNS labels.
    return f"gpu-{gpu.vendor.value}-{gpu.index}"


def counter_set_name(gpu: Gpu) -> str:
    return f"{gpu_device_name(gpu)}-counters"


def pool_devices(gpus: Mapping[str, Gpu], section: DraSection) -> dict[str, DraDevice]:
    devices: dict[str, DraDevice] = {}
    for gpu in gpus.values():
        base = gpu_device_name(gpu)
        devices[base] = DraDevice(base, gpu.id)
        if section.slicing == "partitions":
            for count in sorted(set(section.partitions)):
                for part in range(count):
                    name = f"{base}-p{count}-{part}"
                    devices[name] = DraDevice(name, gpu.id, count, part)
    return devices
