"""The driver's opaque device config (``GpuConfig``), carried in DeviceClasses and ResourceClaims.

Decoding is strict: an unknown field, a wrong type or a bad value fails the claim's preparation with a message
naming the config entry and the field, instead of silently running the pod with defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, ValidationError

from gpuppetti.base.strict import Strict, problems
from gpuppetti.core.config import Bytes
from gpuppetti.core.kubeobjects import DeviceConfig

API_VERSION = "gpu.gpuppetti.dev/v1alpha1"
KIND = "GpuConfig"


class MpsConfig(Strict):
    active_thread_percentage: int | None = Field(default=None, ge=1, le=100)
    pinned_device_memory_limit: Bytes | None = None
    pipe_directory: str = Field(default="/run/nvidia/mps", pattern=r"^/")


class SharingConfig(Strict):
    # A time slice's length is not something gpuppetti can set on every GPU, so there is no interval to give.
    strategy: Literal["TimeSlicing", "Exclusive", "MPS"] = "TimeSlicing"
    mps: MpsConfig | None = None


class GpuConfig(Strict):
    api_version: Literal["gpu.gpuppetti.dev/v1alpha1"]
    kind: Literal["GpuConfig"]
    sharing: SharingConfig = Field(default_factory=SharingConfig)


DEFAULT = GpuConfig.model_validate({"apiVersion": API_VERSION, "kind": KIND})
# What a request without MPS settings gets (a claim is planned a thousand times in one call: made once).
NO_MPS = MpsConfig()


class OpaqueConfigError(Exception):
    pass


def decode(parameters: Any, where: str) -> GpuConfig:
    if not isinstance(parameters, dict):
        raise OpaqueConfigError(f"{where}: parameters must be an object, got {type(parameters).__name__}")
    try:
        return GpuConfig.model_validate(parameters)
    except ValidationError as exc:
        found = "; ".join(f"{path}: {what}" for path, what in problems(exc, GpuConfig))
        raise OpaqueConfigError(f"{where}: invalid {KIND}: {found}") from None


def config_for_request(entries: Sequence[DeviceConfig], driver: str, request: str) -> GpuConfig:
    """The GpuConfig that applies to ``request``: class configs first, then claim configs, the last one winning."""
    if not entries:
        return DEFAULT
    parent = request.split("/", 1)[0]
    ordered = sorted(enumerate(entries), key=lambda item: 0 if item[1].source == "FromClass" else 1)
    chosen = DEFAULT
    for position, entry in ordered:
        if entry.opaque is None or entry.opaque.driver != driver:
            continue
        if entry.requests and request not in entry.requests and parent not in entry.requests:
            continue
        chosen = decode(entry.opaque.parameters, f"config[{position}] ({entry.source})")
    return chosen
