"""ResourceSlices (resource.k8s.io/v1) for one node's pool, serialised from the snapshot's pool and GPUs, and the
health of the same devices as the kubelet's health stream tells it.

What a device advertises (its capacity, its counters) is the sharing layer's size of it; this module only says
it in the API's words, with the attributes the GPU has and a taint where it is unhealthy. What many devices share
(a GPU's attributes, a size's capacity) is built once per slice and shared, not copied; a slice's dicts live only
until it is encoded (the kit's PoolContent): a pool can hold 10,000 devices.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Mapping
from fractions import Fraction
from typing import Any

from gpuppetti import __version__
from gpuppetti.base.quantity import format_quantity
from gpuppetti.core.kubeobjects import (
    Attribute,
    Counter,
    CounterSet,
    Device,
    DeviceCapacity,
    Taint,
)
from gpuppetti.core.model import Gpu, Health
from gpuppetti.kit.draplugin import DeviceHealth
from gpuppetti.kit.publisher import PoolContent
from gpuppetti.node.inventory import Snapshot
from gpuppetti.node.report import layer_would_hold
from gpuppetti.sharing.limits import gpu_enforced_by
from gpuppetti.sharing.pool import Capacity, PoolDevice

MAX_DEVICES = 128
# With taints or counter consumption, the API allows 64 devices per slice (Kubernetes 1.35).
MAX_DEVICES_ADVANCED = 64
MAX_COUNTER_SETS = 8
MAX_STRING = 64
UNHEALTHY_TAINT = "unhealthy"


def _semver(version: str) -> str:
    core = version.split("+", 1)[0]
    parts = [*core.split("."), "0", "0"][:3]
    return ".".join(p if p.isdigit() else "0" for p in parts)


# What holds a slice of the device to its memory (sharing.limits): `vulkan-layer`, `nvml`, `dmem`, a combination
# joined by `+`, or `none`; a claim selects held devices with CEL, e.g.
# device.attributes["gpu.gpuppetti.dev"].enforcedBy != "none". A C identifier, as the API wants attribute names.
ENFORCED_BY = "enforcedBy"
# On a partitions node: whether a claim that names no partition gets this device (dra.defaultPartition).
BY_DEFAULT = "byDefault"


# The driver's version as the API's version attribute takes it; the same on every device.
_DRIVER_VERSION: Attribute = {"version": _semver(__version__)}


def _attributes(gpu: Gpu, layer: bool) -> dict[str, Attribute]:
    attributes: dict[str, Attribute] = {
        "vendor": {"string": gpu.vendor.value},
        "model": {"string": gpu.model[:MAX_STRING]},
        "uuid": {"string": (gpu.uuid or gpu.id)[:MAX_STRING]},
        "index": {"int": gpu.index},
        "backend": {"string": gpu.backend},
        "driverVersion": _DRIVER_VERSION,
        ENFORCED_BY: {"string": gpu_enforced_by(gpu, layer)},
    }
    if gpu.cores is not None:
        attributes["cores"] = {"int": gpu.cores}
    if gpu.pci_address:
        attributes["resource.kubernetes.io/pciBusID"] = {"string": gpu.pci_address}
    return attributes


@functools.cache
def _q(name: str, value: Fraction) -> str:
    return format_quantity(value, binary=name == "memory")


def _capacity(capacities: tuple[Capacity, ...]) -> dict[str, DeviceCapacity]:
    found: dict[str, DeviceCapacity] = {}
    for capacity in capacities:
        entry: DeviceCapacity = {"value": _q(capacity.name, capacity.value)}
        if capacity.default is not None and capacity.valid_values:
            entry["requestPolicy"] = {"default": _q(capacity.name, capacity.default),
                                      "validValues": [_q(capacity.name, v) for v in capacity.valid_values]}
        elif capacity.default is not None and capacity.step is not None:
            step = _q(capacity.name, capacity.step)
            entry["requestPolicy"] = {"default": _q(capacity.name, capacity.default),
                                      "validRange": {"min": step, "max": entry["value"], "step": step}}
        found[capacity.name] = entry
    return found


def _counters(amounts: Mapping[str, Fraction]) -> dict[str, Counter]:
    return {name: {"value": _q(name, value)} for name, value in amounts.items()}


class _Shared:
    """What devices share, rendered once per object: the pool's capacities and sizes are shared objects, so their
    identity is a cheap key (hashing their Fractions is not)."""

    def __init__(self) -> None:
        self._capacities: dict[int, dict[str, DeviceCapacity]] = {}
        self._counters: dict[int, dict[str, Counter]] = {}

    def capacity(self, capacities: tuple[Capacity, ...]) -> dict[str, DeviceCapacity]:
        found = self._capacities.get(id(capacities))
        if found is None:
            found = self._capacities[id(capacities)] = _capacity(capacities)
        return found

    def counters(self, device: PoolDevice) -> dict[str, Counter]:
        found = self._counters.get(id(device.size))
        if found is None:
            found = self._counters[id(device.size)] = _counters(device.size.amounts())
        return found


def _tainted(gpu: Gpu) -> bool:
    """Whether the GPU's devices carry the unhealthy taint (and so go in the smaller slices that taints need)."""
    return gpu.health is not Health.HEALTHY


