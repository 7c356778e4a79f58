"""``gpuppetti demo``: the plugin against the built-in kubelet, in a temporary directory, on the GPUs the config's
backend finds: simulated ones by default, or the node's own (``backend: drm``, ``auto``, ...).

With ``--runtime podman`` each admitted pod also runs as a real container. On simulated GPUs its image holds Mesa's
lavapipe (the sandbox's own); on a node's real GPUs, it is built here from the node's files (image.py). What it
prints is tables.py's.

With ``--keep-running`` it stays up once its pods are admitted, serving the daemons' HTTP endpoint (/metrics,
/v1/gpus, /v1/slices) until Ctrl-C, so that ``gpuppetti top`` shows the slices its pods hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.text import Text

from gpuppetti.base.nodepaths import DEFAULT_HTTP_ADDRESS
from gpuppetti.base.runtime import Runtime
from gpuppetti.base.tables import print_trimmed
from gpuppetti.commands.demo.image import node_image
from gpuppetti.commands.demo.tables import Outcomes, print_pods, print_slices, run_containers
from gpuppetti.core import cdi
from gpuppetti.core.config import Config, load_config, parse_config
from gpuppetti.core.model import Gpu
from gpuppetti.deviceplugin.enforcement import Enforcer
from gpuppetti.deviceplugin.lifecycle import DevicePluginManager
from gpuppetti.discovery import BackendUnavailable, backends_for, discover, looked_at
from gpuppetti.kubelet.emulator import AdmissionError, KubeletEmulator, Pod
from gpuppetti.kubelet.sandbox import PodmanSandbox, SandboxError
from gpuppetti.layer.vulkan import Enforcement, install_layer
from gpuppetti.node.httpserver import AddressError, HttpServer
from gpuppetti.node.inventory import Inventory
from gpuppetti.node.metrics import Metrics
from gpuppetti.node.report import gpu_records, print_gpus, slice_records
from gpuppetti.sharing.remarks import config_remarks

# The built-in configs, as data beside this module: configs/demo.yaml, and configs/sandbox.yaml for real containers.
CONFIGS = resources.files(__package__) / "configs"


def demo_config(path: Path | None, sandbox: bool = False) -> Config:
    if path is None:
        name = "sandbox" if sandbox else "demo"
        return parse_config((CONFIGS / f"{name}.yaml").read_text(encoding="utf-8"), f"<built-in {name} config>")
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


def demo_gpus(config: Config, backend: str | None = None, host_root: Path = Path("/")) -> list[Gpu]:
    """The GPUs the demo slices: what the config's backend (or ``backend``) finds under ``host_root``, as the
    plugin would find them, and the config's simulated ones. Blocks: run it in a thread. Raises DemoError."""
    skipped: list[str] = []
    try:
        backends = backends_for(config, backend, host_root, skipped)
    except BackendUnavailable as exc:
        raise DemoError(f"the demo config {config.source}: {exc}") from None
    gpus = discover(backends)
    if not gpus:
        chosen = backend or config.backend
        searched = "; ".join(item for item in [*skipped, *looked_at(backends)] if not item.startswith("simulated"))
        found_none = f", and backend {chosen} found none here ({searched})" if chosen != "simulated" else ""
        raise DemoError(f"the demo config {config.source} has no simulated GPUs (simulated.gpus){found_none}",
                        bad_input=True)
    return gpus


async def run_demo(
    config_path: Path | None, console: Console, runtime: str | None = None, image: str | None = None,
    host_root: Path = Path("/"), backend: str | None = None, serve_at: str | None = None,
) -> int:
    """The demo; returns the exit code (130 when interrupted before its pods are admitted). With ``serve_at`` (an
    --http-address) it keeps running once they are, serving there, until stopped. Raises DemoError, before
    anything starts, when it cannot run."""
    config = demo_config(config_path, sandbox=runtime is not None)
    gpus = await asyncio.to_thread(demo_gpus, config, backend, host_root)
    for remark in config_remarks(gpus, config):
        label = "[yellow]warning:[/yellow]" if remark.warning else "note:"
        console.print(f"{label} {config.source}: {remark.path}: {remark.why}", highlight=False)
    sandbox: PodmanSandbox | None = None
    cdi_dir: Path | None = None
    if runtime == "podman":
        sandbox, config = await _sandbox(config, gpus, image)
        # Debian's podman 4.3 reads CDI specs only from /etc/cdi and /var/run/cdi.
        cdi_dir = SANDBOX_CDI_DIR
    inventory = Inventory(config, gpus)
    metrics = Metrics()
    http = HttpServer(metrics)
    serving = None if serve_at is None else await _serve(http, serve_at)
    workdir = Path(tempfile.mkdtemp(prefix="gpuppetti-demo-"))
    process = Runtime()
    admitted = asyncio.Event()

    async def start(process: Runtime) -> None:
        if serving is not None:
            process.spawn("http", http.serve())
        # The kubelet's PodResources API, as on a node: the plugin learns from it who holds each slice.
        pod_resources = workdir / "pod-resources" / "kubelet.sock"
        kubelet = KubeletEmulator(workdir, pod_resources=pod_resources if serving is not None else None)
        await kubelet.start()
        process.spawn("kubelet-emulator", _until_stopped(kubelet))
        # The Vulkan layer, installed in the demo's own directory: what each container gets mounted from.
        enforcer = None
        enforcement = await install_layer(workdir / "vulkan")
        metrics.slices_enforced.set(int(enforcement.enforced))
        if (layer := enforcement.layer) is not None and (ledgers := enforcement.ledgers) is not None:
            process.spawn("ledgers", ledgers.keep())
            enforcer = Enforcer(layer, ledgers, pod_resources)
            await enforcer.start(set())
            metrics.watch_slices(enforcer)
            if serving is not None:
                process.spawn("ledger-owners", enforcer.keep_in_use())
        manager = DevicePluginManager(inventory, workdir, metrics, cdi_dir, cdi_kind=SANDBOX_CDI_KIND,
                                      enforcer=enforcer)
        metrics.watch(inventory)
        http.readiness = manager.waiting_for
        http.records = lambda: gpu_records(inventory.snapshot)
        http.slices = lambda: slice_records(enforcer)
        await manager.run(process)
        process.spawn("demo", _script(process, inventory, kubelet, console, workdir, sandbox, enforcement, serving,
                                      http.address, admitted))

    try:
        await process.run(start)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(workdir)
        if cdi_dir is not None:
            cdi.remove_spec(cdi_dir, cdi.spec_filename(SANDBOX_CDI_KIND))
    # Kept running, the demo ends by Ctrl-C (or SIGTERM) once it has shown what it does: that is its end.
    return 0 if process.stop_reason == DONE or (serving is not None and admitted.is_set()) else 130


