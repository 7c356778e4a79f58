"""``gpuppetti demo``: the plugin with simulated GPUs against the built-in kubelet, in a temporary directory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console, RenderableType
from rich.text import Text

from gpuppetti import cdi
from gpuppetti.config import Config, load_config, parse_config
from gpuppetti.deviceplugin.enforcement import Enforcer
from gpuppetti.deviceplugin.lifecycle import DevicePluginManager
from gpuppetti.discovery import backends_for, discover
from gpuppetti.inventory import Inventory, Snapshot
from gpuppetti.kubelet.emulator import AdmissionError, ContainerAllocation, KubeletEmulator, Pod
from gpuppetti.quantity import format_bytes
from gpuppetti.report import gpu_records, print_gpus
from gpuppetti.runtime import Runtime
from gpuppetti.sandbox import PodmanSandbox, SandboxError, Seen
from gpuppetti.sharing.replicas import plan_remarks
from gpuppetti.tables import Column, Prose, print_table, print_trimmed
from gpuppetti.vulkanlayer import Enforcement, install_layer

DEFAULT_DEMO_CONFIG = """\
version: v1
backend: simulated
simulated:
  gpus:
    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: 2}
sharing:
  timeSlicing:
    resources:
      - name: apple.com/gpu
        replicas: 4
"""


# With real containers: one GPU the size of lavapipe's (a CPU Vulkan device shows at most 2 GiB), four slices of
# 512 MiB that each container is held to through the Vulkan layer.
DEFAULT_SANDBOX_CONFIG = """\
version: v1
backend: simulated
simulated:
  gpus:
    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 2Gi, count: 1}
sharing:
  timeSlicing:
    resources:
      - name: apple.com/gpu
        replicas: 4
