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

from rich.console import Console
from rich.table import Table

from gpuppetti import cdi
from gpuppetti.config import Config, load_config, parse_config
from gpuppetti.deviceplugin.lifecycle import DevicePluginManager
from gpuppetti.discovery import backends_for, discover
from gpuppetti.inventory import Inventory, Snapshot
from gpuppetti.kubelet.emulator import AdmissionError, ContainerAllocation, KubeletEmulator, Pod
from gpuppetti.report import gpu_table
from gpuppetti.runtime import Runtime
from gpuppetti.sandbox import PodmanSandbox, SandboxError

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


def demo_config(path: Path | None) -> Config:
    if path is None:
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


async def run_demo(
    config_path: Path | None, console: Console, runtime: str | None = None, image: str | None = None
) -> int:
    """The demo; returns the exit code (130 when interrupted)."""
    config = demo_config(config_path)
    gpus = discover(backends_for(config, "simulated"))
    if not gpus:
        console.print(f"[red]the demo config {config.source} has no simulated GPUs[/red]")
        return 2
    sandbox: PodmanSandbox | None = None
    cdi_dir: Path | None = None
    if runtime == "podman":
        sandbox = PodmanSandbox(image)
        if (why := await sandbox.why_not()) is not None:
            console.print(f"[red]cannot run the sandbox: {why}[/red]")
            return 1
        # Debian's podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi.
        cdi_dir = SANDBOX_CDI_DIR
        if not _writable(cdi_dir):
            console.print(f"[red]cannot run the sandbox: {cdi_dir} is not writable (run as root)[/red]")
            return 1
        section = config.plugin.model_copy(update={"device_list_strategy": ["envvar", "cdi-cri"]})
        config = config.model_copy(update={"plugin": section})
        await sandbox.ensure_image()
    inventory = Inventory(config, gpus)
    workdir = Path(tempfile.mkdtemp(prefix="gpuppetti-demo-"))
    process = Runtime()

    async def start(process: Runtime) -> None:
        kubelet = KubeletEmulator(workdir)
        await kubelet.start()
        process.spawn("kubelet-emulator", _until_stopped(kubelet))
        manager = DevicePluginManager(inventory, workdir, cdi_dir=cdi_dir, cdi_kind=SANDBOX_CDI_KIND)
        await manager.run(process)
        process.spawn("demo", _script(process, inventory, kubelet, console, workdir, sandbox))

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
                  workdir: Path, sandbox: PodmanSandbox | None) -> None:
    snapshot = inventory.snapshot
    for resource in snapshot.plan:
        await kubelet.wait_registered(resource)
    console.print(f"[bold]gpuppetti demo[/bold]: device plugin registered with the built-in kubelet "
                  f"in {workdir} ({snapshot.config.source})\n")
    console.print(gpu_table(snapshot))

    outcomes: list[tuple[Pod, list[ContainerAllocation] | str]] = []
    for resource, plan in snapshot.plan.items():
        for pod in demo_pods(resource, len(plan.units)):
            try:
                outcomes.append((pod, await kubelet.admit(pod)))
            except AdmissionError as exc:
                outcomes.append((pod, str(exc)))
    console.print(_slice_table(snapshot, kubelet))
    console.print(_pod_table(outcomes))
    if sandbox is not None:
        console.print(await _run_containers(sandbox, outcomes))

    before = {r: kubelet.registrations(r) for r in snapshot.plan}
    started = time.monotonic()
    await kubelet.restart()
    for resource in snapshot.plan:
        await kubelet.wait_registered(resource, count=before[resource] + 1)
    elapsed_ms = (time.monotonic() - started) * 1000
    console.print(f"kubelet restarted (every socket deleted): the plugin noticed through inotify and "
                  f"re-registered in {elapsed_ms:.0f} ms; allocatable again: "
                  + ", ".join(f"{r} = {kubelet.allocatable(r)}" for r in snapshot.plan))
    process.request_stop(DONE)


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


async def _run_containers(
    sandbox: PodmanSandbox, outcomes: list[tuple[Pod, list[ContainerAllocation] | str]]
) -> Table:
    table = Table(title=f"Containers run by podman ({sandbox.image}): what each one saw", title_justify="left")
    for column in ("pod", "podman flags from Allocate", "GPUPPETTI_* env inside", "/dev inside"):
        table.add_column(column)
    for pod, outcome in outcomes:
        if isinstance(outcome, str):
            continue
        for allocation in outcome:
            name = f"gpuppetti-{pod.name}-{secrets.token_hex(3)}"
            try:
                seen = await sandbox.run(name, allocation.response)
            except SandboxError as exc:
                table.add_row(pod.name, "", f"[red]{exc}[/red]", "")
                continue
            devices = [f for f in seen.flags if "=" in f and not f.startswith("GPUPPETTI")]
            table.add_row(
                pod.name,
                "\n".join(f"--device {d}" for d in devices if "/" in d.split("=", 1)[0]),
                "\n".join(f"{k}={v}" for k, v in sorted(seen.env.items())),
                " ".join(seen.dev),
            )
    return table


def _slice_table(inventory: Snapshot, kubelet: KubeletEmulator) -> Table:
    table = Table(title="Slices, as the kubelet sees them", title_justify="left")
    for column in ("slice", "GPU", "resource", "health", "pod"):
        table.add_column(column)
    for name, plan in inventory.plan.items():
        endpoint = kubelet.endpoints.get(name)
        for unit in plan.units:
            health = endpoint.devices.get(unit.id, "?") if endpoint else "?"
            table.add_row(unit.id, unit.gpu_id, name, health, kubelet.pod_of(name, unit.id) or "[dim]free[/dim]")
    return table


def _pod_table(outcomes: list[tuple[Pod, list[ContainerAllocation] | str]]) -> Table:
    table = Table(title="Pods", title_justify="left")
    for column in ("pod", "request", "result", "env in the container"):
        table.add_column(column)
    for pod, outcome in outcomes:
        request = ", ".join(f"{r}: {n}" for c in pod.containers for r, n in c.requests.items())
        if isinstance(outcome, str):
            table.add_row(pod.name, request, "[red]not admitted[/red]", outcome.split(": ", 1)[-1])
            continue
        for allocation in outcome:
            env = "\n".join(f"{k}={v}" for k, v in sorted(allocation.response.envs.items()))
            table.add_row(pod.name, request, "[green]admitted[/green]", env)
    return table
