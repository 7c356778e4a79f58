"""Container edits: what makes the allocated GPUs, and only them, visible inside a container, with their shares.

A container gets exactly the device nodes of its GPUs, so runtimes that enumerate what they can open (ROCm,
Level Zero, Vulkan) number the visible GPUs from 0; selectors by position therefore count from 0 in the
GPUs' host order. Where a GPU has a stable UUID (NVIDIA, AMD's unique_id) the selector names it instead, which
also holds in a privileged container that sees every device.

Both front ends build their edits here: the device plugin from its units, the DRA driver from a claim's shares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuppetti.base.quantity import format_quantity
from gpuppetti.core.model import ContainerEdits, Gpu, Mount, Vendor
from gpuppetti.sharing.replicas import Unit
from gpuppetti.sharing.shares import Share


@dataclass(frozen=True)
class MpsSettings:
    """NVIDIA MPS for a claim's container: what the GpuConfig asked for."""

    active_thread_percentage: int | None = None
    pinned_device_memory_limit: int | None = None
    pipe_directory: str = "/run/nvidia/mps"


def sharing_mode(units: Sequence[Unit]) -> str:
    return "time-slicing" if any(unit.shared for unit in units) else "none"


def _positions(gpus: Sequence[Gpu]) -> str:
    return ",".join(str(position) for position in range(len(gpus)))


def vendor_env(gpus: Sequence[Gpu]) -> dict[str, str]:
    """The selection env of each vendor's runtime for these GPUs (simulated GPUs get none)."""
    real = [gpu for gpu in gpus if not gpu.simulated]
    env: dict[str, str] = {}
    if not real:
        return env
    nvidia = [gpu for gpu in real if gpu.vendor is Vendor.NVIDIA and gpu.uuid]
    if nvidia:
        uuids = ",".join(gpu.uuid or "" for gpu in nvidia)
        env["NVIDIA_VISIBLE_DEVICES"] = uuids
        env["CUDA_VISIBLE_DEVICES"] = uuids
    amd = sorted((gpu for gpu in real if gpu.vendor is Vendor.AMD), key=lambda g: g.index)
    if amd:
        if all(gpu.uuid for gpu in amd):
            env["ROCR_VISIBLE_DEVICES"] = ",".join(f"GPU-{gpu.uuid}" for gpu in amd)
        else:
            env["ROCR_VISIBLE_DEVICES"] = _positions(amd)
    intel = sorted((gpu for gpu in real if gpu.vendor is Vendor.INTEL), key=lambda g: g.index)
    if intel:
        env["ZE_AFFINITY_MASK"] = _positions(intel)
    # Apple's GPU in a VM, and plain virtio-gpu, are reached through their render node with Vulkan (Venus).
    vulkan = sorted(
        (gpu for gpu in real if gpu.vendor in (Vendor.VIRTIO, Vendor.APPLE) and gpu.render_node),
        key=lambda g: g.index,
    )
    if vulkan:
        env["GGML_VK_VISIBLE_DEVICES"] = _positions(vulkan)
    # vid:did picks one device, so it helps only when the container has exactly one GPU.
    if len(real) == 1 and real[0].pci_ids and real[0].render_node:
        vid, did = real[0].pci_ids
        env["MESA_VK_DEVICE_SELECT"] = f"{vid}:{did}"
    return env


def _edits(gpu_ids: Sequence[str], slice_ids: Sequence[str], sharing: str, replicas: Mapping[str, int],
           gpus: Mapping[str, Gpu]) -> ContainerEdits:
    chosen = [gpus[gpu_id] for gpu_id in gpu_ids]
    edits = ContainerEdits(env={
        "GPUPPETTI_VISIBLE_DEVICES": ",".join(gpu_ids),
        "GPUPPETTI_SLICES": ",".join(slice_ids),
        "GPUPPETTI_SHARING": sharing,
        "GPUPPETTI_REPLICAS": ",".join(str(replicas[gpu_id]) for gpu_id in gpu_ids),
        **vendor_env(chosen),
    })
    for gpu in chosen:
        for node in gpu.device_nodes:
            edits.add_device_node(node)
    return edits


