"""How much GPU memory a VM can map at once: its virtio-gpu's host-visible window.

Under Venus every Vulkan allocation lives on the host; the guest maps one through the virtio-gpu's host-visible
memory region (QEMU's ``hostmem=``, libkrun's GPU shared memory), and ``vkMapMemory`` fails with
VK_ERROR_OUT_OF_DEVICE_MEMORY once the mappings of every process in the VM together fill it. Allocations that are
never mapped are not held to it, and neither the heaps nor VK_EXT_memory_budget show it. A slice larger than the
window is a promise the VM cannot keep to a workload that maps its memory (llama.cpp and wgpu do).

Where the size is read, in order: the driver's debugfs file (``host visible region : ADDR +SIZE``, with what is
mapped now beside it), the device's virtio PCI capabilities in its config space (the shared memory region with id
VIRTIO_GPU_SHM_ID_HOST_VISIBLE; not on virtio-MMIO, as under krunkit), and the kernel's log (``[drm] Host memory
window: ADDR +SIZE``, which names no device, so only where the node has one virtio GPU).
"""

from __future__ import annotations

import errno
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.base.fsutil import read_host_bytes, read_host_file
from gpuppetti.base.quantity import format_bytes
from gpuppetti.commands.doctor.result import Result, ok, skip, warn
from gpuppetti.core.model import Gpu, Vendor

CHECK = "virtio-gpu window"
FEATURES = "virtio-gpu-features"
MAPPINGS = "virtio-gpu-host-visible-mm"
_REGION = re.compile(r"^host visible region\s*:\s*0x[0-9a-fA-F]+\s*\+0x([0-9a-fA-F]+)\s*$", re.MULTILINE)
_USED = re.compile(r"^total:\s*(\d+),\s*used\s+(\d+)", re.MULTILINE)
_KERNEL_LOG = re.compile(r"Host memory window: 0x[0-9a-fA-F]+ \+0x([0-9a-fA-F]+)")
VIRTIO_VENDOR = 0x1AF4
PCI_CAP_VENDOR_SPECIFIC = 0x09
VIRTIO_PCI_CAP_SHARED_MEMORY_CFG = 8
VIRTIO_GPU_SHM_ID_HOST_VISIBLE = 1
# Records of the kernel's log read at most (its ring buffer holds a few thousand).
KERNEL_LOG_RECORDS = 100_000
FIX_SMALLER = ("give the VM a larger host-visible window (QEMU: -device virtio-gpu-gl-pci,blob=true,hostmem=SIZE; "
               "krunkit and libkrun: their GPU shared-memory size), or make the slices smaller (more replicas, or "
               "sharing.timeSlicing.resources[].sliceMemory)")


@dataclass(frozen=True)
class Window:
    """A virtio-gpu's host-visible window: its size (0: it has none), what is mapped now (where known), and where
    that was read."""

    size: int
    used: int | None
    source: str


def is_virtio(gpu: Gpu) -> bool:
    """A virtio-gpu found in the VM's sysfs (described by the config as vendor apple or virtio)."""
    return not gpu.simulated and gpu.backend == "drm" and gpu.vendor in (Vendor.VIRTIO, Vendor.APPLE)


def _read(path: Path, limit: int = 1 << 16) -> str | None:
    return read_host_file(path, limit)


def _debugfs_dirs(host_root: Path, gpu: Gpu) -> list[Path]:
    """The driver's debugfs directories of this GPU: one per DRM minor (the card's, the render node's), and the
    one named after its PCI device."""
    base = host_root / "sys/kernel/debug/dri"
    names: list[str] = []
    render = gpu.render_node
    if render is not None:
        node = host_root / "sys/class/drm" / Path(render).name
        dev = _read(node / "dev")
        if dev and ":" in dev:
            names.append(dev.strip().split(":", 1)[1])
        try:
            cards = sorted((node / "device" / "drm").glob("card*"))
        except OSError:
            cards = []
        names += [card.name.removeprefix("card") for card in cards if card.name.removeprefix("card").isdigit()]
    if gpu.pci_address:
        names.append(gpu.pci_address)
    return [base / name for name in dict.fromkeys(names)]


def from_debugfs(host_root: Path, gpu: Gpu) -> Window | None:
    for directory in _debugfs_dirs(host_root, gpu):
        features = _read(directory / FEATURES)
        if features is None:
            continue
        where = f"debugfs ({directory.relative_to(host_root)})"
        region = _REGION.search(features)
        if region is None:
            return Window(0, None, where)
        used_match = _USED.search(_read(directory / MAPPINGS) or "")
        return Window(int(region.group(1), 16), int(used_match.group(2)) if used_match else None, where)
    return None


def shared_memory_length(config: bytes) -> int | None:
    """From a virtio PCI device's config space: the length of its host-visible shared memory region; 0 where the
    capabilities list has none; None where the bytes are not a virtio device's whole config space."""
    if len(config) < 256 or struct.unpack_from("<H", config, 0)[0] != VIRTIO_VENDOR:
        return None
    status = struct.unpack_from("<H", config, 6)[0]
    if not status & 0x10:
        return 0
    pointer = config[0x34] & 0xFC
    seen: set[int] = set()
    while pointer and pointer not in seen and pointer + 24 <= len(config):
        seen.add(pointer)
        kind, following = config[pointer], config[pointer + 1] & 0xFC
        if kind == PCI_CAP_VENDOR_SPECIFIC and config[pointer + 2] >= 24:
            cfg_type, region = config[pointer + 3], config[pointer + 5]
            if cfg_type == VIRTIO_PCI_CAP_SHARED_MEMORY_CFG and region == VIRTIO_GPU_SHM_ID_HOST_VISIBLE:
                length: int = struct.unpack_from("<I", config, pointer + 12)[0]
                length_high: int = struct.unpack_from("<I", config, pointer + 20)[0]
                return length | (length_high << 32)
        pointer = following
    return 0


