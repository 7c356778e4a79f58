"""What holds a slice to its memory, and the edits that ask the driver or the kernel to.

The Vulkan layer is ours and holds Vulkan on every vendor, cooperatively. Where the node has them, two limits the
driver or the kernel enforce hold every API: NVIDIA's driver (the container toolkit's ``apply-cuda-memory-limits``
hook reads ``NVIDIA_GPU_MEMORY_LIMIT``, in whole MiB, and calls NVML's SetMemoryLimits for the container), and the
kernel's dmem cgroup controller (our hook writes the container's ``dmem.max``). Discovery says which a GPU has
(``Gpu.limits``); these functions say what a slice gets.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from gpuppetti.core.model import ContainerEdits, Gpu, Hook, Mechanism, Vendor, enforced_by
from gpuppetti.sharing.budgets import Budget

ENFORCED_BY_ENV = "GPUPPETTI_ENFORCED_BY"
NVIDIA_LIMIT_ENV = "NVIDIA_GPU_MEMORY_LIMIT"
NVIDIA_HOOK_COMMAND = "apply-cuda-memory-limits"
# The program the daemon installs beside the Vulkan layer (layer/dmem_hook.py), and what it reads.
DMEM_HOOK = "gpuppetti-dmem-hook"
DMEM_ENV = "GPUPPETTI_DMEM_MAX"
# Where the hook finds the cgroup tree: a daemon started with it set passes it on (a stand-in tree, for tests).
DMEM_ROOT_ENV = "GPUPPETTI_DMEM_CGROUP_ROOT"
HOOK_TIMEOUT_S = 10
MIB = 2**20


def gpu_mechanisms(gpu: Gpu, layer: bool, hooks: bool = True) -> list[Mechanism]:
    """What can hold a slice of ``gpu`` on this node: the layer where the daemon installed it, NVIDIA's driver
    where it and the toolkit can, dmem where the kernel has a region for it, the layer's directory (which holds
    the hook) is there, and the front end can hand a container a hook (``hooks``: the DRA driver's CDI spec can,
    the device plugin's Allocate answer cannot)."""
    found = [Mechanism.VULKAN_LAYER] if layer else []
    if gpu.limit(Mechanism.NVML) is not None and gpu.vendor is Vendor.NVIDIA:
        found.append(Mechanism.NVML)
    if layer and hooks and gpu.limit(Mechanism.DMEM) is not None:
        found.append(Mechanism.DMEM)
    return found


def gpu_enforced_by(gpu: Gpu, layer: bool, hooks: bool = True) -> str:
    return enforced_by(gpu_mechanisms(gpu, layer, hooks))


def _nvidia_limit(budgets: Sequence[Budget]) -> int | None:
    """The one limit NVIDIA's driver can hold the container to: the toolkit applies one value to every GPU of a
    container, so only where each of its NVIDIA GPUs is a slice of the same memory (never a whole GPU held to a
    slice's size)."""
    nvidia = [budget for budget in budgets if budget.gpu.vendor is Vendor.NVIDIA]
    if not nvidia or any(budget.gpu.limit(Mechanism.NVML) is None for budget in nvidia):
        return None
    sizes = {budget.memory for budget in nvidia}
    if len(sizes) != 1 or 0 in sizes:
        return None
    return sizes.pop()


def limit_edits(budgets: Sequence[Budget], layer_dir: str | None, cgroup_root: str | None = None,
                hooks: bool = True) -> ContainerEdits:
    """The env and hooks that put a container's slices under the driver's and the kernel's limits, and
    ``GPUPPETTI_ENFORCED_BY``: what holds each slice, in the order of the budgets (a whole GPU: ``none``).
    ``layer_dir``: the Vulkan layer's directory where the daemon installed it (and the dmem hook with it);
    ``hooks``: whether the front end can hand the container a hook (the device plugin cannot: there NVIDIA's limit
    relies on the toolkit's own hook, which the NVIDIA runtime adds, and dmem is not used)."""
    edits = ContainerEdits()
    held: list[list[Mechanism]] = [[] for _ in budgets]
    nvidia = _nvidia_limit(budgets)
    if nvidia is not None:
        first = next(b for b in budgets if b.gpu.vendor is Vendor.NVIDIA)
        hook = first.gpu.limit(Mechanism.NVML)
        assert hook is not None and hook.hook is not None
        # Whole MiB, rounded down: the driver never gives a slice more than it is.
        edits.env[NVIDIA_LIMIT_ENV] = str(max(1, nvidia // MIB))
        edits.add_hook(Hook("createContainer", hook.hook, ("nvidia-cdi-hook", NVIDIA_HOOK_COMMAND),
                            timeout=HOOK_TIMEOUT_S))
    regions: list[str] = []
    for position, budget in enumerate(budgets):
        if budget.memory <= 0:
            continue
        if layer_dir is not None:
            held[position].append(Mechanism.VULKAN_LAYER)
        if nvidia is not None and budget.gpu.vendor is Vendor.NVIDIA:
            held[position].append(Mechanism.NVML)
        dmem = budget.gpu.limit(Mechanism.DMEM)
        if layer_dir is not None and hooks and dmem is not None and dmem.region:
            regions.append(f"{dmem.region}={budget.memory}")
            held[position].append(Mechanism.DMEM)
    if regions and layer_dir is not None:
        edits.env[DMEM_ENV] = ",".join(regions)
        # createRuntime: run in the runtime's namespaces once the container's cgroup holds its process.
        env = (f"{DMEM_ROOT_ENV}={cgroup_root}",) if cgroup_root else ()
        edits.add_hook(Hook("createRuntime", f"{layer_dir}/{DMEM_HOOK}", (DMEM_HOOK, *regions), env=env,
                            timeout=HOOK_TIMEOUT_S))
    if budgets:
        edits.env[ENFORCED_BY_ENV] = ",".join(enforced_by(mechanisms) for mechanisms in held)
    return edits


def with_limits(edits: ContainerEdits | None, budgets: Sequence[Budget], layer_dir: Path | None,
                hooks: bool = True) -> ContainerEdits:
    """``edits`` (the layer's, where it holds the container) with the driver's and the kernel's limits added. A
    daemon started with GPUPPETTI_DMEM_CGROUP_ROOT hands it to the dmem hook."""
    merged = edits if edits is not None else ContainerEdits()
    merged.merge(limit_edits(budgets, str(layer_dir) if layer_dir is not None else None,
                             os.environ.get(DMEM_ROOT_ENV) or None, hooks))
    return merged
