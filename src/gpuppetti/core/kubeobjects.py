"""The Kubernetes objects the DRA driver reads and writes, typed: ResourceClaims (read) and ResourceSlices (written),
and the one error a call to the API raises.

Only the fields the driver uses are modelled. Reading ignores the rest (the API server adds fields over time);
writing leaves out what is unset, so that the objects stay as small as the API allows. What is read is decoded
with msgspec (lightkube's own JSON library, so loaded anyway): its types are cheap to define and to hold, where a
model per kind would weigh on the driver's start and memory.
"""

from __future__ import annotations

from typing import Any, Literal, Required, TypedDict

import msgspec

RESOURCE_API = "resource.k8s.io/v1"


class ApiError(Exception):
    """The API server refused a request, could not be reached, or answered something that is not what was asked
    for. ``status`` is None when there was no answer. Every call to the API raises it and nothing else, so that a
    caller can retry it and let any other exception (a bug) through."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Object(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    def body(self) -> dict[str, Any]:
        """The object as the API takes it: camelCase keys, nothing unset."""
        converted: dict[str, Any] = msgspec.to_builtins(self)
        return converted


class OwnerReference(_Object, frozen=True):
    api_version: str
    kind: str
    name: str
    uid: str
    controller: bool | None = None


class ObjectMeta(_Object, frozen=True):
    name: str = ""
    namespace: str | None = None
    uid: str | None = None
    resource_version: str | None = None
    labels: dict[str, str] | None = None
    owner_references: list[OwnerReference] | None = None


class Node(_Object, frozen=True):
    """What the daemons read of a Node: its uid (the slices' owner) and labels."""

    metadata: ObjectMeta


# -- ResourceClaim (read) --------------------------------------------------------------------------------------


class DeviceResult(_Object, frozen=True):
    request: str = ""
    driver: str = ""
    pool: str = ""
    device: str = ""
    share_id: str | None = msgspec.field(default=None, name="shareID")
    consumed_capacity: dict[str, str] | None = None


class OpaqueConfig(_Object, frozen=True):
    driver: str = ""
    parameters: Any = None


class DeviceConfig(_Object, frozen=True):
    source: str = "FromClaim"
    requests: list[str] | None = None
    opaque: OpaqueConfig | None = None


class DeviceAllocation(_Object, frozen=True):
    results: list[DeviceResult] = msgspec.field(default_factory=list)
    config: list[DeviceConfig] = msgspec.field(default_factory=list)


class Allocation(_Object, frozen=True):
    devices: DeviceAllocation = msgspec.field(default_factory=DeviceAllocation)


class ConsumerReference(_Object, frozen=True):
    resource: str = ""
    name: str = ""
    uid: str = ""


class ClaimStatus(_Object, frozen=True):
    allocation: Allocation | None = None
    reserved_for: list[ConsumerReference] = msgspec.field(default_factory=list)


class ResourceClaim(_Object, frozen=True):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    status: ClaimStatus = msgspec.field(default_factory=ClaimStatus)


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


class SlicePool(_Object, frozen=True):
    generation: int = 0


class SliceSpecRead(_Object, frozen=True):
    pool: SlicePool = msgspec.field(default_factory=SlicePool)


class ResourceSlice(_Object, frozen=True):
    """A slice as listed: what the publisher compares with what it wrote."""

    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: SliceSpecRead = msgspec.field(default_factory=SliceSpecRead)
