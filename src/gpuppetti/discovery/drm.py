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

from gpuppetti.base.fsutil import read_host_file
from gpuppetti.base.quantity import MAX_BYTES
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
    text = read_host_file(path)
    return None if text is None else text.strip()


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
        if _BDF.fullmatch(candidate):
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
        if kind != "drm" or not _BDF.fullmatch(pci) or not size.strip().isdigit() or int(size) > MAX_BYTES:
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
            if (match := _CARD.fullmatch(entry.name))
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
        """The card's GPU: what sysfs says of any card, with its vendor's own facts."""
        card = _sysfs_card(entry)
        if card is None:
            return None
        vendor_facts = {Vendor.AMD: _amd_facts, Vendor.NVIDIA: self._nvidia_facts,
                        Vendor.VIRTIO: self._virtio_facts}.get(card.kind, _common_facts)
        return self._gpu(card, vendor_facts(card), database)

    def _nvidia_facts(self, card: _SysfsCard) -> _Facts:
        """The UUID, model and device nodes the driver's /proc gives; the DRM nodes where it gives no minor."""
        common = _common_facts(card)
        proc = _nvidia_proc(self.host_root, card.pci)
        if (proc is None or proc.minor is None) and card.pci not in self._warned:
            self._warned.add(card.pci)
            log.warning("NVIDIA GPU %s: no %s under %s, so no /dev/nvidiaN for it: CUDA containers need the "
                        "host's /proc (mount the host's root, as the DaemonSet does) or the nvml backend",
                        card.pci, "proc/driver/nvidia/gpus/<bus id>/information", self.host_root)
        if proc is None:
            return common
        nodes = common.nodes if proc.minor is None else (
            f"/dev/nvidia{proc.minor}", "/dev/nvidiactl", "/dev/nvidia-uvm")
        return dataclasses.replace(common, nodes=nodes, uuid=proc.uuid, model=proc.model, id=proc.uuid or common.id)

    def _virtio_facts(self, card: _SysfsCard) -> _Facts:
        """The config's word on the GPU behind virtio-gpu; the merge step lays the host agent's facts over it where
        there are any. Only its render node: the card node is the VM's display."""
        virtio = self._virtio
        vendor = Vendor(virtio.vendor)
        # Under Venus, Vulkan reports the host GPU's ids, not virtio's: only the config knows them.
        pci_ids = None
        if virtio.vulkan_device:
            vid, did = virtio.vulkan_device.lower().split(":")
            pci_ids = (vid.zfill(4), did.zfill(4))
        return _Facts(
            nodes=(f"/dev/dri/{card.render}",), vendor=vendor, id=card.base_id, pci_ids=pci_ids,
            model=virtio.model or ("Apple GPU (virtio-gpu Venus)" if vendor is Vendor.APPLE else "Virtio-GPU"),
            memory=virtio.memory, cores=virtio.cores, facts="config")

    def _gpu(self, card: _SysfsCard, facts: _Facts, database: Path | None) -> Gpu:
        model = facts.model
        if model is None and card.vendor_hex and card.device_hex:
            model = model_name(database, card.vendor_hex, card.device_hex)
        if model is None:
            label = f" {card.vendor_hex}:{card.device_hex}" if card.vendor_hex and card.device_hex else ""
            model = f"{card.kind.value} GPU{label}"
        nodes = [self._dev(path) for path in facts.nodes]
        return Gpu(
            id=facts.id,
            index=0,
            vendor=facts.vendor,
            model=model,
            backend=self.name,
            cores=facts.cores,
            memory_bytes=facts.memory,
            device_nodes=tuple(node for node in nodes if node is not None),
            numa_node=numa_node_of(self.host_root, card.pci, card.device),
            pci_address=card.pci,
            uuid=facts.uuid,
            driver=card.driver,
            pci_ids=facts.pci_ids,
            utilization_percent=facts.utilization,
            memory_used_bytes=facts.used,
            facts=facts.facts,
        )


@dataclass(frozen=True)
class _SysfsCard:
    """What sysfs says of a card with a render node, whatever its vendor."""

    entry: Path
    device: Path
    driver: str | None
    render: str
    kind: Vendor
    vendor_hex: str | None
    device_hex: str | None
    pci: str | None

    @property
    def base_id(self) -> str:
        return f"{self.kind.value}-{self.pci.replace(':', '-')}" if self.pci else f"{self.kind.value}-{self.entry.name}"


@dataclass(frozen=True)
class _Facts:
    """What a vendor's own files (or, for virtio-gpu, the config) say of a card: its device nodes as host paths."""

    nodes: tuple[str, ...]
    vendor: Vendor
    id: str
    pci_ids: tuple[str, str] | None
    model: str | None = None
    memory: int | None = None
    cores: int | None = None
    uuid: str | None = None
    utilization: int | None = None
    used: int | None = None
    facts: str | None = None


def _sysfs_card(entry: Path) -> _SysfsCard | None:
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
    return _SysfsCard(entry, device, driver, renders[0], kind, vendor_hex, device_hex, _pci_address(device, uevent))


def _common_facts(card: _SysfsCard) -> _Facts:
    """Any vendor's: its render and card nodes, its PCI ids; the rest is left to the PCI ids database."""
    pci_ids = (card.vendor_hex, card.device_hex) if card.vendor_hex and card.device_hex else None
    return _Facts(nodes=(f"/dev/dri/{card.render}", f"/dev/dri/{card.entry.name}"), vendor=card.kind,
                  id=card.base_id, pci_ids=pci_ids)


def _amd_facts(card: _SysfsCard) -> _Facts:
    """amdgpu's own files: the model, VRAM and its use, busy percent, unique id; and /dev/kfd for ROCm."""
    common = _common_facts(card)
    device = card.device
    return dataclasses.replace(
        common, nodes=(*common.nodes, "/dev/kfd"), model=_read(device / "product_name") or None,
        memory=_read_int(device / "mem_info_vram_total"), used=_read_int(device / "mem_info_vram_used"),
        utilization=_read_int(device / "gpu_busy_percent"), uuid=_read(device / "unique_id") or None)


def _with_region(gpu: Gpu, region: str, size: int) -> Gpu:
    """The GPU with its dmem region, and the region's size as its memory where sysfs gave none (xe's VRAM)."""
    return dataclasses.replace(gpu, limits=(*gpu.limits, DriverLimit(Mechanism.DMEM, region=region)),
                               memory_bytes=gpu.memory_bytes if gpu.memory_bytes is not None else size)


def _with_index(gpu: Gpu, index: int) -> Gpu:
    return dataclasses.replace(gpu, index=index)
