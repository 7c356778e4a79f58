"""Linux GPUs from DRM in sysfs, read under a host root.

In a DaemonSet the host's /sys and /dev are mounted under the root (``--host-root /host``); in tests the root is a
fixture tree. Device node paths in the result are host paths, never prefixed with the root: the kubelet and the
container runtime read them on the host.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.core.config import VirtioSection
from gpuppetti.core.model import DeviceNode, DriverLimit, Gpu, Mechanism, Vendor
from gpuppetti.discovery.pciids import find_database, model_name

log = logging.getLogger(__name__)
PCI_VENDORS = {"10de": Vendor.NVIDIA, "1002": Vendor.AMD, "8086": Vendor.INTEL, "1af4": Vendor.VIRTIO}
DRIVER_VENDORS = {
    "virtio_gpu": Vendor.VIRTIO,
    "amdgpu": Vendor.AMD,
    "radeon": Vendor.AMD,
    "i915": Vendor.INTEL,
    "xe": Vendor.INTEL,
    "nvidia": Vendor.NVIDIA,
    "nouveau": Vendor.NVIDIA,
}
_CARD = re.compile(r"^card(\d+)$")
_BDF = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def _hex_id(path: Path) -> str | None:
    value = _read_int(path)
    return None if value is None else f"{value:04x}"


def _uevent(device: Path) -> dict[str, str]:
    text = _read(device / "uevent") or ""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _pci_address(device: Path, uevent: dict[str, str]) -> str | None:
    if slot := uevent.get("PCI_SLOT_NAME"):
        return slot.lower()
    real = Path(os.path.realpath(device))
    # A virtio-gpu on PCI (QEMU) hangs off a virtio device whose parent is the PCI function.
    for candidate in (real.name, real.parent.name):
        if _BDF.match(candidate):
            return candidate.lower()
    return None


# The kernel's dmem cgroup controller (Linux 6.13+) lists here each region a driver registers, with its size.
DMEM_CAPACITY = "sys/fs/cgroup/dmem.capacity"
# The dmem hook runs with the host's python3 (through /usr/bin/env): without one, its containers could not start.
HOST_PYTHONS = ("usr/bin/python3", "usr/local/bin/python3")


def host_python(host_root: Path) -> bool:
    return any(os.access(host_root / path, os.X_OK) for path in HOST_PYTHONS)


def dmem_regions(host_root: Path) -> dict[str, tuple[str, int]] | None:
    """Per PCI address, the first device-memory region its driver registers with the dmem controller (xe's
    ``drm/<pci>/vram0``, amdgpu's ``drm/<pci>/vram``) and its size; None where the kernel has no dmem controller."""
    text = _read(host_root / DMEM_CAPACITY)
    if text is None:
        return None
    regions: dict[str, tuple[str, int]] = {}
    for line in text.splitlines():
        name, _, size = line.strip().partition(" ")
        kind, _, rest = name.partition("/")
        pci, _, _ = rest.partition("/")
        if kind != "drm" or not _BDF.match(pci) or not size.strip().isdigit():
            continue
        regions.setdefault(pci.lower(), (name, int(size.strip())))
    return regions


def numa_node_of(host_root: Path, pci_address: str | None, device: Path | None = None) -> int | None:
    """The NUMA node of a PCI device, or None where sysfs reports none (-1) or has no such file."""
    candidates = []
    if device is not None:
        candidates.append(device / "numa_node")
    if pci_address:
        candidates.append(host_root / "sys/bus/pci/devices" / pci_address / "numa_node")
    for path in candidates:
        value = _read_int(path)
        if value is not None:
            return value if value >= 0 else None
    return None


@dataclass(frozen=True)
class _NvidiaProc:
    uuid: str | None
    model: str | None
    minor: int | None


def _nvidia_proc(host_root: Path, pci_address: str | None) -> _NvidiaProc | None:
    if not pci_address:
        return None
    text = _read(host_root / "proc/driver/nvidia/gpus" / pci_address / "information")
    if text is None:
        return None
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}
    minor = fields.get("Device Minor")
    return _NvidiaProc(
        uuid=fields.get("GPU UUID") or None,
        model=fields.get("Model") or None,
        minor=int(minor) if minor and minor.isdigit() else None,
    )


