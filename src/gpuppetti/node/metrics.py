"""Prometheus metrics, in a registry of their own per process (or per test)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpuppetti.layer.ledger import SliceUse
from gpuppetti.node.inventory import Inventory
from gpuppetti.sharing.limits import gpu_enforced_by

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ClaimCounts(Protocol):
    """What the DRA driver holds: prepared claims, and those whose CDI spec could not be written back."""

    @property
    def prepared(self) -> int: ...

    @property
    def missing_specs(self) -> Mapping[str, str]: ...


# Who holds a slice, and which: SliceRow's labels, as /metrics and /v1/slices name them.
SLICE_LABELS = ["namespace", "pod", "container", "gpu", "unit"]


@dataclass(frozen=True)
class SliceRow:
    """One slice a container holds: who holds it (namespace, pod and container, empty where not known), its GPU and
    the unit(s) or device(s) it is; and what its ledger says of it."""

    namespace: str
    pod: str
    container: str
    gpu: str
    unit: str
    use: SliceUse

    @property
    def labels(self) -> list[str]:
        """The values of SLICE_LABELS, in their order."""
        return [self.namespace, self.pod, self.container, self.gpu, self.unit]


class SliceUses(Protocol):
    """Where the slices held by containers are, and who holds them (the device plugin's Enforcer, the DRA state).
    Called at scrape time, off the event loop: it reads the ledgers as they stand."""

    def slice_uses(self) -> list[SliceRow]: ...


class _SliceCollector(Collector):
    def __init__(self, source: Callable[[], SliceUses | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        used = GaugeMetricFamily("gpuppetti_slice_memory_used_bytes", "GPU memory a container's processes hold in "
                                 "their slice, as the Vulkan layer counts it", labels=SLICE_LABELS)
        budget = GaugeMetricFamily("gpuppetti_slice_memory_budget_bytes", "The memory a container is held to in its "
                                   "slice (0: a whole GPU, not limited)", labels=SLICE_LABELS)
        waited = CounterMetricFamily("gpuppetti_slice_compute_wait_seconds", "How long a slice's submits waited for "
                                     "its share of the GPU's time", labels=SLICE_LABELS)
        source = self._source()
        for row in source.slice_uses() if source is not None else []:
            labels = row.labels
            used.add_metric(labels, row.use.used)
            budget.add_metric(labels, row.use.budget)
            waited.add_metric(labels, row.use.waited_seconds)
        yield from (used, budget, waited)


class _InventoryCollector(Collector):
    """Reads the inventory at scrape time, so that nothing has to remember to update a gauge."""

    def __init__(self, inventory: Callable[[], Inventory | None], claims: Callable[[], ClaimCounts | None],
                 layer: Callable[[], tuple[bool, bool]]) -> None:
        self._inventory = inventory
        self._claims = claims
        self._layer = layer

    def collect(self) -> Iterator[Any]:
        found = self._inventory()
        inventory = found.snapshot if found is not None else None
        gpus = GaugeMetricFamily("gpuppetti_gpus", "GPUs found, by vendor, model and health",
                                 labels=["vendor", "model", "health", "backend"])
        units = GaugeMetricFamily("gpuppetti_units", "Allocatable units advertised, by resource and health",
                                  labels=["resource", "health"])
        utilization = GaugeMetricFamily("gpuppetti_gpu_utilization_percent",
                                        "GPU busy percent, where the backend reports it", labels=["gpu", "model"])
        memory_used = GaugeMetricFamily("gpuppetti_gpu_memory_used_bytes",
                                        "GPU memory in use, where the backend reports it", labels=["gpu", "model"])
        slice_memory = GaugeMetricFamily("gpuppetti_slice_memory_bytes",
                                         "The memory of one slice of a shared GPU: what the Vulkan layer holds a "
                                         "container given that slice to", labels=["resource", "gpu"])
        enforced_by = GaugeMetricFamily("gpuppetti_gpu_enforced_by", "1 for what holds a slice of the GPU to its "
                                        "memory: vulkan-layer, nvml, dmem, a combination, or none",
                                        labels=["gpu", "enforced_by"])
        if inventory is not None:
            installed, hooks = self._layer()
            layer = installed and inventory.config.sharing.enforce_memory
            for gpu in inventory.gpus.values():
                enforced_by.add_metric([gpu.id, gpu_enforced_by(gpu, layer, hooks)], 1)
            counts: dict[tuple[str, str, str, str], int] = {}
            for gpu in inventory.gpus.values():
                key = (gpu.vendor.value, gpu.model, str(gpu.health), gpu.backend)
                counts[key] = counts.get(key, 0) + 1
                if gpu.utilization_percent is not None:
                    utilization.add_metric([gpu.id, gpu.model], gpu.utilization_percent)
                if gpu.memory_used_bytes is not None:
                    memory_used.add_metric([gpu.id, gpu.model], gpu.memory_used_bytes)
            for key, count in counts.items():
                gpus.add_metric(list(key), count)
            for name, plan in inventory.plan.items():
                per_health: dict[str, int] = {"Healthy": 0, "Unhealthy": 0}
                for unit in plan.units:
                    per_health[str(inventory.gpus[unit.gpu_id].health)] += 1
                for gpu_id, gpu_units in plan.by_gpu:
                    first = gpu_units[0]
                    if first.shared and first.size is not None and first.size.memory is not None:
                        slice_memory.add_metric([name, gpu_id], first.size.memory)
                for health, count in per_health.items():
                    units.add_metric([name, health], count)
        yield from (gpus, units, utilization, memory_used, slice_memory, enforced_by)
        claims = self._claims()
        if claims is not None:
            yield GaugeMetricFamily("gpuppetti_dra_prepared_claims", "Claims the DRA driver holds as prepared",
                                    value=claims.prepared)
            yield GaugeMetricFamily(
                "gpuppetti_dra_claims_missing_cdi_spec",
                "Prepared claims whose CDI spec could not be written back (e.g. a full CDI directory)",
                value=len(claims.missing_specs))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._inventory: Inventory | None = None
        self._claims: ClaimCounts | None = None
        self._slices: SliceUses | None = None
        self._layer = (False, True)
        self.registry.register(_InventoryCollector(lambda: self._inventory, lambda: self._claims,
                                                   lambda: self._layer))
        self.registry.register(_SliceCollector(lambda: self._slices))
        self.allocate_requests = Counter(
            "gpuppetti_allocate_requests", "Device plugin Allocate calls", ["resource", "result"],
            registry=self.registry)
        self.allocate_seconds = Histogram(
            "gpuppetti_allocate_duration_seconds", "Device plugin Allocate latency", ["resource"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.allocated_units = Counter(
            "gpuppetti_allocated_units", "Units handed out by Allocate", ["resource"], registry=self.registry)
        self.registrations = Counter(
            "gpuppetti_registrations", "Successful registrations with the kubelet", ["resource"],
            registry=self.registry)
        self.restarts = Counter(
            "gpuppetti_plugin_restarts", "Device plugin servers restarted after their socket was removed",
            ["resource"], registry=self.registry)
        self.prepare_requests = Counter(
            "gpuppetti_dra_prepare_claims", "Claims prepared by the DRA driver", ["result"], registry=self.registry)
        self.prepare_seconds = Histogram(
            "gpuppetti_dra_prepare_duration_seconds", "Latency of NodePrepareResources calls",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.unprepare_requests = Counter(
            "gpuppetti_dra_unprepare_claims", "Claims unprepared by the DRA driver", ["result"],
            registry=self.registry)
        self.unprepare_seconds = Histogram(
            "gpuppetti_dra_unprepare_duration_seconds", "Latency of NodeUnprepareResources calls",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.slice_publishes = Counter(
            "gpuppetti_dra_slice_publishes", "Times the DRA driver wrote its ResourceSlices", registry=self.registry)
        self.slices_enforced = Gauge(
            "gpuppetti_slices_enforced", "1 where containers are held to their slices (the Vulkan layer is "
            "installed), 0 where they are not: /healthz says why", registry=self.registry)

    def enforced(self, layer: bool, hooks: bool = True) -> None:
        """Whether the daemon installed the Vulkan layer: said by itself, and in what holds each GPU's slices
        (``hooks``: whether its front end hands containers hooks; the device plugin does not)."""
        self._layer = (layer, hooks)
        self.slices_enforced.set(int(layer))

    def watch(self, inventory: Inventory) -> None:
        self._inventory = inventory

    def watch_claims(self, claims: ClaimCounts) -> None:
        self._claims = claims

    def watch_slices(self, slices: SliceUses) -> None:
        self._slices = slices
