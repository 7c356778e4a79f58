"""What the Vulkan layer holds a container to: for each GPU it was given, the memory of its share, and (where the
config turns it on) its share of the GPU's time.

A replica of a time-sliced GPU, a partition, or a consumable share has a size; a container given several replicas
of one GPU gets their sum. A whole GPU is not limited (its memory budget is 0, its compute share all of it), and
neither is the memory of a GPU whose memory is unknown: there is nothing to hold it to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from gpuppetti.base.quantity import MAX_BYTES
from gpuppetti.core.model import Gpu, Vendor
from gpuppetti.sharing.replicas import Unit
from gpuppetti.sharing.shares import Share

# A compute share is handed to the layer in thousandths of the GPU's time.
WHOLE_COMPUTE = 1000


@dataclass(frozen=True)
class Budget:
    gpu: Gpu
    # Bytes; 0: the whole GPU, visible and not limited.
    memory: int
    # Thousandths of the GPU's time (1 to 1000); 1000: not throttled.
    compute: int = WHOLE_COMPUTE

    @property
    def selector(self) -> str:
        return selector(self.gpu)


@dataclass(frozen=True)
class Enforce:
    """What the config holds containers to (sharing.enforceMemory, sharing.enforceCompute)."""

    memory: bool
    compute: bool

    def __bool__(self) -> bool:
        return self.memory or self.compute


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


@dataclass(frozen=True)
class _Part:
    gpu: Gpu
    memory: int | None
    # Whether the part shares its GPU; a part that does not is the whole GPU.
    shared: bool
    compute: Fraction


def _thousandths(fraction: Fraction) -> int:
    # Rounded down (a share is never given more than it is), and never to nothing.
    return max(1, min(WHOLE_COMPUTE, int(fraction * WHOLE_COMPUTE)))


def _budgets(parts: Sequence[_Part], enforce: Enforce) -> list[Budget]:
    """One budget per GPU, in the order first named; empty when nothing is limited."""
    memory: dict[str, int | None] = {}
    compute: dict[str, Fraction | None] = {}
    gpus: dict[str, Gpu] = {}
    for part in parts:
        gpus.setdefault(part.gpu.id, part.gpu)
        if not part.shared or not part.memory:
            memory[part.gpu.id] = None  # a whole GPU, or one of unknown memory: not limited
        elif memory.get(part.gpu.id, 0) is not None:
            memory[part.gpu.id] = (memory.get(part.gpu.id) or 0) + part.memory
        if not part.shared:
            compute[part.gpu.id] = None
        elif compute.get(part.gpu.id, Fraction(0)) is not None:
            compute[part.gpu.id] = (compute.get(part.gpu.id) or Fraction(0)) + part.compute
    budgets = []
    for gpu_id, gpu in gpus.items():
        share = compute[gpu_id]
        # Each part is less than 8Ei, but several of one GPU could add up past what the layer's 64-bit count holds;
        # that many bytes are more than any GPU has: the most the count holds says as much.
        budgets.append(Budget(
            gpu, min(memory[gpu_id] or 0, MAX_BYTES) if enforce.memory else 0,
            _thousandths(share) if enforce.compute and share is not None else WHOLE_COMPUTE))
    limited = any(budget.memory > 0 or budget.compute < WHOLE_COMPUTE for budget in budgets)
    return budgets if limited else []


def unit_budgets(units: Sequence[Unit], gpus: Mapping[str, Gpu], enforce: Enforce) -> list[Budget]:
    """The device plugin's: n replicas of a GPU are n times a replica's memory and time. Empty when nothing is
    limited."""
    parts = []
    for unit in units:
        size = unit.size
        parts.append(_Part(gpus[unit.gpu_id], size.memory if size else None, unit.shared,
                           size.fraction if size else Fraction(1)))
    return _budgets(parts, enforce)


def share_budgets(shares: Sequence[Share], enforce: Enforce) -> list[Budget]:
    """The DRA driver's: a consumable share's memory, or a partition's, and the part of the GPU's cores it has
    (its fraction of the GPU where the cores are not known). Empty when nothing is limited."""
    if not any(share.share_id is not None or share.parts > 1 for share in shares):
        return []  # whole GPUs: nothing to hold them to
    parts = []
    for share in shares:
        size = share.size
        cores = share.gpu.cores
        compute = size.cores / cores if size.cores is not None and cores else size.fraction
        parts.append(_Part(share.gpu, size.memory, share.share_id is not None or share.parts > 1,
                           compute))
    return _budgets(parts, enforce)
