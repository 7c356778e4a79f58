"""What was found, as a table for people and as JSON for tools (``gpuppetti discover``, the demo)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuppetti.base.quantity import format_bytes
from gpuppetti.core.config import Config
from gpuppetti.core.model import Gpu
from gpuppetti.layer.vulkan import missing_files
from gpuppetti.node.inventory import Snapshot
from gpuppetti.node.metrics import SLICE_LABELS, SliceUses
from gpuppetti.sharing.limits import gpu_enforced_by

if TYPE_CHECKING:
    # The daemons serve records, never tables: rich is loaded by the commands that print.
    from rich.console import Console


def _advertised(snapshot: Snapshot) -> dict[str, tuple[str, int, int | None]]:
    """Per GPU: its resource, its number of units, and a unit's memory where it shares the GPU."""
    per_gpu: dict[str, tuple[str, int, int | None]] = {}
    for name, plan in snapshot.plan.items():
        for unit in plan.units:
            memory = unit.size.memory if unit.shared and unit.size is not None else None
            per_gpu[unit.gpu_id] = (name, unit.replicas, memory)
    return per_gpu


def layer_would_hold(config: Config) -> bool:
    """Whether a daemon of this installation and config holds slices with the Vulkan layer: what the commands
    that run no daemon say (a daemon knows, once it installed the layer)."""
    return config.sharing.enforce_memory and not missing_files()


def gpu_record(gpu: Gpu, resource: str | None, replicas: int | None,
               slice_memory: int | None = None, layer: bool = False, hooks: bool = True) -> dict[str, Any]:
    return {
        "id": gpu.id,
        "index": gpu.index,
        "vendor": gpu.vendor.value,
        "model": gpu.model,
        "cores": gpu.cores,
        "memory_bytes": gpu.memory_bytes,
        # Host paths, as the kubelet and the runtime use them; never prefixed with --host-root.
        "device_nodes": [node.path for node in gpu.device_nodes],
        "numa_node": gpu.numa_node,
        "health": gpu.health.value,
        "backend": gpu.backend,
        "pci_address": gpu.pci_address,
        "uuid": gpu.uuid,
        "driver": gpu.driver,
        "metal_family": gpu.metal_family,
        "utilization_percent": gpu.utilization_percent,
        "memory_used_bytes": gpu.memory_used_bytes,
        "facts": gpu.facts,
        "resource": resource,
        "replicas": replicas,
        # What the Vulkan layer holds a container given one slice to; None for a whole GPU.
        "slice_memory_bytes": slice_memory,
        # What holds a slice of it to its memory: vulkan-layer, nvml, dmem, a combination, or none.
        "enforced_by": gpu_enforced_by(gpu, layer, hooks),
    }


def slice_records(source: SliceUses | None) -> list[dict[str, Any]]:
    """Each slice a container holds, as /v1/slices serves it (and `gpuppetti top` shows it). It reads the
    ledgers as they stand."""
    records = []
    for row in source.slice_uses() if source is not None else []:
        use = row.use
        record: dict[str, Any] = dict(zip(SLICE_LABELS, row.labels, strict=True))
        record.update(budget_bytes=use.budget, used_bytes=use.used, compute_wait_seconds=round(use.waited_seconds, 3))
        records.append(record)
    return records


def gpu_records(snapshot: Snapshot, layer: bool | None = None, hooks: bool = True) -> list[dict[str, Any]]:
    """``layer``: whether the daemon installed the Vulkan layer (None: as this installation and config would);
    ``hooks``: whether its front end hands containers hooks (the device plugin does not)."""
    advertised = _advertised(snapshot)
    holds = layer_would_hold(snapshot.config) if layer is None else layer and snapshot.config.sharing.enforce_memory
    records = []
    for gpu in snapshot.gpus.values():
        resource, replicas, memory = advertised.get(gpu.id, (None, None, None))
        records.append(gpu_record(gpu, resource, replicas, memory, holds, hooks))
    return records


REQUIRED_KEYS = ("id", "vendor", "model", "health")


def records_problem(records: Any) -> str | None:
    """Why a /v1/gpus answer is not a list of GPU records; None when it is."""
    if not isinstance(records, list):
        return f"a JSON {type(records).__name__}, not a list"
    for position, record in enumerate(records):
        if not isinstance(record, dict):
            return f"item {position} is not an object"
        missing = [key for key in REQUIRED_KEYS if not isinstance(record.get(key), str)]
        if missing:
            return f"item {position} has no {', '.join(missing)}"
    return None


def print_gpus(console: Console, records: list[dict[str, Any]], title: str = "GPUs") -> None:
    from gpuppetti.base.tables import Column, Prose, print_table

    # The order of the columns; their ranks say which go first when the width is short.
    columns = [Column("GPU"), Column("model", 9), Column("resource", 8), Column("slices", 6, "right"),
               Column("slice memory", 6, "right"), Column("enforced by", 6), Column("health", 4),
               Column("memory", 5, "right"),
               Column("device nodes", 7),
               Column("cores", 3, "right"), Column("vendor", 2), Column("NUMA", 2, "right"), Column("backend", 1),
               Column("facts", 1)]
    rows = [
        [
            record["id"],
            Prose(record["model"]),
            record["resource"] or "-",
            str(record["replicas"] or "-"),
            format_bytes(record.get("slice_memory_bytes")),
            record.get("enforced_by") or "-",
            record["health"],
            format_bytes(record["memory_bytes"]),
            "\n".join(record["device_nodes"]) or "-",
            str(record["cores"] or "-"),
            record["vendor"],
            "-" if record["numa_node"] is None else str(record["numa_node"]),
            record["backend"],
            record.get("facts") or "-",
        ]
        for record in records
    ]
    print_table(console, title, columns, rows)
