"""The Mac's own GPU, from ``system_profiler``, ``ioreg`` and ``sysctl`` (and Metal, where pyobjc has it).

The commands are looked up on ``PATH`` and run with fixed arguments, so the backend runs anywhere it is asked to,
and tests run it on Linux with recorded outputs.
"""

from __future__ import annotations

import json
import logging
import plistlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from gpuppetti.core.model import Gpu, Vendor

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 20.0
SYSTEM_PROFILER = ("system_profiler", "SPDisplaysDataType", "-json")
IOREG = ("ioreg", "-a", "-r", "-d", "1", "-c", "AGXAccelerator")
SYSCTL_MEMSIZE = ("sysctl", "-n", "hw.memsize")
VENDORS = {"sppci_vendor_apple": Vendor.APPLE, "sppci_vendor_amd": Vendor.AMD, "sppci_vendor_ati": Vendor.AMD,
           "sppci_vendor_intel": Vendor.INTEL, "sppci_vendor_nvidia": Vendor.NVIDIA}


class CommandError(Exception):
    pass


def run_command(argv: tuple[str, ...]) -> bytes:
    if shutil.which(argv[0]) is None:
        raise CommandError(f"{argv[0]} is not on PATH")
    try:
        result = subprocess.run(argv, capture_output=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CommandError(f"{' '.join(argv)} failed: {exc}") from exc
    if result.returncode != 0:
        stderr = result.stderr.decode(errors="replace").strip()
        raise CommandError(f"{' '.join(argv)} exited {result.returncode}: {stderr}")
    return result.stdout


@dataclass(frozen=True)
class ProfiledGpu:
    model: str
    vendor: Vendor
    cores: int | None
    metal_family: str | None
    vram_bytes: int | None


def parse_system_profiler(raw: bytes) -> list[ProfiledGpu]:
    data = json.loads(raw)
    gpus: list[ProfiledGpu] = []
    for entry in data.get("SPDisplaysDataType", []):
        if entry.get("sppci_device_type") != "spdisplays_gpu":
            continue
        # sppci_model is the marketing name; _name may be a localisation key such as kHW_AppleM1Item.
        model = entry.get("sppci_model") or entry.get("_name") or "GPU"
        cores_text = str(entry.get("sppci_cores", "")).strip()
        family = entry.get("spdisplays_mtlgpufamilysupport") or entry.get("spdisplays_metal")
        vendor = VENDORS.get(str(entry.get("spdisplays_vendor", "")).lower(), Vendor.OTHER)
        if vendor is Vendor.OTHER and str(model).startswith("Apple"):
            vendor = Vendor.APPLE
        gpus.append(ProfiledGpu(
            model=str(model),
            vendor=vendor,
            cores=int(cores_text) if cores_text.isdigit() else None,
            metal_family=_metal_family(family),
            vram_bytes=_vram(entry.get("spdisplays_vram") or entry.get("spdisplays_vram_shared")),
        ))
    return gpus


def _metal_family(value: Any) -> str | None:
    if not isinstance(value, str) or value == "spdisplays_supported":
        return None
    return value.removeprefix("spdisplays_")


def _vram(value: Any) -> int | None:
    if not isinstance(value, str):
        return None
    number, _, unit = value.strip().partition(" ")
    factors = {"MB": 2**20, "GB": 2**30}
    if number.isdigit() and unit in factors:
        return int(number) * factors[unit]
    return None


@dataclass(frozen=True)
class Accelerator:
    model: str | None
    cores: int | None
    utilization_percent: int | None
    in_use_memory_bytes: int | None


def parse_ioreg(raw: bytes) -> list[Accelerator]:
    entries = plistlib.loads(raw)
    if isinstance(entries, dict):
        entries = [entries]
    accelerators: list[Accelerator] = []
    for entry in entries:
        stats = entry.get("PerformanceStatistics") or {}
        utilization = stats.get("Device Utilization %", stats.get("GPU Activity(%)"))
        in_use = stats.get("In use system memory")
        cores = entry.get("gpu-core-count")
        accelerators.append(Accelerator(
            model=entry.get("model"),
            cores=int(cores) if isinstance(cores, int) else None,
            utilization_percent=int(utilization) if isinstance(utilization, int) else None,
            in_use_memory_bytes=int(in_use) if isinstance(in_use, int) else None,
        ))
    return accelerators


def metal_working_set() -> int | None:
    """``recommendedMaxWorkingSetSize`` of the default Metal device, where pyobjc-framework-Metal is installed."""
    try:
        import Metal  # type: ignore[import-not-found]
    except ImportError:
        return None
    device = Metal.MTLCreateSystemDefaultDevice()
    if device is None:
        return None
    return int(device.recommendedMaxWorkingSetSize())


class MacosBackend:
    name = "macos"
    polls = True
    authoritative_for: frozenset[Vendor] = frozenset()
    def __init__(self) -> None:
        self._why_not: str | None = None
        # Its commands come from PATH, so it runs wherever it is named and they are there (the tests run it on
        # Linux, with stand-ins); elsewhere, naming it is refused in one line.
        self.runs_when_named = sys.platform == "darwin" or shutil.which(SYSTEM_PROFILER[0]) is not None

    def available(self) -> bool:
        # Under `auto` only on a Mac; `--backend macos` runs it anywhere (tests use stand-in commands).
        return sys.platform == "darwin"

    def looked_at(self) -> str:
        if self._why_not is None and not self.available():
            missing = "" if self.runs_when_named else f", and {SYSTEM_PROFILER[0]} is not on PATH"
            return f"macos: this is not macOS ({sys.platform}){missing}"
        return f"macos: {self._why_not or 'system_profiler reported no GPU'}"

    def discover(self) -> list[Gpu]:
        try:
            profiled = parse_system_profiler(run_command(SYSTEM_PROFILER))
        except (CommandError, ValueError) as exc:
            self._why_not = str(exc)
            log.warning("macos: %s", exc)
            return []
        accelerators: list[Accelerator] = []
        try:
            accelerators = parse_ioreg(run_command(IOREG))
        except (CommandError, ValueError, plistlib.InvalidFileException) as exc:
            log.info("macos: no IORegistry accelerator details: %s", exc)
        memory: int | None = None
        try:
            memory = int(run_command(SYSCTL_MEMSIZE).strip())
        except (CommandError, ValueError) as exc:
            log.info("macos: no hw.memsize: %s", exc)
        working_set = metal_working_set()

        gpus: list[Gpu] = []
        # ioreg lists only Apple's own accelerators (AGXAccelerator), in the order system_profiler shows them.
        apple_seen = 0
        for index, found in enumerate(profiled):
            accelerator: Accelerator | None = None
            if found.vendor is Vendor.APPLE:
                if apple_seen < len(accelerators):
                    accelerator = accelerators[apple_seen]
                apple_seen += 1
            unified = found.vendor is Vendor.APPLE
            gpus.append(Gpu(
                id=f"macos-{found.vendor.value}-{index}",
                index=index,
                vendor=found.vendor,
                model=(accelerator.model if accelerator and accelerator.model else found.model),
                backend=self.name,
                cores=found.cores or (accelerator.cores if accelerator else None),
                memory_bytes=(working_set or memory) if unified else found.vram_bytes,
                metal_family=found.metal_family,
                utilization_percent=accelerator.utilization_percent if accelerator else None,
                memory_used_bytes=accelerator.in_use_memory_bytes if accelerator else None,
            ))
        return gpus
