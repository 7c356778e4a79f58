"""Which Vulkan driver serves each GPU: the installed probe (``gpuppetti-vkinfo --json``) lists the Vulkan devices
this machine has, with each one's driver (VK_KHR_driver_properties), PCI bus address (VK_EXT_pci_bus_info) and DRM
render node (VK_EXT_physical_device_drm); each GPU is matched to the device behind its own render node.

The ICD manifests on a node say which drivers are installed, not which one answers for a GPU: a VM with Mesa's
full set has RADV, ANV, NVK and Venus installed and only Venus drives its virtio-gpu, and a node whose GPU's driver
is missing still has lavapipe, which Vulkan workloads then run on without a word.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuppetti.base.fsutil import read_host_file
from gpuppetti.base.processes import run_within
from gpuppetti.commands.doctor.result import Result, ok, skip, warn
from gpuppetti.core.model import Gpu, Vendor
from gpuppetti.layer.vulkan import BUILT, DISABLE_ENV, PROBE

CHECK = "Vulkan driver"
# Creating a Vulkan instance loads every installed driver: seconds in an emulated VM.
PROBE_TIMEOUT_S = 60.0
OUTPUT_LIMIT = 1 << 20

# VkDriverId (Vulkan 1.2, VK_KHR_driver_properties): the values are fixed by the registry.
DRIVER_IDS = {
    1: "AMD_PROPRIETARY", 2: "AMD_OPEN_SOURCE", 3: "MESA_RADV", 4: "NVIDIA_PROPRIETARY",
    5: "INTEL_PROPRIETARY_WINDOWS", 6: "INTEL_OPEN_SOURCE_MESA", 7: "IMAGINATION_PROPRIETARY",
    8: "QUALCOMM_PROPRIETARY", 9: "ARM_PROPRIETARY", 10: "GOOGLE_SWIFTSHADER", 11: "GGP_PROPRIETARY",
    12: "BROADCOM_PROPRIETARY", 13: "MESA_LLVMPIPE", 14: "MOLTENVK", 15: "COREAVI_PROPRIETARY",
    16: "JUICE_PROPRIETARY", 17: "VERISILICON_PROPRIETARY", 18: "MESA_TURNIP", 19: "MESA_V3DV", 20: "MESA_PANVK",
    21: "SAMSUNG_PROPRIETARY", 22: "MESA_VENUS", 23: "MESA_DOZEN", 24: "MESA_NVK",
    25: "IMAGINATION_OPEN_SOURCE_MESA", 26: "MESA_HONEYKRISP", 27: "VULKAN_SC_EMULATION_ON_VULKAN",
}
VENUS = 22
VENUS_PREFIX = "Virtio-GPU Venus"

# The driver each kind of GPU needs, for the fix when none serves it.
NEEDED = {
    Vendor.VIRTIO: "Mesa's Venus driver (libvulkan_virtio.so; Debian and Fedora: mesa-vulkan-drivers), and a VM "
                   "that offers Venus (virtio-gpu with blob resources and a host-visible window: krunkit does)",
    Vendor.APPLE: "Mesa's Venus driver (libvulkan_virtio.so; Debian and Fedora: mesa-vulkan-drivers), and a VM "
                  "that offers Venus (virtio-gpu with blob resources and a host-visible window: krunkit does)",
    Vendor.AMD: "Mesa's RADV (libvulkan_radeon.so; Debian: mesa-vulkan-drivers)",
    Vendor.INTEL: "Mesa's ANV (libvulkan_intel.so; Debian: mesa-vulkan-drivers)",
    Vendor.NVIDIA: "NVIDIA's driver, which installs nvidia_icd.json (or Mesa's NVK for nouveau)",
}


class ProbeFailed(Exception):
    """The probe could not list the Vulkan devices; the message says why."""


@dataclass(frozen=True)
class VulkanDevice:
    """One device as the probe reports it."""

    name: str
    type: str
    uuid: str
    vendor_id: int | None
    device_id: int | None
    driver_id: int | None
    driver_name: str | None
    driver_info: str | None
    pci_bus: str | None
    render: str | None  # "major:minor" of its DRM render node

    @property
    def driver(self) -> str:
        """The driver in a few words: ``venus (Mesa 25.0.7, MESA_VENUS)``."""
        if self.driver_name is None:
            return "a driver that does not name itself (no VK_KHR_driver_properties)"
        known = DRIVER_IDS.get(self.driver_id or 0, f"driver id {self.driver_id}")
        info = f"{self.driver_info}, " if self.driver_info else ""
        return f"{self.driver_name} ({info}{known})"

    @property
    def venus_host(self) -> str | None:
        """Behind Venus, the host's device: MoltenVK's Apple GPU on a Mac, whatever the VM's host runs elsewhere."""
        if self.driver_id != VENUS and not self.name.startswith(VENUS_PREFIX):
            return None
        inner = self.name.removeprefix(VENUS_PREFIX).strip()
        return inner[1:-1] if inner.startswith("(") and inner.endswith(")") else inner or None

    def describe(self) -> str:
        return f'"{self.name}" ({self.type})'


