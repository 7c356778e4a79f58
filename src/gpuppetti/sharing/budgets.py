"""What the Vulkan layer holds a container to: for each GPU it was given, the memory of its share.

A replica of a time-sliced GPU, a partition, or a consumable share has a memory size; a container given several
replicas of one GPU gets their sum. A whole GPU is not limited (its budget is 0), and neither is a GPU whose
memory is unknown: there is nothing to hold it to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuppetti.model import Gpu, Vendor
from gpuppetti.sharing.replicas import Unit
from gpuppetti.sharing.shares import Share


@dataclass(frozen=True)
class Budget:
    gpu: Gpu
    # Bytes; 0: the whole GPU, visible and not limited.
    memory: int

    @property
    def selector(self) -> str:
        return selector(self.gpu)


def selector(gpu: Gpu) -> str:
    """How the layer finds this GPU among the container's Vulkan devices: NVIDIA's by UUID (its Vulkan device UUID
    is the GPU's), others by PCI bus address; a simulated GPU, or one on no PCI bus (virtio-MMIO), is whatever
    device the container has."""
    if gpu.simulated:
        return "any"
    if gpu.vendor is Vendor.NVIDIA and gpu.uuid:
        return f"uuid:{gpu.uuid}"
    if gpu.pci_address:
        return f"pci:{gpu.pci_address}"
    return "any"


def _budgets(parts: Sequence[tuple[Gpu, int | None, bool]]) -> list[Budget]:
    """(GPU, memory of the part, whether the part shares the GPU) -> one budget per GPU, in the order first named."""
    total: dict[str, int | None] = {}
    gpus: dict[str, Gpu] = {}
    for gpu, size, shared in parts:
        gpus.setdefault(gpu.id, gpu)
        if not shared or not size:
            total[gpu.id] = None  # a whole GPU, or one of unknown memory: not limited
        elif gpu.id not in total or total[gpu.id] is not None:
            total[gpu.id] = (total.get(gpu.id) or 0) + size
    budgets = [Budget(gpus[gpu_id], bytes_ or 0) for gpu_id, bytes_ in total.items()]
    return budgets if any(budget.memory > 0 for budget in budgets) else []


def unit_budgets(units: Sequence[Unit], gpus: Mapping[str, Gpu]) -> list[Budget]:
    """The device plugin's: n replicas of a GPU are n times a replica's memory. Empty when nothing is limited."""
    return _budgets([(gpus[unit.gpu_id], unit.size.memory if unit.size else None, unit.shared) for unit in units])


def share_budgets(shares: Sequence[Share]) -> list[Budget]:
    """The DRA driver's: a consumable share's memory, or a partition's. Empty when nothing is limited."""
    return _budgets([(share.gpu, share.size.memory, share.share_id is not None or share.device.partitions > 1)
                     for share in shares])
