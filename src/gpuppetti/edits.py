"""Container edits: what makes the allocated GPUs, and only them, visible inside a container."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuppetti.model import ContainerEdits, Gpu, Unit


def sharing_mode(units: Sequence[Unit]) -> str:
    return "time-slicing" if any(unit.shared for unit in units) else "none"


def container_edits(units: Sequence[Unit], gpus: Mapping[str, Gpu]) -> ContainerEdits:
    """Edits for one container that was given ``units``.

    Every GPU behind the units is listed once, in the order first requested, so that index-based selectors
    (CUDA_VISIBLE_DEVICES style) are stable.
    """
    gpu_ids: list[str] = []
    for unit in units:
        if unit.gpu_id not in gpu_ids:
            gpu_ids.append(unit.gpu_id)
    replicas = {unit.gpu_id: unit.replicas for unit in units}
    edits = ContainerEdits(
        env={
            "GPUPPETTI_VISIBLE_DEVICES": ",".join(gpu_ids),
            "GPUPPETTI_SLICES": ",".join(unit.id for unit in units),
            "GPUPPETTI_SHARING": sharing_mode(units),
            "GPUPPETTI_REPLICAS": ",".join(str(replicas[gpu_id]) for gpu_id in gpu_ids),
        }
    )
    for gpu_id in gpu_ids:
        gpu = gpus[gpu_id]
        for node in gpu.device_nodes:
            edits.add_device_node(node)
    return edits