def parse_report(text: str) -> list[VulkanDevice]:
    """The devices of ``gpuppetti-vkinfo --json``'s report. Raises ProbeFailed on what is not one."""
    try:
        report: Any = json.loads(text)
        entries = report["devices"]
        if not isinstance(entries, list):
            raise TypeError("devices is not a list")
        return [_device(entry) for entry in entries]
    except (ValueError, KeyError, TypeError) as exc:
        raise ProbeFailed(f"the probe's report is not what it should be ({exc})") from None


def _device(entry: Mapping[str, Any]) -> VulkanDevice:
    driver = entry.get("driver") or {}
    drm = entry.get("drm") or {}
    return VulkanDevice(
        name=str(entry["name"]), type=str(entry.get("type", "other")), uuid=str(entry.get("uuid", "")).lower(),
        vendor_id=entry.get("vendor_id"), device_id=entry.get("device_id"),
        driver_id=driver.get("id"), driver_name=driver.get("name"), driver_info=driver.get("info"),
        pci_bus=entry.get("pci_bus"), render=drm.get("render"),
    )


async def run_probe(probe: Path = BUILT / PROBE, timeout: float = PROBE_TIMEOUT_S) -> list[VulkanDevice]:
    """The Vulkan devices this machine's drivers show, through the installed probe, with gpuppetti's own layer off
    (it is never a node's implicit layer, but a workload's env could carry it). Raises ProbeFailed."""
    env = {**os.environ, DISABLE_ENV: "1"}
    env.pop("GPUPPETTI_VK_SLICES", None)
    try:
        code, stdout, stderr = await run_within([str(probe), "--json"], timeout, env=env,
                                                stdin=asyncio.subprocess.DEVNULL)
    except OSError as exc:
        raise ProbeFailed(f"cannot run {probe}: {exc.strerror or exc}") from None
    except TimeoutError:
        raise ProbeFailed(f"{probe.name} did not answer within {timeout:g}s") from None
    if code != 0:
        why = stderr.decode(errors="replace").strip().splitlines()
        raise ProbeFailed(why[-1] if why else f"{probe.name} exited {code}")
    return parse_report(stdout[:OUTPUT_LIMIT].decode(errors="replace"))


def render_numbers(host_root: Path, gpu: Gpu) -> str | None:
    """The GPU's render node as ``major:minor``, from sysfs (what VK_EXT_physical_device_drm reports)."""
    node = gpu.render_node
    if node is None:
        return None
    text = read_host_file(host_root / "sys/class/drm" / Path(node).name / "dev")
    return None if text is None else text.strip() or None


def _uuid_hex(uuid: str) -> str:
    return uuid.removeprefix("GPU-").replace("-", "").lower()


