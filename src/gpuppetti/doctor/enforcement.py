"""What holds each GPU's slices to their memory on this node, and the fix for a stronger hold that is missing: the
NVIDIA driver's own limit (driver r615 and the container toolkit's hook), or the kernel's dmem controller."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpuppetti.core.model import Gpu, Mechanism, Vendor
from gpuppetti.discovery.drm import DMEM_CAPACITY, dmem_regions, host_python
from gpuppetti.discovery.nvml import LIMITS_DRIVER, TOOLKIT_COMMAND, TOOLKIT_HOOK, NvmlBackend
from gpuppetti.doctor.result import Result, ok, warn
from gpuppetti.sharing.limits import gpu_enforced_by, gpu_mechanisms

CHECK = "enforced by"
NVIDIA_FIX = (f"upgrade the NVIDIA driver to r{LIMITS_DRIVER} or later and the NVIDIA container toolkit to one whose "
              f"{TOOLKIT_HOOK} has the {TOOLKIT_COMMAND} command (GPU Operator 26.7.1 or later)")
DMEM_FIX = ("boot Linux 6.13 or later with the dmem cgroup controller (CONFIG_CGROUP_DMEM), whose GPU driver "
            "registers its memory (xe; amdgpu from 6.14)")
LAYER_FIX = "start the daemon with a --vulkan-layer-dir (the dmem hook is installed there, beside the layer)"


def _missing_stronger(gpu: Gpu, host_root: Path, layer: bool, nvidia_why: str | None) -> tuple[str, str] | None:
    """Why the driver's or the kernel's own limit does not hold this GPU, and the fix; None where it does, or
    where no such limit exists for its kind of GPU."""
    if gpu.simulated or gpu.vendor in (Vendor.APPLE, Vendor.VIRTIO, Vendor.OTHER):
        return None
    held = gpu_mechanisms(gpu, layer)
    if gpu.vendor is Vendor.NVIDIA:
        if Mechanism.NVML in held:
            return None
        return f"not by NVIDIA's driver: {nvidia_why or 'the nvml backend did not find it'}", NVIDIA_FIX
    if Mechanism.DMEM in held:
        return None
    regions = dmem_regions(host_root)
    if regions is None:
        return f"not by the kernel: no dmem cgroup controller (no /{DMEM_CAPACITY})", DMEM_FIX
    if gpu.pci_address not in regions:
        return f"not by the kernel: its driver ({gpu.driver}) registers no dmem region for it", DMEM_FIX
    if not host_python(host_root):
        return "not by the kernel: the host has no python3 to run the dmem hook", "install python3 on the host"
    return "not by the kernel: the dmem hook needs the daemon's layer directory", LAYER_FIX


def enforcement_checks(gpus: Sequence[Gpu], host_root: Path, layer: bool) -> list[Result]:
    """One line per GPU: ✔ where the driver or the kernel holds its slices, ! where only the cooperative layer
    does (and a stronger hold is possible) or nothing does. Blocks (NVML, the toolkit's hook): run in a thread."""
    nvidia_why: str | None = None
    if any(gpu.vendor is Vendor.NVIDIA and Mechanism.NVML not in gpu_mechanisms(gpu, layer) for gpu in gpus):
        _, nvidia_why = NvmlBackend(host_root, ()).limits_support()
    results = []
    for gpu in gpus:
        check = f"{CHECK} {gpu.id}"
        by = gpu_enforced_by(gpu, layer)
        missing = _missing_stronger(gpu, host_root, layer, nvidia_why)
        if not layer and missing is None and by == "none":
            results.append(warn(check, "none: its slices are not held to their memory",
                                "give the daemon its layer: a built installation and a --vulkan-layer-dir (the layer's "
                                "check above says which is missing)"))
        elif missing is not None:
            results.append(warn(check, f"{by}; {missing[0]}", missing[1]))
        else:
            results.append(ok(check, by))
    return results
