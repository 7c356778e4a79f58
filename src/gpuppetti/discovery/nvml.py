"""NVIDIA GPUs through NVML (the optional nvidia-ml-py package), and XID health events.

NVML is imported lazily, so a node without it, or without the NVIDIA driver, simply has no NVML backend.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from gpuppetti.base.processes import HelperFailed, run_helper
from gpuppetti.core.model import DeviceNode, DriverLimit, Gpu, Health, HealthEvent, Mechanism, Vendor
from gpuppetti.discovery.drm import numa_node_of

log = logging.getLogger(__name__)

WAIT_MS = 1000
NVML_MODULE = "pynvml"
NVML_LIBRARY = "libnvidia-ml.so.1"
# Where distributions and the GPU operator keep the driver's NVML library, relative to the host's root.
NVML_LIBRARY_DIRS = (
    "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib", "lib64",
    "run/nvidia/driver/usr/lib/x86_64-linux-gnu", "run/nvidia/driver/usr/lib/aarch64-linux-gnu",
    "run/nvidia/driver/usr/lib64", "home/kubernetes/bin/nvidia/lib64", "usr/local/nvidia/lib64",
)


def host_nvml_library(host_root: Path) -> Path | None:
    """The host's NVML library under ``host_root``, where the plugin runs in a container that mounts the host."""
    for directory in NVML_LIBRARY_DIRS:
        candidate = host_root / directory / NVML_LIBRARY
        if candidate.exists():
            return candidate
    return None


def preload_host_library(host_root: Path, load: Callable[[str], object] | None = None) -> Path | None:
    """Load the host's libnvidia-ml.so.1 by path, so that nvidia-ml-py's later load by name finds it (the dynamic
    loader matches an already loaded library by its soname). Nothing to do when the host root is ``/``."""
    if host_root == Path("/"):
        return None
    library = host_nvml_library(host_root)
    if library is None:
        return None
    if load is None:
        import ctypes

        def load(path: str) -> object:
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    try:
        load(str(library))
    except OSError as exc:
        log.warning("cannot load the host's NVML library %s: %s", library, exc)
        return None
    log.info("loaded the host's NVML library %s", library)
    return library


# NVIDIA's driver holds a container to a memory limit from this branch on (NVML's SetMemoryLimits_v1), where the
# container toolkit's hook asks it to.
LIMITS_DRIVER = 615
TOOLKIT_HOOK = "nvidia-cdi-hook"
TOOLKIT_COMMAND = "apply-cuda-memory-limits"
# Where the toolkit installs its hook on the host (packages, the GPU operator's toolkit container).
TOOLKIT_DIRS = ("usr/bin", "usr/local/bin", "usr/local/nvidia/toolkit", "run/nvidia/toolkit")
HELP_TIMEOUT_S = 5.0
# A --help is a few kilobytes: what is read past this is dropped.
HELP_LIMIT = 256 * 1024


def driver_branch(version: str) -> int | None:
    """``615.12.01`` -> 615; None where NVML's string is not a version."""
    head = version.strip().split(".", 1)[0]
    return int(head) if head.isdigit() else None


def toolkit_hook(host_root: Path) -> tuple[str | None, str]:
    """The host path of a container toolkit hook that applies memory limits, or None and why not. Its ``--help``
    must list the subcommand: older toolkits ship the program without it. Blocks (runs it): call from a thread."""
    found = [directory for directory in TOOLKIT_DIRS if os.access(host_root / directory / TOOLKIT_HOOK, os.X_OK)]
    if not found:
        return None, (f"no {TOOLKIT_HOOK} (the NVIDIA container toolkit's hook) in "
                      f"{', '.join('/' + d for d in TOOLKIT_DIRS)}")
    path = host_root / found[0] / TOOLKIT_HOOK
    host_path = f"/{found[0]}/{TOOLKIT_HOOK}"
    try:
        _, answer = run_helper([str(path), "--help"], HELP_TIMEOUT_S, HELP_LIMIT)
    except HelperFailed as exc:
        return None, f"{host_path} --help failed: {exc}"
    if TOOLKIT_COMMAND.encode() not in answer:
        return None, f"{host_path} has no {TOOLKIT_COMMAND} command (the NVIDIA container toolkit is too old)"
    return host_path, f"{host_path} {TOOLKIT_COMMAND}"