def device_of(gpu: Gpu, render: str | None, devices: Sequence[VulkanDevice]) -> int | None:
    """Which device (its index) drives ``gpu``: the one behind its render node, else at its PCI address, else (for
    NVIDIA) with its UUID; None where none does."""
    for index, device in enumerate(devices):
        if render is not None and device.render == render:
            return index
    for index, device in enumerate(devices):
        if gpu.pci_address and device.pci_bus and device.pci_bus.lower() == gpu.pci_address.lower():
            return index
    if gpu.uuid:
        for index, device in enumerate(devices):
            if device.uuid and device.uuid == _uuid_hex(gpu.uuid):
                return index
    return None


def _others(devices: Sequence[VulkanDevice], taken: set[int]) -> str:
    rest = [device.describe() for index, device in enumerate(devices) if index not in taken]
    return "; Vulkan workloads would run on " + ", ".join(rest) if rest else "; no other Vulkan device either"


def judge(gpus: Sequence[Gpu], devices: Sequence[VulkanDevice], host_root: Path) -> list[Result]:
    """One result per GPU that has a device node: the driver that serves it, or that none does."""
    results = []
    matched: dict[str, int | None] = {}
    for gpu in gpus:
        matched[gpu.id] = device_of(gpu, render_numbers(host_root, gpu), devices)
    taken = {index for index in matched.values() if index is not None}
    for gpu in gpus:
        index = matched[gpu.id]
        where = gpu.render_node or gpu.pci_address or gpu.id
        label = f"{gpu.id} ({where})"
        if index is None:
            needed = NEEDED.get(gpu.vendor, "the GPU vendor's Vulkan driver")
            access = ""
            node = gpu.render_node
            if node is not None and not os.access(host_root / node.lstrip("/"), os.R_OK | os.W_OK):
                access = f"; {node} is not open to this user: run as root"
            results.append(warn(CHECK, f"{label}: no Vulkan driver serves it{access}{_others(devices, taken)}",
                                f"install {needed}"))
            continue
        device = devices[index]
        detail = f"{label}: {device.driver}, device {device.describe()}"
        host = device.venus_host
        if host is not None:
            detail += f"; Venus forwards Vulkan to the VM's host, whose device is \"{host}\""
            if gpu.vendor is Vendor.APPLE and _cpu_renderer(host, device):
                results.append(warn(
                    CHECK, f"{detail}: a CPU renderer, not the Mac's GPU that the config names ({gpu.model})",
                    "run the VM with krunkit (minikube --driver krunkit, or a podman machine with libkrun), whose "
                    "Venus reaches Metal through MoltenVK"))
                continue
        results.append(ok(CHECK, detail))
    return results


def _cpu_renderer(host: str, device: VulkanDevice) -> bool:
    return device.type == "cpu" or host.startswith(("llvmpipe", "SwiftShader"))


async def driver_checks(gpus: Sequence[Gpu], host_root: Path, probe: Path = BUILT / PROBE) -> list[Result]:
    """The ``Vulkan driver`` results: one per GPU with a device node, or one saying why nothing was probed."""
    real = [gpu for gpu in gpus if not gpu.simulated and (gpu.render_node or gpu.pci_address or gpu.uuid)]
    if not real:
        return [skip(CHECK, "no GPU with a device node: simulated GPUs use whatever Vulkan device a container has")]
    if str(host_root) != "/":
        return [skip(CHECK, f"with --host-root {host_root}, the probe would run this container's Vulkan drivers, "
                     "not the node's: run `gpuppetti doctor` on the node itself to see which driver serves each GPU")]
    if not probe.is_file():
        return [skip(CHECK, f"this installation has no {probe.name} to probe Vulkan with")]
    try:
        devices = await run_probe(probe)
    except ProbeFailed as exc:
        return [warn(CHECK, f"Vulkan cannot be used here: {exc}",
                     "install the Vulkan loader (Debian: libvulkan1) and the GPU's driver (Debian: "
                     "mesa-vulkan-drivers; NVIDIA's driver ships its own)")]
    return judge(real, devices, host_root)
