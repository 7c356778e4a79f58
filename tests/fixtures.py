"""Fixture machines: sysfs and /dev trees shaped like real ones, built under a temporary host root.

The layout follows the kernel's: /sys/class/drm entries are relative symlinks into /sys/devices, a PCI GPU's
`device` is its PCI function (vendor, device, numa_node, uevent, a `driver` link), DRM puts cardN and
renderD12N under the device's drm/ directory, and connectors (cardN-DP-1) sit beside the cards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PCI_IDS = """\
# A few lines of the PCI ID database, in its real format
10de  NVIDIA Corporation
\t2684  AD102 [GeForce RTX 4090]
\t2330  GH100 [H100 SXM5 80GB]
1002  Advanced Micro Devices, Inc. [AMD/ATI]
\t744c  Navi 31 [Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M]
\t\t1002 0e3b  Radeon RX 7900 XTX
8086  Intel Corporation
\t56a0  DG2 [Arc A770]
\t4680  AlderLake-S GT1
\te20b  Battlemage G21 [Arc B580]
1af4  Red Hat, Inc.
\t1050  Virtio 1.0 GPU
"""


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@dataclass
class FakeHost:
    root: Path
    cards: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        (self.root / "sys/class/drm").mkdir(parents=True, exist_ok=True)
        (self.root / "dev/dri").mkdir(parents=True, exist_ok=True)
        _write(self.root / "usr/share/misc/pci.ids", PCI_IDS)

    def _drm(self, device: Path, card: int, render: int | None, connectors: tuple[str, ...]) -> None:
        names = [f"card{card}"] + ([f"renderD{render}"] if render is not None else [])
        for name in names:
            node = device / "drm" / name
            node.mkdir(parents=True)
            _link(node / "device", device)
            _write(node / "uevent", f"MAJOR=226\nMINOR={render if name.startswith('render') else card}\n"
                                    f"DEVNAME=dri/{name}\n")
            _link(self.root / "sys/class/drm" / name, node)
            (self.root / "dev/dri" / name).write_text("")
        for connector in connectors:
            path = device / "drm" / f"card{card}" / f"card{card}-{connector}"
            path.mkdir(parents=True)
            _link(self.root / "sys/class/drm" / f"card{card}-{connector}", path)
        _write(self.root / "sys/class/drm/version", "drm 1.1.0 20060810\n")
        self.cards[f"card{card}"] = device

    def pci_gpu(
        self, *, card: int, render: int | None, bdf: str, vendor: int, device: int, driver: str,
        numa: int = -1, attrs: dict[str, str] | None = None, connectors: tuple[str, ...] = (),
    ) -> Path:
        bridge = self.root / "sys/devices/pci0000:00/0000:00:01.0"
        path = bridge / bdf
        path.mkdir(parents=True)
        _write(path / "vendor", f"0x{vendor:04x}\n")
        _write(path / "device", f"0x{device:04x}\n")
        _write(path / "class", "0x030000\n")
        _write(path / "numa_node", f"{numa}\n")
        _write(path / "uevent", f"DRIVER={driver}\nPCI_CLASS=30000\nPCI_ID={vendor:04X}:{device:04X}\n"
                                f"PCI_SUBSYS_ID={vendor:04X}:0000\nPCI_SLOT_NAME={bdf}\n")
        drivers = self.root / "sys/bus/pci/drivers" / driver
        drivers.mkdir(parents=True, exist_ok=True)
        _link(path / "driver", drivers)
        _link(self.root / "sys/bus/pci/devices" / bdf, path)
        for name, value in (attrs or {}).items():
            _write(path / name, f"{value}\n")
        self._drm(path, card, render, connectors)
        return path

    def virtio_mmio_gpu(self, *, card: int = 0, render: int = 128) -> Path:
        path = self.root / "sys/devices/platform/a003e00.virtio_mmio/virtio1"
        path.mkdir(parents=True)
        # libkrun's virtio-MMIO transport reports vendor 0; the virtio device type 0x0010 is GPU.
        _write(path / "vendor", "0x0000\n")
        _write(path / "device", "0x0010\n")
        _write(path / "uevent", "DRIVER=virtio_gpu\nMODALIAS=virtio:d00000010v00000000\n")
        drivers = self.root / "sys/bus/virtio/drivers/virtio_gpu"
        drivers.mkdir(parents=True, exist_ok=True)
        _link(path / "driver", drivers)
        self._drm(path, card, render, ("Virtual-1",))
        return path

    def simpledrm(self, *, card: int = 0) -> None:
        path = self.root / "sys/devices/platform/simple-framebuffer.0"
        path.mkdir(parents=True)
        _write(path / "uevent", "DRIVER=simple-framebuffer\n")
        self._drm(path, card, None, ("Unknown-1",))

    def dev(self, *names: str) -> None:
        for name in names:
            _write(self.root / "dev" / name, "")

    def nvidia_proc(self, bdf: str, *, model: str, uuid: str, minor: int) -> None:
        _write(self.root / "proc/driver/nvidia/gpus" / bdf / "information",
               f"Model: \t\t {model}\nIRQ:   \t\t 180\nGPU UUID: \t {uuid}\nVideo BIOS: \t 95.02.18.80.5f\n"
               f"Bus Type: \t PCIe\nDMA Size: \t 47 bits\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n")

    def remove_card(self, name: str) -> None:
        """The GPU falls off the bus: its DRM entries go away."""
        for entry in list((self.root / "sys/class/drm").iterdir()):
            if entry.name == name or entry.name.startswith(f"{name}-") or (
                entry.is_symlink() and Path(os.path.realpath(entry)).parent.parent == self.cards[name]
            ):
                entry.unlink()

    def restore_card(self, name: str) -> None:
        device = self.cards[name]
        for node in (device / "drm").iterdir():
            if node.is_dir():
                link = self.root / "sys/class/drm" / node.name
                if not link.exists():
                    _link(link, node)


RADEON_VRAM = 24 * 2**30


def amd_machine(root: Path) -> FakeHost:
    host = FakeHost(root)
    host.simpledrm(card=0)
    host.pci_gpu(card=1, render=128, bdf="0000:03:00.0", vendor=0x1002, device=0x744C, driver="amdgpu", numa=0,
                 attrs={"mem_info_vram_total": str(RADEON_VRAM), "mem_info_vram_used": str(2**30),
                        "gpu_busy_percent": "17", "unique_id": "5e1d3f2a0b8c9d12"},
                 connectors=("DP-1", "HDMI-A-1"))
    host.dev("kfd")
    return host


def intel_machine(root: Path) -> FakeHost:
    host = FakeHost(root)
    host.pci_gpu(card=0, render=128, bdf="0000:00:02.0", vendor=0x8086, device=0x4680, driver="i915",
                 connectors=("eDP-1",))
    host.pci_gpu(card=1, render=129, bdf="0000:03:00.0", vendor=0x8086, device=0xE20B, driver="xe", numa=0,
                 connectors=("DP-1",))
    return host


def nvidia_machine(root: Path) -> FakeHost:
    host = FakeHost(root)
    host.pci_gpu(card=0, render=128, bdf="0000:3b:00.0", vendor=0x10DE, device=0x2684, driver="nvidia", numa=1,
                 connectors=("DP-1",))
    host.nvidia_proc("0000:3b:00.0", model="NVIDIA GeForce RTX 4090",
                     uuid="GPU-8b2e4c1a-1f3d-4e5a-9b7c-0a1b2c3d4e5f", minor=0)
    host.dev("nvidia0", "nvidiactl", "nvidia-uvm")
    return host


def virtio_vm(root: Path) -> FakeHost:
    host = FakeHost(root)
    host.virtio_mmio_gpu(card=0, render=128)
    return host


def two_vendor_machine(root: Path) -> FakeHost:
    host = FakeHost(root)
    host.pci_gpu(card=0, render=128, bdf="0000:00:02.0", vendor=0x8086, device=0x4680, driver="i915",
                 connectors=("eDP-1",))
    host.pci_gpu(card=1, render=129, bdf="0000:03:00.0", vendor=0x1002, device=0x744C, driver="amdgpu", numa=0,
                 attrs={"mem_info_vram_total": str(RADEON_VRAM)})
    host.dev("kfd")
    return host


MACHINES = {
    "amd": amd_machine,
    "intel": intel_machine,
    "nvidia": nvidia_machine,
    "virtio": virtio_vm,
    "two-vendors": two_vendor_machine,
}
