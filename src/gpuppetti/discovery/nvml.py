"""NVIDIA GPUs through NVML (the optional nvidia-ml-py package), and XID health events.

NVML is imported lazily, so a node without it, or without the NVIDIA driver, simply has no NVML backend.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from gpuppetti.core.model import DeviceNode, Gpu, Health, HealthEvent, Vendor
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

    def _module(self) -> ModuleType | None:
        if self._nvml is None and self._why_not is None:
            try:
                self._nvml = importlib.import_module(NVML_MODULE)
            except ImportError:
                self._why_not = ("nvidia-ml-py is not installed (pip install nvidia-ml-py, or the nvml extra: "
                                 "pip install '.[nvml]' in a checkout)")
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

    def discover(self) -> list[Gpu]:
        nvml = self._module()
        if nvml is None:
            return []
        nvml.nvmlInit()
        try:
            return [self._device(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
        finally:
            nvml.nvmlShutdown()

    def _device(self, nvml: ModuleType, index: int) -> Gpu:
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