class DrmBackend:
    name = "drm"
    polls = True
    # NVML knows NVIDIA cards better (UUID, memory, XIDs); sysfs knows every other vendor's as well as anyone.
    authoritative_for = frozenset({Vendor.AMD, Vendor.INTEL, Vendor.VIRTIO, Vendor.APPLE, Vendor.OTHER})
    runs_when_named = False

    def __init__(self, host_root: Path, virtio: VirtioSection) -> None:
        self.host_root = host_root
        self._virtio = virtio
        self.drm_dir = host_root / "sys/class/drm"
        # What was worth a warning once: discovery runs again at every health poll.
        self._warned: set[str | None] = set()

    def available(self) -> bool:
        return self.drm_dir.is_dir()

    def looked_at(self) -> str:
        if not self.available():
            return f"drm: {self.drm_dir} does not exist"
        return f"drm: no GPU with a render node in {self.drm_dir}"

    def _dev(self, path: str) -> DeviceNode | None:
        """The host path ``path`` as a device node, if it exists under the host root."""
        if (self.host_root / path.lstrip("/")).exists():
            return DeviceNode(path)
        log.debug("%s is not present under %s; not handing it to containers", path, self.host_root)
        return None

    def discover(self) -> list[Gpu]:
        if not self.available():
            return []
        cards = sorted(
            (int(match.group(1)), entry)
            for entry in self.drm_dir.iterdir()
            if (match := _CARD.match(entry.name))
        )
        database = find_database(self.host_root)
        regions = dmem_regions(self.host_root) or {}
        if regions and not host_python(self.host_root):
            if "python3" not in self._warned:
                self._warned.add("python3")
                log.warning("the kernel's dmem controller has regions, but the host has no python3 to run the "
                            "hook that sets a container's dmem.max: slices are not held by it")
            regions = {}
        found: list[Gpu] = []
        per_vendor: dict[Vendor, int] = {}
        for _, entry in cards:
            gpu = self._card(entry, database)
            if gpu is None:
                continue
            if gpu.pci_address in regions:
                gpu = _with_region(gpu, *regions[gpu.pci_address])
            index = per_vendor.get(gpu.vendor, 0)
            per_vendor[gpu.vendor] = index + 1
            found.append(_with_index(gpu, index))
        return found

    def _card(self, entry: Path, database: Path | None) -> Gpu | None:
        device = entry / "device"
        if not device.exists():
            return None
        uevent = _uevent(device)
        driver = uevent.get("DRIVER")
        if driver is None and (device / "driver").exists():
            driver = Path(os.path.realpath(device / "driver")).name
        renders = sorted(p.name for p in (device / "drm").glob("renderD*")) if (device / "drm").is_dir() else []
        if not renders:
            # simpledrm, display-only controllers and connectors' parents: nothing a workload can compute on.
            log.debug("%s (driver %s) has no render node; skipping", entry.name, driver)
            return None
        vendor_hex, device_hex = _hex_id(device / "vendor"), _hex_id(device / "device")
        # virtio-gpu on virtio-MMIO (krunkit, libkrun) has vendor 0: only the driver name tells what it is.
        if driver == "virtio_gpu":
            kind = Vendor.VIRTIO
        else:
            kind = PCI_VENDORS.get(vendor_hex or "") or DRIVER_VENDORS.get(driver or "") or Vendor.OTHER
        pci = _pci_address(device, uevent)
        numa = numa_node_of(self.host_root, pci, device)

        nodes = [self._dev(f"/dev/dri/{renders[0]}")]
        if kind is not Vendor.VIRTIO:
            nodes.append(self._dev(f"/dev/dri/{entry.name}"))
        model: str | None = None
        memory = cores = None
        uuid = None
        utilization = used = None
        facts: str | None = None
        vendor = kind
        pci_ids = (vendor_hex, device_hex) if vendor_hex and device_hex else None
        base_id = f"{kind.value}-{pci.replace(':', '-')}" if pci else f"{kind.value}-{entry.name}"

        if kind is Vendor.AMD:
            nodes.append(self._dev("/dev/kfd"))
            model = _read(device / "product_name") or None
            memory = _read_int(device / "mem_info_vram_total")
            used = _read_int(device / "mem_info_vram_used")
            utilization = _read_int(device / "gpu_busy_percent")
            uuid = _read(device / "unique_id") or None
        elif kind is Vendor.NVIDIA:
            proc = _nvidia_proc(self.host_root, pci)
            if (proc is None or proc.minor is None) and pci not in self._warned:
                self._warned.add(pci)
                log.warning("NVIDIA GPU %s: no %s under %s, so no /dev/nvidiaN for it: CUDA containers need the "
                            "host's /proc (mount the host's root, as the DaemonSet does) or the nvml backend",
                            pci, "proc/driver/nvidia/gpus/<bus id>/information", self.host_root)
            if proc is not None:
                uuid, model = proc.uuid, proc.model
                if proc.minor is not None:
                    nodes = [self._dev(f"/dev/nvidia{proc.minor}"), self._dev("/dev/nvidiactl"),
                             self._dev("/dev/nvidia-uvm")]
                if uuid:
                    base_id = uuid
        elif kind is Vendor.VIRTIO:
            virtio = self._virtio
            vendor = Vendor(virtio.vendor)
            model = virtio.model or ("Apple GPU (virtio-gpu Venus)" if vendor is Vendor.APPLE else "Virtio-GPU")
            memory, cores = virtio.memory, virtio.cores
            # The config's word; the merge step lays the host agent's facts over it where there are any.
            facts = "config"
            # Under Venus, Vulkan reports the host GPU's ids, not virtio's: only the config knows them.
            pci_ids = None
            if virtio.vulkan_device:
                vid, did = virtio.vulkan_device.lower().split(":")
                pci_ids = (vid.zfill(4), did.zfill(4))

        if model is None and vendor_hex and device_hex:
            model = model_name(database, vendor_hex, device_hex)
        if model is None:
            label = f" {vendor_hex}:{device_hex}" if vendor_hex and device_hex else ""
            model = f"{kind.value} GPU{label}"
        return Gpu(
            id=base_id,
            index=0,
            vendor=vendor,
            model=model,
            backend=self.name,
            cores=cores,
            memory_bytes=memory,
            device_nodes=tuple(node for node in nodes if node is not None),
            numa_node=numa,
            pci_address=pci,
            uuid=uuid,
            driver=driver,
            pci_ids=pci_ids,
            utilization_percent=utilization,
            memory_used_bytes=used,
            facts=facts,
        )


def _with_region(gpu: Gpu, region: str, size: int) -> Gpu:
    """The GPU with its dmem region, and the region's size as its memory where sysfs gave none (xe's VRAM)."""
    return dataclasses.replace(gpu, limits=(*gpu.limits, DriverLimit(Mechanism.DMEM, region=region)),
                               memory_bytes=gpu.memory_bytes if gpu.memory_bytes is not None else size)


def _with_index(gpu: Gpu, index: int) -> Gpu:
    return dataclasses.replace(gpu, index=index)
