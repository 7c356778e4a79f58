"""The Kubernetes objects the DRA driver reads and writes, typed: ResourceClaims (read) and ResourceSlices (written).

Only the fields the driver uses are modelled. Reading ignores the rest (the API server adds fields over time);
writing leaves out what is unset, so that the objects stay as small as the API allows.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

RESOURCE_API = "resource.k8s.io/v1"


class _Object(BaseModel):
    model_config = ConfigDict(extra="ignore", alias_generator=to_camel, populate_by_name=True, frozen=True)

    def body(self) -> dict[str, Any]:
        """The object as the API takes it: camelCase keys, nothing unset."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class OwnerReference(_Object):
    api_version: str
    kind: str
    name: str
    uid: str
    controller: bool | None = None


class ObjectMeta(_Object):
    name: str = ""
    namespace: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    labels: dict[str, str] | None = None
    owner_references: list[OwnerReference] | None = None


# -- ResourceClaim (read) --------------------------------------------------------------------------------------


class DeviceResult(_Object):
    request: str = ""
    driver: str = ""
    pool: str = ""
    device: str = ""
    share_id: str | None = Field(default=None, alias="shareID")
    consumed_capacity: dict[str, str] | None = None


class OpaqueConfig(_Object):
    driver: str = ""
    parameters: Any = None


class DeviceConfig(_Object):
    source: str = "FromClaim"
    requests: list[str] | None = None
    opaque: OpaqueConfig | None = None


class DeviceAllocation(_Object):
    results: list[DeviceResult] = Field(default_factory=list)
    config: list[DeviceConfig] = Field(default_factory=list)


class Allocation(_Object):
    devices: DeviceAllocation = Field(default_factory=DeviceAllocation)


class ClaimStatus(_Object):
    allocation: Allocation | None = None


class ResourceClaim(_Object):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    status: ClaimStatus = Field(default_factory=ClaimStatus)


# -- ResourceSlice (written) ------------------------------------------------------------------------------------


class Attribute(_Object):
    string: str | None = None
    integer: int | None = Field(default=None, alias="int")
    boolean: bool | None = Field(default=None, alias="bool")
    version: str | None = None


class ValidRange(_Object):
    min: str
    max: str
    step: str


class RequestPolicy(_Object):
    default: str
    valid_range: ValidRange


class DeviceCapacity(_Object):
    value: str
    request_policy: RequestPolicy | None = None


class Counter(_Object):
    value: str


class CounterConsumption(_Object):
    counter_set: str
    counters: dict[str, Counter]


class Taint(_Object):
    key: str
    value: str | None = None
    effect: Literal["NoSchedule", "NoExecute", "None"]


class Device(_Object):
    name: str
    attributes: dict[str, Attribute] = Field(default_factory=dict)
    capacity: dict[str, DeviceCapacity] = Field(default_factory=dict)
    allow_multiple_allocations: bool | None = None
    consumes_counters: list[CounterConsumption] | None = None
    taints: list[Taint] | None = None


class CounterSet(_Object):
    name: str
    counters: dict[str, Counter]


class Pool(_Object):
    name: str
    generation: int
    resource_slice_count: int


class SliceSpec(_Object):
    driver: str
    node_name: str | None = None
    pool: Pool
    devices: list[Device] | None = None
    shared_counters: list[CounterSet] | None = None


class ResourceSlice(_Object):
    api_version: str = RESOURCE_API
    kind: str = "ResourceSlice"
    metadata: ObjectMeta
    spec: SliceSpec