"""


def demo_config(path: Path | None, sandbox: bool = False) -> Config:
    if path is None:
        if sandbox:
            return parse_config(DEFAULT_SANDBOX_CONFIG, "<built-in sandbox config>")
        return parse_config(DEFAULT_DEMO_CONFIG, "<built-in demo config>")
    return load_config(path)


def demo_pods(resource: str, capacity: int) -> list[Pod]:
    """Single-slice pods, one pod that asks for two slices, and one pod too many, to show each outcome."""
    short = resource.rsplit("/", 1)[-1].replace(".", "-")
    sizes = [1] * max(capacity - 2, 0) + [2 if capacity >= 2 else 1] + [1]
    return [Pod.simple(f"{short}-pod-{n + 1}", resource, size) for n, size in enumerate(sizes)]


SANDBOX_CDI_DIR = Path("/var/run/cdi")
# Its own CDI kind, so that the sandbox never overwrites the spec of a plugin that really runs on this machine.
SANDBOX_CDI_KIND = "sandbox.gpuppetti.dev/gpu"


class DemoError(Exception):
    """The demo cannot run: why, and whether the input was at fault (exit 2) or the machine (exit 1)."""

    def __init__(self, message: str, bad_input: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input


async def run_demo(
    config_path: Path | None, console: Console, runtime: str | None = None, image: str | None = None
) -> int:
    """The demo; returns the exit code (130 when interrupted). Raises DemoError, before anything starts, when it
    cannot run."""
    config = demo_config(config_path, sandbox=runtime is not None)
    gpus = discover(backends_for(config, "simulated"))
    if not gpus:
        raise DemoError(f"the demo config {config.source} has no simulated GPUs (simulated.gpus)", bad_input=True)
    for remark in plan_remarks(gpus, config.sharing.time_slicing):
        label = "[yellow]warning:[/yellow]" if remark.warning else "note:"
        console.print(f"{label} {config.source}: {remark.path}: {remark.why}", highlight=False)
    sandbox: PodmanSandbox | None = None
    cdi_dir: Path | None = None
    if runtime == "podman":
        sandbox = PodmanSandbox(image)
        if (why := await sandbox.why_not()) is not None:
            raise DemoError(f"cannot run the sandbox: {why}")
        # Debian's podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi.
        cdi_dir = SANDBOX_CDI_DIR
        if not _writable(cdi_dir):
            raise DemoError(f"cannot run the sandbox: {cdi_dir} is not writable (run as root)")
        section = config.plugin.model_copy(update={"device_list_strategy": ["envvar", "cdi-cri"]})
        config = config.model_copy(update={"plugin": section})
        try:
            await sandbox.ensure_image()
        except SandboxError as exc:
            raise DemoError(str(exc), bad_input=image is not None) from None
    inventory = Inventory(config, gpus)
    workdir = Path(tempfile.mkdtemp(prefix="gpuppetti-demo-"))
    process = Runtime()

    async def start(process: Runtime) -> None:
        kubelet = KubeletEmulator(workdir)
        await kubelet.start()
        process.spawn("kubelet-emulator", _until_stopped(kubelet))
        # The Vulkan layer, installed in the demo's own directory: what each container gets mounted from.
        enforcer = None
        enforcement = await install_layer(workdir / "vulkan")
        if (layer := enforcement.layer) is not None:
            enforcer = Enforcer(layer, workdir / "no-pod-resources.sock")
            await enforcer.start(set())
        manager = DevicePluginManager(inventory, workdir, cdi_dir=cdi_dir, cdi_kind=SANDBOX_CDI_KIND,
                                      enforcer=enforcer)
        await manager.run(process)
        process.spawn("demo", _script(process, inventory, kubelet, console, workdir, sandbox, enforcement))

    try:
        await process.run(start)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(workdir)
        if cdi_dir is not None:
            cdi.remove_spec(cdi_dir, cdi.spec_filename(SANDBOX_CDI_KIND))
    return 0 if process.stop_reason == DONE else 130


DONE = "the demo is done"


async def _until_stopped(kubelet: KubeletEmulator) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        await kubelet.stop()


async def _script(process: Runtime, inventory: Inventory, kubelet: KubeletEmulator, console: Console,
                  workdir: Path, sandbox: PodmanSandbox | None, enforcement: Enforcement) -> None:
    snapshot = inventory.snapshot
    for resource in snapshot.plan:
        await kubelet.wait_registered(resource)
    print_trimmed(console, Text.assemble(("gpuppetti demo", "bold"), ": the device plugin registered with the "
                                         f"built-in kubelet\n  sockets in {workdir}\n  config: "
                                         f"{snapshot.config.source}\n"))
    print_gpus(console, gpu_records(snapshot))
    console.print(Text(enforcement.summary() + "\n", style="green" if enforcement.enforced else "yellow"))

    outcomes: list[tuple[Pod, list[ContainerAllocation] | str]] = []
    for resource, plan in snapshot.plan.items():
        for pod in demo_pods(resource, len(plan.units)):
            try:
                outcomes.append((pod, await kubelet.admit(pod)))
            except AdmissionError as exc:
                outcomes.append((pod, str(exc)))
    _print_slices(console, snapshot, kubelet)
    _print_pods(console, outcomes)
    if sandbox is not None:
        await _run_containers(console, sandbox, outcomes)

    before = {r: kubelet.registrations(r) for r in snapshot.plan}
    started = time.monotonic()
    await kubelet.restart()
    for resource in snapshot.plan:
        await kubelet.wait_registered(resource, count=before[resource] + 1)
    elapsed_ms = (time.monotonic() - started) * 1000
    print_trimmed(console, Text(
        f"kubelet restarted (every socket deleted): the plugin noticed through inotify and re-registered in "
        f"{elapsed_ms:,.0f} ms; allocatable again: "
        + ", ".join(f"{r} = {kubelet.allocatable(r)}" for r in snapshot.plan)))
    process.request_stop(DONE)


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


async def _run_containers(
    console: Console, sandbox: PodmanSandbox, outcomes: list[tuple[Pod, list[ContainerAllocation] | str]]
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
                rows.append([pod.name, "", Text(str(exc), style="red"), ""])
                continue
            devices = [f for f in seen.flags if "=" in f and not f.startswith("GPUPPETTI")]
            slice_memory, heap, obtained = _vulkan_view(seen)
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


def _vulkan_view(seen: Seen) -> tuple[str, str, str]:
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


def _print_slices(console: Console, inventory: Snapshot, kubelet: KubeletEmulator) -> None:
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


def _print_pods(console: Console, outcomes: list[tuple[Pod, list[ContainerAllocation] | str]]) -> None:
    rows: list[list[RenderableType]] = []
    # With one resource, its name in every row would only make the table wider.
    resources = {r for pod, _ in outcomes for c in pod.containers for r in c.requests}
    for pod, outcome in outcomes:
        request = ", ".join(str(n) if len(resources) == 1 else f"{r}: {n}"
                            for c in pod.containers for r, n in c.requests.items())
        if isinstance(outcome, str):
            why = Prose.assemble(("not admitted: ", "red"), outcome.split(": ", 1)[-1])
            rows.append([pod.name, request, why])
            continue
        for allocation in outcome:
            env = "\n".join(f"{k}={v}" for k, v in sorted(allocation.response.envs.items()))
            rows.append([pod.name, request, env])
    one = len(resources) == 1
    columns = [Column("pod"), Column("slices" if one else "asks for", 5, "right"),
               Column("env in the container, or why not")]
    print_table(console, f"Pods, asking for {next(iter(resources))}" if one else "Pods", columns, rows)