async def _sandbox(config: Config, gpus: list[Gpu], image: str | None) -> tuple[PodmanSandbox, Config]:
    """The sandbox that runs each admitted pod as a container, its image ready, and the config that hands those
    containers their devices through CDI. Raises DemoError."""
    sandbox = PodmanSandbox(image)
    if (why := await sandbox.why_not()) is not None:
        raise DemoError(f"cannot run the sandbox: {why}")
    if not _writable(SANDBOX_CDI_DIR):
        raise DemoError(f"cannot run the sandbox: {SANDBOX_CDI_DIR} is not writable (run as root)")
    section = config.plugin.model_copy(update={"device_list_strategy": ["envvar", "cdi-cri"]})
    config = config.model_copy(update={"plugin": section})
    try:
        if image is None and any(not gpu.simulated for gpu in gpus):
            # The node's own GPUs: an image with their Vulkan drivers, built from this machine's files.
            sandbox = PodmanSandbox(await node_image(gpus))
        await sandbox.ensure_image()
    except SandboxError as exc:
        raise DemoError(str(exc), bad_input=image is not None) from None
    return sandbox, config


async def _serve(http: HttpServer, address: str) -> str:
    """Listen at ``address`` before anything starts, so that an address in use (a daemon runs here) is said at once;
    what ``gpuppetti top`` needs to be told to reach it. Raises DemoError."""
    try:
        await http.start(address)
    except AddressError as exc:
        raise DemoError(f"--http-address: {exc}: a daemon may serve there already; give the demo another "
                        "address") from None
    # Nothing at the daemons' default address.
    return "gpuppetti top" if http.address == DEFAULT_HTTP_ADDRESS else f"gpuppetti top --from http://{http.address}"


DONE = "the demo is done"


async def _until_stopped(kubelet: KubeletEmulator) -> None:
    try:
        await asyncio.Event().wait()
    finally:
        await kubelet.stop()


async def _script(process: Runtime, inventory: Inventory, kubelet: KubeletEmulator, console: Console,
                  workdir: Path, sandbox: PodmanSandbox | None, enforcement: Enforcement, serving: str | None,
                  address: str, admitted: asyncio.Event) -> None:
    snapshot = inventory.snapshot
    for resource in snapshot.plan:
        await kubelet.wait_registered(resource)
    print_trimmed(console, Text.assemble(("gpuppetti demo", "bold"), ": the device plugin registered with the "
                                         f"built-in kubelet\n  sockets in {workdir}\n  config: "
                                         f"{snapshot.config.source}\n"))
    print_gpus(console, gpu_records(snapshot))
    # Without the sandbox no container runs: say what a container would be held to, not that one is.
    summary = enforcement.summary() if sandbox is not None or not enforcement.enforced else (
        "slices are enforced by the Vulkan layer, in containers (--runtime podman)")
    console.print(Text(summary + "\n", style="green" if enforcement.enforced else "yellow"))

    outcomes: Outcomes = []
    for resource, plan in snapshot.plan.items():
        for pod in demo_pods(resource, len(plan.units)):
            try:
                outcomes.append((pod, await kubelet.admit(pod)))
            except AdmissionError as exc:
                outcomes.append((pod, str(exc)))
    print_slices(console, snapshot, kubelet)
    print_pods(console, outcomes)
    if sandbox is not None:
        await run_containers(console, sandbox, outcomes)

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
    admitted.set()
    if serving is None:
        print_trimmed(console, Text(
            "\nTo watch these slices live: gpuppetti demo --keep-running, and gpuppetti top in another terminal.",
            style="dim"))
        process.request_stop(DONE)
        return
    print_trimmed(console, Text.assemble(
        "\nThe demo keeps running, serving ", (f"http://{address}", "bold"),
        " (/metrics, /v1/gpus, /v1/slices): ", (serving, "bold"),
        " in another terminal shows the slices its pods hold. Ctrl-C ends it."))


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


