"""What was found, as a table for people and as JSON for tools (``gpuppetti discover``, the demo)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuppetti.inventory import Snapshot
from gpuppetti.model import Gpu
from gpuppetti.quantity import format_bytes

if TYPE_CHECKING:
    # The daemons serve records, never tables: rich is loaded by the commands that print.
    from rich.table import Table


def _advertised(inventory: Snapshot) -> dict[str, tuple[str, int]]:
    per_gpu: dict[str, tuple[str, int]] = {}
    for name, plan in inventory.plan.items():
        for unit in plan.units:
            per_gpu[unit.gpu_id] = (name, unit.replicas)
    return per_gpu


def gpu_record(gpu: Gpu, resource: str | None, replicas: int | None) -> dict[str, Any]:
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
    }


def gpu_records(inventory: Snapshot) -> list[dict[str, Any]]:
    advertised = _advertised(inventory)
    records = []
    for gpu in inventory.gpus.values():
        resource, replicas = advertised.get(gpu.id, (None, None))
        records.append(gpu_record(gpu, resource, replicas))
    return records


def gpu_table(inventory: Snapshot, title: str = "GPUs") -> Table:
    return records_table(gpu_records(inventory), title)


def records_table(records: list[dict[str, Any]], title: str = "GPUs") -> Table:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("GPU", "vendor", "model", "cores", "memory", "device nodes", "NUMA", "health", "backend",
                   "facts", "resource", "slices"):
        table.add_column(column)
    for record in records:
        table.add_row(
            record["id"],
            record["vendor"],
            record["model"],
            str(record["cores"] or "-"),
            format_bytes(record["memory_bytes"]),
            "\n".join(record["device_nodes"]) or "-",
            "-" if record["numa_node"] is None else str(record["numa_node"]),
            record["health"],
            record["backend"],
            record.get("facts") or "-",
            record["resource"] or "-",
            str(record["replicas"] or "-"),
        )
    return table