def memory_limits(host_root: Path, driver_version: str) -> tuple[DriverLimit | None, str]:
    """Whether NVIDIA's driver can hold this node's containers to a memory limit, and what says so or why not."""
    branch = driver_branch(driver_version)
    if branch is None or branch < LIMITS_DRIVER:
        return None, f"driver {driver_version} is older than r{LIMITS_DRIVER}, the first to enforce memory limits"
    hook, why = toolkit_hook(host_root)
    if hook is None:
        return None, why
    return DriverLimit(Mechanism.NVML, hook=hook), f"driver {driver_version} and {why}"


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def normalise_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` as sysfs names it: ``0000:3b:00.0``."""
    domain, _, rest = bus_id.strip().partition(":")
    if len(domain) > 4:
        domain = domain[-4:]
    return f"{domain}:{rest}".lower()


class NvmlBackend:
    name = "nvml"
    polls = True
    authoritative_for = frozenset({Vendor.NVIDIA})
    runs_when_named = False

    def __init__(self, host_root: Path, ignored_xids: Iterable[int], module: ModuleType | None = None) -> None:
        self.host_root = host_root
        self.ignored_xids = frozenset(ignored_xids)
        self._nvml: ModuleType | None = module
        self._why_not: str | None = None
        # Discovery runs at every health poll: the toolkit's hook is asked once per driver version.
        self._limits: tuple[str, DriverLimit | None] | None = None

    def _module(self) -> ModuleType | None:
        if self._nvml is None and self._why_not is None:
            try:
                self._nvml = importlib.import_module(NVML_MODULE)
            except ImportError:
                self._why_not = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
                return None
            preload_host_library(self.host_root)
        return self._nvml

    def available(self) -> bool:
        nvml = self._module()
        if nvml is None:
            return False
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self._why_not = f"NVML did not initialise: {exc}"
            return False
        nvml.nvmlShutdown()
        return True

    def looked_at(self) -> str:
        return f"nvml: {self._why_not or 'no NVIDIA GPU reported'}"

    def limits_support(self) -> tuple[DriverLimit | None, str]:
        """Whether the driver and the toolkit hold containers to memory limits here, and why not (doctor)."""
        nvml = self._module()
        if nvml is None:
            return None, self._why_not or "no NVML"
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return None, f"NVML did not initialise: {exc}"
        try:
            version = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError as exc:
            return None, f"NVML does not say the driver's version: {exc}"
        finally:
            nvml.nvmlShutdown()
        return memory_limits(self.host_root, version)

    def discover(self) -> list[Gpu]:
        nvml = self._module()
        if nvml is None:
            return []
        nvml.nvmlInit()
        try:
            limit = self._driver_limit(nvml)
            return [self._device(nvml, index, limit) for index in range(nvml.nvmlDeviceGetCount())]
        finally:
            nvml.nvmlShutdown()

    def _driver_limit(self, nvml: ModuleType) -> DriverLimit | None:
        try:
            version = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError as exc:
            log.warning("nvml: cannot read the driver's version (%s): its memory limits are not used", exc)
            return None
        if self._limits is None or self._limits[0] != version:
            limit, why = memory_limits(self.host_root, version)
            log.info("nvml: the driver %s slices' memory: %s", "holds" if limit else "does not hold", why)
            self._limits = (version, limit)
        return self._limits[1]

    def _device(self, nvml: ModuleType, index: int, limit: DriverLimit | None = None) -> Gpu:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
        bus_id = normalise_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
        memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        cores: int | None = None
        try:
            cores = int(nvml.nvmlDeviceGetNumGpuCores(handle))
        except (nvml.NVMLError, AttributeError):
            cores = None
        nodes = tuple(
            DeviceNode(path) for path in (f"/dev/nvidia{minor}", "/dev/nvidiactl", "/dev/nvidia-uvm")
        )
        return Gpu(
            id=uuid,
            index=index,
            vendor=Vendor.NVIDIA,
            model=_text(nvml.nvmlDeviceGetName(handle)),
            backend=self.name,
            cores=cores,
            memory_bytes=memory,
            device_nodes=nodes,
            numa_node=numa_node_of(self.host_root, bus_id),
            pci_address=bus_id,
            uuid=uuid,
            driver="nvidia",
            limits=(limit,) if limit is not None else (),
        )

    def watch(self, emit: Callable[[HealthEvent], None], stop: threading.Event) -> None:
        """Block until ``stop`` is set, emitting an Unhealthy event for every critical XID not ignored."""
        nvml = self._module()
        if nvml is None:
            return
        nvml.nvmlInit()
        events = nvml.nvmlEventSetCreate()
        try:
            watched = self._register(nvml, events)
            if not watched:
                log.warning("nvml: no GPU supports XID events; health comes from polling only")
                stop.wait()
                return
            while not stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait(events, WAIT_MS)
                except nvml.NVMLError as exc:
                    if exc.value == nvml.NVML_ERROR_TIMEOUT:
                        continue
                    # A failed wait is NVIDIA's "mark everything unhealthy" case: the driver is in trouble.
                    log.error("nvml: waiting for events failed: %s; marking every GPU unhealthy", exc)
                    for uuid in watched:
                        emit(HealthEvent(uuid, Health.UNHEALTHY, f"NVML event wait failed: {exc}"))
                    stop.wait(WAIT_MS / 1000)
                    continue
                self._handle(nvml, data, watched, emit)
        finally:
            nvml.nvmlEventSetFree(events)
            nvml.nvmlShutdown()

    def _register(self, nvml: ModuleType, events: Any) -> set[str]:
        watched: set[str] = set()
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            try:
                supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
                if not supported & nvml.nvmlEventTypeXidCriticalError:
                    log.warning("nvml: %s does not report XID events", uuid)
                    continue
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            except nvml.NVMLError as exc:
                log.warning("nvml: cannot watch XID events of %s: %s", uuid, exc)
                continue
            watched.add(uuid)
        return watched

    def _handle(self, nvml: ModuleType, data: Any, watched: set[str], emit: Callable[[HealthEvent], None]) -> None:
        if data.eventType != nvml.nvmlEventTypeXidCriticalError:
            return
        xid = int(data.eventData)
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
        except nvml.NVMLError:
            uuid = None
        if xid in self.ignored_xids:
            log.info("nvml: ignoring XID %d on %s (an application error, not the GPU's)", xid, uuid)
            return
        targets = [uuid] if uuid in watched else sorted(watched)
        for target in targets:
            emit(HealthEvent(target, Health.UNHEALTHY, f"XID {xid}", at=time.monotonic()))