def _device(device: PoolDevice, gpu: Gpu, attributes: dict[str, Attribute], driver: str, shared: _Shared) -> Device:
    body: Device = {"name": device.name, "attributes": attributes, "capacity": shared.capacity(device.capacity)}
    if device.consumable:
        body["allowMultipleAllocations"] = True
    if device.part_counts:
        # The partition classes select devices by this attribute; a whole-GPU claim never lands here.
        body["attributes"] = {**attributes, "partitions": Attribute(int=max(device.part_counts))}
    if device.counter_set is not None:
        own = {**attributes, "partitions": Attribute(int=device.partitions)}
        if device.partitions > 1:
            own["partition"] = {"int": device.part}
        body["attributes"] = own
        body["consumesCounters"] = [{"counterSet": device.counter_set, "counters": shared.counters(device)}]
    if device.by_default is not None:
        # The vendor classes (and with them the extended-resource bridge) select, on a partitions node, only the
        # devices a claim that names no partition gets: dra.defaultPartition.
        body["attributes"] = {**body["attributes"], BY_DEFAULT: Attribute(bool=device.by_default)}
    if _tainted(gpu):
        taint: Taint = {"key": f"{driver}/{UNHEALTHY_TAINT}", "value": "true", "effect": "NoSchedule"}
        body["taints"] = [taint]
    return body


def pool_content(snapshot: Snapshot, node: str, layer: bool | None = None) -> PoolContent:
    """``layer``: whether the driver installed the Vulkan layer (None: as this installation and config would)."""
    holds = layer_would_hold(snapshot.config) if layer is None else layer and snapshot.config.sharing.enforce_memory
    driver = snapshot.config.dra.driver_name
    pool = snapshot.pool
    shared = _Shared()
    advanced = bool(pool.counter_sets) or any(_tainted(snapshot.gpus[d.gpu_id]) for d in pool.devices.values())
    per_slice = MAX_DEVICES_ADVANCED if advanced else MAX_DEVICES
    # Counter sets live in slices of their own (required from Kubernetes 1.35, allowed in 1.34).
    counter_sets: list[CounterSet] = [{"name": c.name, "counters": _counters(c.counters)} for c in pool.counter_sets]
    counter_specs = [{"sharedCounters": counter_sets[start:start + MAX_COUNTER_SETS]}
                     for start in range(0, len(counter_sets), MAX_COUNTER_SETS)]

    def device_specs() -> Iterator[dict[str, Any]]:
        # A slice's devices at a time: only one slice's dicts are alive while the pool is encoded.
        listed = list(pool.devices.values())
        for start in range(0, len(listed), per_slice):
            attributes: dict[str, dict[str, Attribute]] = {}
            devices: list[Device] = []
            for device in listed[start:start + per_slice]:
                gpu = snapshot.gpus[device.gpu_id]
                if gpu.id not in attributes:
                    attributes[gpu.id] = _attributes(gpu, holds)
                devices.append(_device(device, gpu, attributes[gpu.id], driver, shared))
            yield {"devices": devices}

    specs: Iterable[dict[str, Any]] = itertools.chain(counter_specs, device_specs())
    if not counter_specs and not pool.devices:
        # An empty pool is still published, so that consumers see the node has none.
        specs = [{"devices": []}]
    return PoolContent.of({**spec, "driver": driver, "nodeName": node} for spec in specs)


def device_health(snapshot: Snapshot) -> list[DeviceHealth]:
    """Each device of the pool, healthy while its GPU is."""
    return [DeviceHealth(device.name, gpu.health is Health.HEALTHY, f"GPU {gpu.id} is {gpu.health}")
            for device in snapshot.pool.devices.values() for gpu in (snapshot.gpus[device.gpu_id],)]
