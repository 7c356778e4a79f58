"""What the demo prints: the slices as the kubelet sees them, the pods and what each was given, and what each
container run by podman saw."""

from __future__ import annotations

import secrets

from rich.console import Console, RenderableType
from rich.text import Text

from gpuppetti.base.quantity import format_bytes
from gpuppetti.base.tables import Column, Prose, print_table
from gpuppetti.kubelet.emulator import ContainerAllocation, KubeletEmulator, Pod
from gpuppetti.kubelet.sandbox import PodmanSandbox, SandboxError, Seen
from gpuppetti.node.inventory import Snapshot

# Each pod the demo asked for, and what the kubelet gave it: its containers' allocations, or why it was not admitted.
Outcomes = list[tuple[Pod, list[ContainerAllocation] | str]]


async def run_containers(
    console: Console, sandbox: PodmanSandbox, outcomes: Outcomes
) -> None:
    rows: list[list[RenderableType]] = []
    for pod, outcome in outcomes:
        if isinstance(outcome, str):
            continue
        for allocation in outcome:
            name = f"gpuppetti-{pod.name}-{secrets.token_hex(3)}"
            try:
                seen = await sandbox.run(name, allocation.response)
            except SandboxError as exc:
                # Its row says why, in the widest column; the others stay empty.
                rows.append([pod.name, "", "", "", Text(str(exc), style="red"), "", ""])
                continue
            devices = [f for f in seen.flags if "=" in f and not f.startswith("GPUPPETTI")]
            slice_memory, heap, obtained = vulkan_view(seen)
            rows.append([
                pod.name,
                slice_memory,
                heap,
                obtained,
                "\n".join(f"--device {d}" for d in devices if "/" in d.split("=", 1)[0]),
                "\n".join(f"{k}={v}" for k, v in sorted(seen.env.items())),
                " ".join(seen.dev),
            ])
    columns = [Column("pod"), Column("slice", 8, "right"), Column("heap seen", 8, "right"),
               Column("obtained", 8, "right"), Column("podman flags from Allocate", 2),
               Column("GPUPPETTI_* env inside", 5), Column("/dev inside", 3)]
    print_table(console, f"Containers run by podman ({sandbox.image}): what each one saw", columns, rows)


def vulkan_view(seen: Seen) -> tuple[str, str, str]:
    """The slice's memory, the heap the container's Vulkan device showed, and what it obtained before refusal."""
    budget = seen.env.get("GPUPPETTI_VK_SLICES", "")
    memory = sum(int(entry.rpartition("=")[2]) for entry in budget.split(",") if entry.rpartition("=")[2].isdigit())
    slice_memory = format_bytes(memory) if memory else "-"
    report = seen.vulkan
    if report is None:
        return slice_memory, "no Vulkan", "-"
    devices = report.get("devices") or []
    if not devices:
        return slice_memory, report.get("error", "no device"), "-"
    heaps = devices[0].get("heaps") or [{}]
    allocation = report.get("allocation") or {}
    return slice_memory, format_bytes(heaps[0].get("size")), format_bytes(allocation.get("obtained"))


def print_slices(console: Console, inventory: Snapshot, kubelet: KubeletEmulator) -> None:
    rows: list[list[RenderableType]] = []
    for name, plan in inventory.plan.items():
        endpoint = kubelet.endpoints.get(name)
        for unit in plan.units:
            health = endpoint.devices.get(unit.id, "?") if endpoint else "?"
            pod = kubelet.pod_of(name, unit.id)
            memory = format_bytes(unit.size.memory) if unit.size and unit.shared else "whole"
            rows.append([unit.id, memory, unit.gpu_id, name, health, pod or Text("free", style="dim")])
    columns = [Column("slice"), Column("memory", 6, "right"), Column("GPU", 3), Column("resource", 4),
               Column("health", 5), Column("pod")]
    print_table(console, "Slices, as the kubelet sees them", columns, rows)


def print_pods(console: Console, outcomes: Outcomes) -> None:
    rows: list[list[RenderableType]] = []
    # With one resource, its name in every row would only make the table wider.
    resources = {r for pod, _ in outcomes for c in pod.containers for r in c.requests}
    devices = False
    for pod, outcome in outcomes:
        request = ", ".join(str(n) if len(resources) == 1 else f"{r}: {n}"
                            for c in pod.containers for r, n in c.requests.items())
        if isinstance(outcome, str):
            why = Prose.assemble(("not admitted: ", "red"), outcome.split(": ", 1)[-1])
            rows.append([pod.name, request, why])
            continue
        for allocation in outcome:
            # A real GPU's device nodes, which the runtime creates in the container (a simulated GPU has none).
            lines = [f"device {spec.container_path}" for spec in allocation.response.devices]
            devices = devices or bool(lines)
            lines += [f"{k}={v}" for k, v in sorted(allocation.response.envs.items())]
            rows.append([pod.name, request, "\n".join(lines)])
    one = len(resources) == 1
    columns = [Column("pod"), Column("slices" if one else "asks for", 5, "right"),
               Column("device nodes and env in the container, or why not" if devices else
                      "env in the container, or why not")]
    print_table(console, f"Pods, asking for {next(iter(resources))}" if one else "Pods", columns, rows)

