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

from gpuppetti.discovery.drm import numa_node_of
from gpuppetti.model import DeviceNode, Gpu, Health, HealthEvent, Vendor

log = logging.getLogger(__name__)

WAIT_MS = 1000
NVML_MODULE = "pynvml"


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
                self._why_not = "nvidia-ml-py is not installed (pip install 'gpuppetti[nvml]')"
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
