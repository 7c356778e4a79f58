"""ResourceSlices (resource.k8s.io/v1) for one node's pool, as plain API objects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gpuppetti import __version__
from gpuppetti.config import DraSection
from gpuppetti.dra.devices import DraDevice, counter_set_name, pool_devices
from gpuppetti.model import Gpu, Health
from gpuppetti.quantity import format_quantity

API_VERSION = "resource.k8s.io/v1"
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


def _attributes(gpu: Gpu) -> dict[str, dict[str, Any]]:
    attributes: dict[str, dict[str, Any]] = {
        "vendor": {"string": gpu.vendor.value},
        "model": {"string": gpu.model[:MAX_STRING]},
        "uuid": {"string": (gpu.uuid or gpu.id)[:MAX_STRING]},
        "index": {"int": gpu.index},
        "backend": {"string": gpu.backend},
        "driverVersion": {"version": _semver(__version__)},
    }
    if gpu.cores is not None:
        attributes["cores"] = {"int": gpu.cores}
    if gpu.pci_address:
        attributes["resource.kubernetes.io/pciBusID"] = {"string": gpu.pci_address}
    return attributes


def _share(gpu: Gpu, fraction: Fraction) -> dict[str, Fraction]:
    """What ``fraction`` of ``gpu`` amounts to, per capacity name. ``share`` exists even when nothing else is known."""
    amounts = {"share": fraction}
    if gpu.cores is not None:
        amounts["cores"] = gpu.cores * fraction
    if gpu.memory_bytes is not None:
        # Whole bytes: a partition never claims more memory than it has.
        amounts["memory"] = Fraction(int(gpu.memory_bytes * fraction))
    return amounts


def _q(name: str, value: Fraction) -> str:
    return format_quantity(value, binary=name == "memory")


def _capacity(amounts: Mapping[str, Fraction]) -> dict[str, dict[str, Any]]:
    return {name: {"value": _q(name, value)} for name, value in amounts.items()}


def _consumable_capacity(gpu: Gpu, shares: int) -> dict[str, dict[str, Any]]:
    """Each capacity with a request policy. A claim that names none takes 1/shares of each; a claim that names some
    takes what it names, and of the others only the minimum: the scheduler charges a capacity's default to every
    claim that leaves it out, so a default share of 1/shares would cap a GPU at ``shares`` claims however little
    each asks for. ``share`` then keeps its 1/shares default only for a GPU whose cores and memory are unknown."""
    whole = _share(gpu, Fraction(1))
    default = _share(gpu, Fraction(1, shares))
    measured = "cores" in whole or "memory" in whole
    capacity: dict[str, dict[str, Any]] = {}
    for name, total in whole.items():
        if total <= 0:
            continue
        minimum = min({"share": Fraction(1, 1000), "cores": Fraction(1), "memory": Fraction(2**20)}[name], total)
        wanted = minimum if name == "share" and measured else max(default[name], minimum)
        policy: dict[str, Any] = {
            "default": _q(name, wanted),
            "validRange": {"min": _q(name, minimum), "max": _q(name, total), "step": _q(name, minimum)},
        }
        capacity[name] = {"value": _q(name, total), "requestPolicy": policy}
    return capacity


def _device(device: DraDevice, gpu: Gpu, section: DraSection, driver: str) -> dict[str, Any]:
    body: dict[str, Any] = {"name": device.name, "attributes": _attributes(gpu)}
    if section.slicing == "consumable":
        body["capacity"] = _consumable_capacity(gpu, section.shares)
        body["allowMultipleAllocations"] = True
    else:
        body["capacity"] = _capacity(_share(gpu, device.fraction))
    if section.slicing == "partitions":
        body["attributes"]["partitions"] = {"int": device.partitions}
        if device.partitions > 1:
            body["attributes"]["partition"] = {"int": device.part}
        body["consumesCounters"] = [{
            "counterSet": counter_set_name(gpu),
            "counters": _capacity(_share(gpu, device.fraction)),
        }]
    if gpu.health is not Health.HEALTHY:
        body["taints"] = [{"key": f"{driver}/{UNHEALTHY_TAINT}", "value": "true", "effect": "NoSchedule"}]
    return body


@dataclass(frozen=True)
class PoolContent:
    """The specs of a pool's slices, without the generation, so that a change can be told from a re-publish."""

    specs: tuple[dict[str, Any], ...]


def pool_content(gpus: Mapping[str, Gpu], section: DraSection, node: str) -> PoolContent:
    devices = pool_devices(gpus, section)
    driver = section.driver_name
    bodies = [_device(device, gpus[device.gpu_id], section, driver) for device in devices.values()]
    advanced = section.slicing == "partitions" or any("taints" in body for body in bodies)
    per_slice = MAX_DEVICES_ADVANCED if advanced else MAX_DEVICES
    specs: list[dict[str, Any]] = []
    if section.slicing == "partitions":
        # Counter sets live in slices of their own (required from Kubernetes 1.35, allowed in 1.34).
        counter_sets = [
            {"name": counter_set_name(gpu),
             "counters": _capacity(_share(gpu, Fraction(1)))}
            for gpu in gpus.values()
        ]
        for start in range(0, len(counter_sets), MAX_COUNTER_SETS):
            specs.append({"sharedCounters": counter_sets[start:start + MAX_COUNTER_SETS]})
    for start in range(0, len(bodies), per_slice):
        specs.append({"devices": bodies[start:start + per_slice]})
    if not specs:
        # An empty pool is still published, so that consumers see the node has none.
        specs.append({"devices": []})
    for spec in specs:
        spec.update({"driver": driver, "nodeName": node})
    return PoolContent(tuple(specs))


def slice_name(node: str, driver: str, number: int) -> str:
    return f"{node}-{driver}-{number}"


def resource_slices(
    content: PoolContent, node: str, driver: str, generation: int, owner: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    slices = []
    for number, spec in enumerate(content.specs):
        metadata: dict[str, Any] = {
            "name": slice_name(node, driver, number),
            "labels": {"app.kubernetes.io/managed-by": "gpuppetti"},
        }
        if owner is not None:
            metadata["ownerReferences"] = [dict(owner)]
        slices.append({
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": metadata,
            "spec": {
                **spec,
                "pool": {"name": node, "generation": generation, "resourceSliceCount": len(content.specs)},
            },
        })
    return slices
