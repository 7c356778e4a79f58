"""A stand-in for nvidia-ml-py's ``pynvml`` that behaves like the real module, errors included.

Tests put this directory first on PYTHONPATH. The devices come from the JSON file named by FAKE_NVML_STATE:
    {"driver_loaded": true, "driver_version": "580.95.05",
     "devices": [{"uuid", "name", "memory", "minor", "bus_id", "cores", "xid": true}],
     "events": "/path/to/events"}
Each line appended to the events file, "<uuid> <xid>", becomes one XID critical error event.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, ClassVar

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
nvmlEventTypeXidCriticalError = 0x0000000000000008
nvmlEventTypeSingleBitEccError = 0x0000000000000001

_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    value: int
    _valClassMapping: ClassVar[dict[int, type[NVMLError]]] = {}

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        self.value = value

    def __str__(self) -> str:
        return _STRINGS.get(self.value, f"Unknown error {self.value}")


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


NVMLError._valClassMapping[NVML_ERROR_TIMEOUT] = NVMLError_Timeout
NVMLError._valClassMapping[NVML_ERROR_NOT_SUPPORTED] = NVMLError_NotSupported

_lock = threading.Lock()
_init_count = 0


class _Handle:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec


class _Memory:
    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self.used = 0


class _Pci:
    def __init__(self, bus_id: str) -> None:
        self.busId = bus_id.encode()  # a ctypes char array reads back as bytes


class _EventData:
    def __init__(self, device: _Handle, xid: int) -> None:
        self.device = device
        self.eventType = nvmlEventTypeXidCriticalError
        self.eventData = xid
        self.gpuInstanceId = 0xFFFFFFFF
        self.computeInstanceId = 0xFFFFFFFF


class _EventSet:
    def __init__(self) -> None:
        self.registered: dict[str, _Handle] = {}
        self.offset = 0


def _state() -> dict[str, Any]:
    with open(os.environ["FAKE_NVML_STATE"]) as f:
        state: dict[str, Any] = json.load(f)
    return state


def _check_init() -> None:
    if _init_count <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def nvmlInit() -> None:
    global _init_count
    if not _state().get("driver_loaded", True):
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
    with _lock:
        _init_count += 1


def nvmlShutdown() -> None:
    global _init_count
    _check_init()
    with _lock:
        _init_count -= 1


def nvmlSystemGetDriverVersion() -> str:
    _check_init()
    return str(_state().get("driver_version", "580.95.05"))


def nvmlDeviceGetCount() -> int:
    _check_init()
    return len(_state()["devices"])


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    _check_init()
    devices = _state()["devices"]
    if not 0 <= index < len(devices):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    spec = devices[index]
    if spec.get("lost"):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return _Handle(spec)


def nvmlDeviceGetUUID(handle: _Handle) -> str:
    _check_init()
    return str(handle.spec["uuid"])


def nvmlDeviceGetName(handle: _Handle) -> str:
    _check_init()
    return str(handle.spec["name"])


def nvmlDeviceGetMinorNumber(handle: _Handle) -> int:
    _check_init()
    return int(handle.spec["minor"])


def nvmlDeviceGetMemoryInfo(handle: _Handle) -> _Memory:
    _check_init()
    return _Memory(int(handle.spec["memory"]))


def nvmlDeviceGetPciInfo(handle: _Handle) -> _Pci:
    _check_init()
    return _Pci(str(handle.spec["bus_id"]))


def nvmlDeviceGetNumGpuCores(handle: _Handle) -> int:
    _check_init()
    if "cores" not in handle.spec:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return int(handle.spec["cores"])


def nvmlDeviceGetSupportedEventTypes(handle: _Handle) -> int:
    _check_init()
    return nvmlEventTypeXidCriticalError | nvmlEventTypeSingleBitEccError if handle.spec.get("xid", True) else 0


def nvmlEventSetCreate() -> _EventSet:
    _check_init()
    events = _EventSet()
    path = _state().get("events")
    if path and os.path.exists(path):
        events.offset = os.path.getsize(path)
    return events


def nvmlDeviceRegisterEvents(handle: _Handle, types: int, events: _EventSet) -> None:
    _check_init()
    if not handle.spec.get("xid", True) and types & nvmlEventTypeXidCriticalError:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    events.registered[str(handle.spec["uuid"])] = handle


def nvmlEventSetWait(events: _EventSet, timeout_ms: int) -> _EventData:
    _check_init()
    path = _state().get("events")
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        if path and os.path.exists(path):
            with open(path) as f:
                f.seek(events.offset)
                line = f.readline()
                if line.endswith("\n"):
                    events.offset = f.tell()
                    uuid, xid = line.split()
                    if uuid in events.registered:
                        return _EventData(events.registered[uuid], int(xid))
                    continue
        if time.monotonic() >= deadline:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        time.sleep(0.01)


def nvmlEventSetFree(events: _EventSet) -> None:
    _check_init()
    events.registered.clear()
