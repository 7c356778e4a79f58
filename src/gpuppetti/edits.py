"""Container edits: what makes the allocated GPUs, and only them, visible inside a container.

A container gets exactly the device nodes of its GPUs, so runtimes that enumerate what they can open (ROCm,
Level Zero, Vulkan) number the visible GPUs from 0; selectors by position therefore count from 0 in the
GPUs' host order. Where a GPU has a stable UUID (NVIDIA, AMD's unique_id) the selector names it instead, which
also holds in a privileged container that sees every device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuppetti.model import ContainerEdits, Gpu, Unit, Vendor


def sharing_mode(units: Sequence[Unit]) -> str:
    return "time-slicing" if any(unit.shared for unit in units) else "none"


def _positions(gpus: Sequence[Gpu]) -> str:
    return ",".join(str(position) for position in range(len(gpus)))


def vendor_env(gpus: Sequence[Gpu]) -> dict[str, str]:
    """The selection env of each vendor's runtime for these GPUs (simulated GPUs get none)."""
    real = [gpu for gpu in gpus if gpu.backend != "simulated"]
    env: dict[str, str] = {}
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
    vulkan = sorted(
        (gpu for gpu in real if gpu.vendor in (Vendor.VIRTIO, Vendor.APPLE) and gpu.backend == "drm"),
        key=lambda g: g.index,
    )
    if vulkan:
        env["GGML_VK_VISIBLE_DEVICES"] = _positions(vulkan)
    # vid:did picks one device, so it helps only when the container has exactly one GPU.
    if len(real) == 1 and real[0].pci_ids and real[0].backend == "drm":
        vid, did = real[0].pci_ids
        env["MESA_VK_DEVICE_SELECT"] = f"{vid}:{did}"
    return env


def container_edits(units: Sequence[Unit], gpus: Mapping[str, Gpu]) -> ContainerEdits:
    """Edits for one container that was given ``units``.

    Every GPU behind the units is listed once, in the order first requested.
    """
    gpu_ids: list[str] = []
    for unit in units:
        if unit.gpu_id not in gpu_ids:
            gpu_ids.append(unit.gpu_id)
    chosen = [gpus[gpu_id] for gpu_id in gpu_ids]
    replicas = {unit.gpu_id: unit.replicas for unit in units}
    edits = ContainerEdits(
        env={
            "GPUPPETTI_VISIBLE_DEVICES": ",".join(gpu_ids),
            "GPUPPETTI_SLICES": ",".join(unit.id for unit in units),
            "GPUPPETTI_SHARING": sharing_mode(units),
            "GPUPPETTI_REPLICAS": ",".join(str(replicas[gpu_id]) for gpu_id in gpu_ids),
            **vendor_env(chosen),
        }
    )
    for gpu in chosen:
        for node in gpu.device_nodes:
            edits.add_device_node(node)
    return edits
