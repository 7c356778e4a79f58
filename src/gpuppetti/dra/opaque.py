"""The driver's opaque device config (``GpuConfig``), carried in DeviceClasses and ResourceClaims.

Decoding is strict: an unknown field, a wrong type or a bad value fails the claim's preparation with a message
naming the config entry and the field, instead of silently running the pod with defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from gpuppetti.config import Bytes

API_VERSION = "gpu.gpuppetti.dev/v1alpha1"
KIND = "GpuConfig"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, alias_generator=to_camel)


class TimeSlicingConfig(_Strict):
    interval: Literal["Default", "Short", "Medium", "Long"] = "Default"


class MpsConfig(_Strict):
    active_thread_percentage: int | None = Field(default=None, ge=1, le=100)
    pinned_device_memory_limit: Bytes | None = None
    pipe_directory: str = Field(default="/run/nvidia/mps", pattern=r"^/")


class SharingConfig(_Strict):
    strategy: Literal["TimeSlicing", "Exclusive", "MPS"] = "TimeSlicing"
    time_slicing: TimeSlicingConfig | None = None
    mps: MpsConfig | None = None


class GpuConfig(_Strict):
    api_version: Literal["gpu.gpuppetti.dev/v1alpha1"]
    kind: Literal["GpuConfig"]
    sharing: SharingConfig = Field(default_factory=SharingConfig)


DEFAULT = GpuConfig.model_validate({"apiVersion": API_VERSION, "kind": KIND})


class OpaqueConfigError(Exception):
    pass


def decode(parameters: Any, where: str) -> GpuConfig:
    if not isinstance(parameters, dict):
        raise OpaqueConfigError(f"{where}: parameters must be an object, got {type(parameters).__name__}")
    try:
        return GpuConfig.model_validate(parameters)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            path = ".".join(str(p) for p in error["loc"] if not str(p).startswith(("function-", "literal[")))
            message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
            problems.append(f"{path}: {message}")
        raise OpaqueConfigError(f"{where}: invalid {KIND}: " + "; ".join(problems)) from None


def config_for_request(allocation: dict[str, Any], driver: str, request: str) -> GpuConfig:
    """The GpuConfig that applies to ``request``: class configs first, then claim configs, the last one winning."""
    entries: Sequence[dict[str, Any]] = (allocation.get("devices") or {}).get("config") or []
    parent = request.split("/", 1)[0]
    ordered = sorted(enumerate(entries), key=lambda item: 0 if item[1].get("source") == "FromClass" else 1)
    chosen = DEFAULT
    for position, entry in ordered:
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != driver:
            continue
        requests = entry.get("requests") or []
        if requests and request not in requests and parent not in requests:
            continue
        chosen = decode(opaque.get("parameters"), f"config[{position}] ({entry.get('source', 'FromClaim')})")
    return chosen