def from_pci(host_root: Path, gpu: Gpu) -> Window | str | None:
    """The window from the PCI config space; a reason where that cannot be read; None off PCI."""
    if not gpu.pci_address:
        return None
    path = host_root / "sys/bus/pci/devices" / gpu.pci_address / "config"
    config = read_host_bytes(path, 4096)
    if config is None:
        return f"{path}: cannot be read as a file"
    if len(config) < 256:
        return f"{path}: only {len(config)} bytes readable (the capabilities need root)"
    length = shared_memory_length(config)
    if length is None:
        return f"{path}: not a virtio device's config space"
    return Window(length, None, f"PCI capabilities of {gpu.pci_address}")


def from_kernel_log(kmsg: Path = Path("/dev/kmsg")) -> Window | str:
    """The window the kernel logged at boot, read from its log without waiting; a reason where it cannot be."""
    try:
        descriptor = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"{kmsg}: {exc.strerror or exc}"
    found: int | None = None
    try:
        for _ in range(KERNEL_LOG_RECORDS):
            try:
                record = os.read(descriptor, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # overwritten while read: the next record follows
                return f"{kmsg}: {exc.strerror or exc}"
            if not record:
                break
            match = _KERNEL_LOG.search(record.decode(errors="replace"))
            if match is not None:
                found = int(match.group(1), 16)
    finally:
        os.close(descriptor)
    if found is None:
        return "the kernel's log no longer holds the line virtio_gpu wrote at boot"
    return Window(found, None, "the kernel's log")


def find_window(host_root: Path, gpu: Gpu, only_virtio: bool, kmsg: Path = Path("/dev/kmsg")) -> Window | list[str]:
    """The GPU's window, or why it cannot be told (each source's reason)."""
    reasons = []
    window = from_debugfs(host_root, gpu)
    if window is not None:
        return window
    reasons.append(f"no {FEATURES} in {host_root / 'sys/kernel/debug/dri'} (debugfs not mounted)")
    pci = from_pci(host_root, gpu)
    if isinstance(pci, Window):
        return pci
    reasons.append(pci or "not on PCI (virtio-MMIO has no config space to read)")
    if str(host_root) != "/":
        reasons.append("the kernel's log is read only on the node itself")
    elif not only_virtio:
        reasons.append("the kernel's log names no device, and this node has several virtio GPUs")
    else:
        logged = from_kernel_log(kmsg)
        if isinstance(logged, Window):
            return logged
        reasons.append(logged)
    return reasons


def window_checks(gpus: Sequence[Gpu], slices: Mapping[str, Sequence[int]], host_root: Path,
                  kmsg: Path = Path("/dev/kmsg")) -> list[Result]:
    """One result per virtio GPU: how much of its memory the VM can map, against the slices it is cut into
    (``slices``: each GPU's slice sizes in bytes, by GPU id)."""
    virtio = [gpu for gpu in gpus if is_virtio(gpu)]
    results = []
    for gpu in virtio:
        sizes = [size for size in slices.get(gpu.id, ()) if size > 0]
        found = find_window(host_root, gpu, len(virtio) == 1, kmsg)
        if isinstance(found, list):
            detail = f"{gpu.id}: cannot tell how much GPU memory the VM can map: {'; '.join(found)}"
            if sizes:
                results.append(warn(CHECK, detail, "run `sudo gpuppetti doctor` on the node itself (minikube ssh), "
                                    "or mount debugfs there: mount -t debugfs none /sys/kernel/debug"))
            else:
                results.append(skip(CHECK, detail))
            continue
        if found.size == 0:
            results.append(warn(CHECK, f"{gpu.id}: the virtio-gpu has no host-visible window ({found.source}): "
                                "Venus cannot map GPU memory in this VM",
                                "start the VM with one (QEMU: -device virtio-gpu-gl-pci,blob=true,hostmem=SIZE; "
                                "krunkit gives its virtio-gpu one)"))
            continue
        mapped = f"; {format_bytes(found.used)} mapped now" if found.used is not None else ""
        detail = (f"{gpu.id}: the VM can map {format_bytes(found.size)} of GPU memory at once (the virtio-gpu's "
                  f"host-visible window, from {found.source}{mapped})")
        if not sizes:
            results.append(ok(CHECK, f"{detail}; the GPU is not sliced"))
            continue
        largest = max(sizes)
        if largest > found.size:
            results.append(warn(
                CHECK, f"{detail}, less than a slice ({format_bytes(largest)}): a workload that maps more than "
                f"{format_bytes(found.size)} of its slice gets VK_ERROR_OUT_OF_DEVICE_MEMORY, and every process in "
                "the VM maps from the same window", FIX_SMALLER))
            continue
        together = sum(sizes)
        shared = (f"; {len(sizes)} slices together ({format_bytes(together)}) map from the same window"
                  if together > found.size else "")
        results.append(ok(CHECK, f"{detail}; each slice ({format_bytes(largest)}) fits{shared}"))
    return results
