"""What one DRA claim was given of a pool device: the device's own size, or the capacity it consumed of a
consumable device; and whether the sharing strategy it asked for can be honoured there."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from gpuppetti.base.quantity import MAX_BYTES, parse_quantity
from gpuppetti.core.model import Gpu, Vendor
from gpuppetti.sharing.pool import PoolDevice, partition_counts
from gpuppetti.sharing.size import Size


@dataclass(frozen=True)
class Share:
    device: PoolDevice
    gpu: Gpu
    size: Size
    share_id: str | None = None
    # The number of equal parts of its GPU this share is one of; 1 when it is not a partition.
    parts: int = 1


class ShareError(ValueError):
    """A claim's allocation that this device cannot be; the message names the device and what is wrong."""


def claim_share(device: PoolDevice, gpu: Gpu, consumed: Mapping[str, str] | None, share_id: str | None) -> Share:
    """The share a claim got of ``device``: what it consumed of a consumable device, else the whole device."""
    if not consumed:
        return Share(device, gpu, device.size, share_id, device.partitions)
    amounts: dict[str, Fraction] = {}
    for name, text in consumed.items():
        try:
            amounts[name] = parse_quantity(str(text))
        except ValueError as exc:
            raise ShareError(f"device {device.name}: consumedCapacity.{name}: {exc}") from None
        if amounts[name] < 0:
            raise ShareError(f"device {device.name}: consumedCapacity.{name} is negative ({text!r})")
    memory = amounts.get("memory")
    if memory is not None and memory > MAX_BYTES:
        raise ShareError(f"device {device.name}: consumedCapacity.memory {consumed['memory']!r} is 8Ei or more, past "
                         "what a 64-bit count of bytes holds")
    if memory is not None and memory.denominator != 1:
        raise ShareError(f"device {device.name}: consumedCapacity.memory {consumed['memory']!r} is not a whole "
                         "number of bytes")
    if device.part_counts:
        sizes = f"1/{', 1/'.join(map(str, device.part_counts))}"
        if memory is None:
            raise ShareError(f"device {device.name}: no consumedCapacity.memory: a claim takes one of its partitions "
                             f"({sizes}) by its memory")
        count = partition_counts(device, memory)
        if count is None:
            raise ShareError(f"device {device.name}: consumedCapacity.memory {consumed['memory']!r} is not the size "
                             f"of one of its partitions ({sizes})")
        return Share(device, gpu, Size.part(gpu, count), share_id, count)
    fraction = amounts.get("share")
    if fraction is None:
        # The fraction that the largest of the named amounts is of the GPU: what the claim may assume it has.
        parts = [amounts[n] / total for n, total in device.size.amounts().items() if n in amounts and total > 0]
        fraction = max(parts, default=device.size.fraction)
    size = Size(fraction, amounts.get("cores"), int(memory) if memory is not None else None)
    return Share(device, gpu, size, share_id)


def cannot_honour(strategy: str, share: Share) -> str | None:
    """Why ``strategy`` cannot be what ``share`` gets; None when it can. Running the pod anyway would promise what
    nobody delivers."""
    if strategy == "Exclusive" and share.parts > 1:
        return ("a partition shares its GPU with the other partitions (dra.slicing: whole gives a claim the GPU "
                "to itself)")
    if strategy == "Exclusive" and share.share_id:
        return ("in consumable mode the device shares its capacity with other claims (dra.slicing: whole gives "
                "a claim the GPU to itself)")
    if strategy == "MPS" and share.gpu.vendor is not Vendor.NVIDIA:
        return f"MPS is NVIDIA's Multi-Process Service, and this GPU is {share.gpu.vendor.value}"
    return None
