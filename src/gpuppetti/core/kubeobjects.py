"""The Kubernetes objects the DRA driver reads and writes, typed: ResourceClaims (read) and ResourceSlices (written).

Only the fields the driver uses are modelled. Reading ignores the rest (the API server adds fields over time);
writing leaves out what is unset, so that the objects stay as small as the API allows.
"""

from __future__ import annotations

from typing import Any, Literal, Required, TypedDict

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


class Node(_Object):
    """What the daemons read of a Node: its uid (the slices' owner) and labels."""

    metadata: ObjectMeta


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


class ConsumerReference(_Object):
    resource: str = ""
    name: str = ""
    uid: str = ""


class ClaimStatus(_Object):
    allocation: Allocation | None = None
    reserved_for: list[ConsumerReference] = Field(default_factory=list)


class ResourceClaim(_Object):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    status: ClaimStatus = Field(default_factory=ClaimStatus)


# -- ResourceSlice (written, and read back for its name, version and generation) ------------------------------
# What the driver writes is built as typed dicts: a pool of 10,000 devices is 100,000 small objects, and model
# instances of each would cost the publisher more than the API calls do.


class Attribute(TypedDict, total=False):
    string: str
    int: int
    bool: bool
    version: str


class ValidRange(TypedDict):
    min: str
    max: str
    step: str


class RequestPolicy(TypedDict, total=False):
    default: Required[str]
    # One of the two.
    validRange: ValidRange
    validValues: list[str]


class DeviceCapacity(TypedDict, total=False):
    value: Required[str]
    requestPolicy: RequestPolicy


class Counter(TypedDict):
    value: str


class CounterConsumption(TypedDict):
    counterSet: str
    counters: dict[str, Counter]


class Taint(TypedDict):
    key: str
    value: str
    effect: Literal["NoSchedule", "NoExecute", "None"]


class Device(TypedDict, total=False):
    name: Required[str]
    attributes: dict[str, Attribute]
    capacity: dict[str, DeviceCapacity]
    allowMultipleAllocations: bool
    consumesCounters: list[CounterConsumption]
    taints: list[Taint]


class CounterSet(TypedDict):
    name: str
    counters: dict[str, Counter]


class SliceSpec(TypedDict, total=False):
    driver: Required[str]
    nodeName: str
    pool: Required[PoolRef]
    devices: list[Device]
    sharedCounters: list[CounterSet]


class PoolRef(TypedDict):
    name: str
    generation: int
    resourceSliceCount: int


class SliceMeta(TypedDict, total=False):
    name: Required[str]
    labels: dict[str, str]
    ownerReferences: list[dict[str, Any]]
    resourceVersion: str


class ResourceSliceBody(TypedDict):
    apiVersion: str
    kind: str
    metadata: SliceMeta
    spec: SliceSpec


class SlicePool(_Object):
    generation: int = 0


class SliceSpecRead(_Object):
    pool: SlicePool = Field(default_factory=SlicePool)


class ResourceSlice(_Object):
    """A slice as listed: what the publisher compares with what it wrote."""

    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: SliceSpecRead = Field(default_factory=SliceSpecRead)