def _ordered_gpus(gpu_ids: Sequence[str]) -> list[str]:
    """Every GPU once, in the order first named."""
    return list(dict.fromkeys(gpu_ids))


def container_edits(units: Sequence[Unit], gpus: Mapping[str, Gpu]) -> ContainerEdits:
    """The device plugin's edits for one container that was given ``units``."""
    gpu_ids = _ordered_gpus([unit.gpu_id for unit in units])
    replicas = {unit.gpu_id: unit.replicas for unit in units}
    return _edits(gpu_ids, [unit.id for unit in units], sharing_mode(units), replicas, gpus)


_STRATEGY_SHARING = {"TimeSlicing": "time-slicing", "Exclusive": "none", "MPS": "mps"}


def _claim_sharing(shares: Sequence[Share], strategy: str) -> str:
    if any(share.parts > 1 for share in shares):
        return "partition"
    # A partitions node's device taken whole (all of its memory) is a whole GPU, though the API gives it a share id.
    if any(share.share_id and not share.device.part_counts for share in shares):
        return "consumable"
    return _STRATEGY_SHARING[strategy]


def claim_edits(shares: Sequence[Share], strategy: str, mps: MpsSettings, gpus: Mapping[str, Gpu],
                claim_uid: str) -> ContainerEdits:
    """The DRA driver's edits for one request of a claim: the device plugin's for its GPUs, plus the share each one
    gives (cooperative limits), the share ids and, for MPS on NVIDIA, MPS's own settings."""
    gpu_ids = _ordered_gpus([share.gpu.id for share in shares])
    replicas = {share.gpu.id: share.parts for share in shares}
    edits = _edits(gpu_ids, [s.device.name for s in shares], _claim_sharing(shares, strategy), replicas, gpus)
    edits.env["GPUPPETTI_CLAIM"] = claim_uid
    sizes = [share.size for share in shares]
    if any(size.cores is not None for size in sizes):
        edits.env["GPUPPETTI_CORES"] = ",".join(
            format_quantity(size.cores) if size.cores is not None else "" for size in sizes)
    if any(size.memory is not None for size in sizes):
        edits.env["GPUPPETTI_MEMORY"] = ",".join(str(size.memory) if size.memory is not None else "" for size in sizes)
    share_ids = [share.share_id for share in shares if share.share_id]
    if share_ids:
        edits.env["GPUPPETTI_SHARE_ID"] = ",".join(share_ids)
    # Nothing in user space enforces these shares on every GPU; say so instead of implying isolation.
    edits.env["GPUPPETTI_LIMITS"] = "cooperative"
    # Only MPS looks for NVIDIA GPUs: a DRA call plans a thousand claims.
    if strategy == "MPS":
        nvidia = [share for share in shares if share.gpu.vendor is Vendor.NVIDIA and not share.gpu.simulated]
        if nvidia:
            _mps(edits, nvidia, mps)
    return edits


def _mps(edits: ContainerEdits, nvidia: Sequence[Share], mps: MpsSettings) -> None:
    percentage = mps.active_thread_percentage
    first = nvidia[0]
    if percentage is None and first.size.cores is not None and first.gpu.cores:
        percentage = max(1, int(100 * first.size.cores / first.gpu.cores))
    if percentage is not None:
        edits.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percentage)
    limits = []
    for position, share in enumerate(nvidia):
        limit = mps.pinned_device_memory_limit or share.size.memory
        if limit:
            limits.append(f"{position}={max(1, limit // 2**20)}M")
    if limits:
        edits.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(limits)
    edits.env["CUDA_MPS_PIPE_DIRECTORY"] = mps.pipe_directory
    edits.add_mount(Mount(container_path=mps.pipe_directory, host_path=mps.pipe_directory, read_only=False))
