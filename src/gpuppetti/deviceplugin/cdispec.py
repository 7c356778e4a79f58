"""The device plugin's CDI spec: one CDI device per GPU, carrying its device nodes.

What depends on the allocation (the GPUPPETTI_* env, and vendor selectors that list every GPU of a container)
stays in the Allocate response: per-GPU CDI devices that each set NVIDIA_VISIBLE_DEVICES would overwrite one
another in a container that gets two GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from gpuppetti.core import cdi
from gpuppetti.core.model import ContainerEdits, Gpu

KIND = cdi.DEFAULT_KIND


def device_name(gpu: Gpu) -> str:
    return re.sub(r"[^A-Za-z0-9_.:-]", "-", gpu.id)


def _env_key(gpu: Gpu) -> str:
    return "GPUPPETTI_CDI_" + re.sub(r"[^A-Za-z0-9]", "_", gpu.id).upper()


def gpu_edits(gpu: Gpu) -> ContainerEdits:
    # Every CDI device needs at least one edit; the marker also shows, inside a container, that CDI applied it.
    edits = ContainerEdits(env={_env_key(gpu): gpu.id})
    for node in gpu.device_nodes:
        edits.add_device_node(node)
    return edits


def plugin_spec(gpus: Iterable[Gpu], kind: str = KIND) -> dict[str, Any]:
    return cdi.build_spec(kind, [(device_name(gpu), gpu_edits(gpu)) for gpu in gpus])



def annotation_key(resource: str, unit_ids: Iterable[str]) -> str:
    """``cdi.k8s.io/<plugin>_<device>``, at most 63 characters after the prefix, as CDI's convention has it."""
    name = f"gpuppetti_{resource.replace('/', '_')}_{'_'.join(unit_ids)}"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:63].strip("_.-")
    return f"cdi.k8s.io/{name}"
