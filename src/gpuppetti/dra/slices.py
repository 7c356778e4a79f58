"""ResourceSlices (resource.k8s.io/v1) for one node's pool, serialised from the snapshot's pool and GPUs.

What a device advertises (its capacity, its counters) is the sharing layer's size of it; this module only says
it in the API's words, with the attributes the GPU has and a taint where it is unhealthy.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gpuppetti import __version__
from gpuppetti.inventory import Snapshot
from gpuppetti.kubeobjects import (
    Attribute,
    Counter,
    CounterConsumption,
    CounterSet,
    Device,
    DeviceCapacity,
    ObjectMeta,
    OwnerReference,
    Pool,
    RequestPolicy,
    ResourceSlice,
    SliceSpec,
    Taint,
    ValidRange,
)
from gpuppetti.model import Gpu, Health
from gpuppetti.quantity import format_quantity
from gpuppetti.sharing.pool import Capacity, PoolDevice

MAX_DEVICES = 128
# With taints or counter consumption, the API allows 64 devices per slice (Kubernetes 1.35).
MAX_DEVICES_ADVANCED = 64
MAX_COUNTER_SETS = 8
MAX_STRING = 64
UNHEALTHY_TAINT = "unhealthy"
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpuppetti"}


def _semver(version: str) -> str:
    core = version.split("+", 1)[0]
    parts = [*core.split("."), "0", "0"][:3]
    return ".".join(p if p.isdigit() else "0" for p in parts)


def _attributes(gpu: Gpu) -> dict[str, Attribute]:
    attributes = {
        "vendor": Attribute(string=gpu.vendor.value),
        "model": Attribute(string=gpu.model[:MAX_STRING]),
        "uuid": Attribute(string=(gpu.uuid or gpu.id)[:MAX_STRING]),
        "index": Attribute(integer=gpu.index),
        "backend": Attribute(string=gpu.backend),
        "driverVersion": Attribute(version=_semver(__version__)),
    }
    if gpu.cores is not None:
        attributes["cores"] = Attribute(integer=gpu.cores)
    if gpu.pci_address:
        attributes["resource.kubernetes.io/pciBusID"] = Attribute(string=gpu.pci_address)
    return attributes


def _q(name: str, value: Fraction) -> str:
    return format_quantity(value, binary=name == "memory")


def _capacity(capacity: Capacity) -> DeviceCapacity:
    if capacity.default is None or capacity.step is None:
        return DeviceCapacity(value=_q(capacity.name, capacity.value))
    step = _q(capacity.name, capacity.step)
    policy = RequestPolicy(default=_q(capacity.name, capacity.default),
                           valid_range=ValidRange(min=step, max=_q(capacity.name, capacity.value), step=step))
    return DeviceCapacity(value=_q(capacity.name, capacity.value), request_policy=policy)


def _counters(amounts: dict[str, Fraction]) -> dict[str, Counter]:
    return {name: Counter(value=_q(name, value)) for name, value in amounts.items()}


def _device(device: PoolDevice, gpu: Gpu, driver: str) -> Device:
    attributes = _attributes(gpu)
    consumes = None
    if device.counter_set is not None:
        attributes["partitions"] = Attribute(integer=device.partitions)
        if device.partitions > 1:
            attributes["partition"] = Attribute(integer=device.part)
        consumes = [CounterConsumption(counter_set=device.counter_set, counters=_counters(device.size.amounts()))]
    taints = None
    if gpu.health is not Health.HEALTHY:
        taints = [Taint(key=f"{driver}/{UNHEALTHY_TAINT}", value="true", effect="NoSchedule")]
    return Device(
        name=device.name, attributes=attributes, capacity={c.name: _capacity(c) for c in device.capacity},
        allow_multiple_allocations=True if device.consumable else None, consumes_counters=consumes, taints=taints,
    )


@dataclass(frozen=True)
class PoolContent:
    """The specs of a pool's slices, without the generation, so that a change can be told from a re-publish."""

    specs: tuple[dict[str, Any], ...]


def pool_content(snapshot: Snapshot, node: str) -> PoolContent:
    driver = snapshot.config.dra.driver_name
    pool = snapshot.pool
    devices = [_device(device, snapshot.gpus[device.gpu_id], driver).body() for device in pool.devices.values()]
    advanced = bool(pool.counter_sets) or any("taints" in body for body in devices)
    per_slice = MAX_DEVICES_ADVANCED if advanced else MAX_DEVICES
    specs: list[dict[str, Any]] = []
    # Counter sets live in slices of their own (required from Kubernetes 1.35, allowed in 1.34).
    counter_sets = [CounterSet(name=c.name, counters=_counters(dict(c.counters))).body() for c in pool.counter_sets]
    for start in range(0, len(counter_sets), MAX_COUNTER_SETS):
        specs.append({"sharedCounters": counter_sets[start:start + MAX_COUNTER_SETS]})
    for start in range(0, len(devices), per_slice):
        specs.append({"devices": devices[start:start + per_slice]})
    if not specs:
        # An empty pool is still published, so that consumers see the node has none.
        specs.append({"devices": []})
    for spec in specs:
        spec.update({"driver": driver, "nodeName": node})
    return PoolContent(tuple(specs))


def slice_name(node: str, driver: str, number: int) -> str:
    return f"{node}-{driver}-{number}"


def resource_slices(
    content: PoolContent, node: str, driver: str, generation: int, owner: OwnerReference | None
) -> list[dict[str, Any]]:
    """The slices to write, as API bodies."""
    slices = []
    for number, spec in enumerate(content.specs):
        metadata = ObjectMeta(name=slice_name(node, driver, number), labels=dict(MANAGED_BY),
                              owner_references=[owner] if owner is not None else None)
        pool = Pool(name=node, generation=generation, resource_slice_count=len(content.specs))
        body = ResourceSlice(metadata=metadata, spec=SliceSpec(driver=driver, pool=pool)).body()
        # The devices and counters were made into API bodies once per content; they are shared, not copied.
        body["spec"] = {**spec, "pool": body["spec"]["pool"]}
        slices.append(body)
    return slices
