"""``gpuppetti demo``: the plugin against the built-in kubelet, in a temporary directory, on the GPUs the config's
backend finds: simulated ones by default, or the node's own (``backend: drm``, ``auto``, ...).

With ``--runtime podman`` each admitted pod also runs as a real container. On simulated GPUs its image holds Mesa's
lavapipe (the sandbox's own); on a node's real GPUs, it is built here from the node's files: a static busybox, the
Vulkan loader, and the Vulkan drivers of those GPUs (Venus for a virtio-gpu, RADV, ANV, NVIDIA's) with the libraries
they load, so that each container reaches its GPU through the device node its Allocate answer names.

With ``--keep-running`` it stays up once its pods are admitted, serving the daemons' HTTP endpoint (/metrics,
/v1/gpus, /v1/slices) until Ctrl-C, so that ``gpuppetti top`` shows the slices its pods hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tarfile
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from rich.console import Console, RenderableType
from rich.text import Text

from gpuppetti.base.nodepaths import DEFAULT_HTTP_ADDRESS
from gpuppetti.base.processes import run_within
from gpuppetti.base.quantity import format_bytes
from gpuppetti.base.runtime import Runtime
from gpuppetti.base.tables import Column, Prose, print_table, print_trimmed
from gpuppetti.core import cdi
from gpuppetti.core.config import Config, load_config, parse_config
from gpuppetti.core.model import Gpu, Vendor
from gpuppetti.deviceplugin.enforcement import Enforcer
from gpuppetti.deviceplugin.lifecycle import DevicePluginManager
from gpuppetti.discovery import BackendUnavailable, backends_for, discover, looked_at
from gpuppetti.kubelet.emulator import AdmissionError, ContainerAllocation, KubeletEmulator, Pod
from gpuppetti.kubelet.sandbox import (
    BUSYBOX,
    PODMAN_FLAGS,
    VULKAN_LOADER,
    PodmanSandbox,
    SandboxError,
    Seen,
    linked_libraries,
)
from gpuppetti.layer.vulkan import BUILT, LIBRARY, PROBE, Enforcement, install_layer
from gpuppetti.node.httpserver import AddressError, HttpServer
from gpuppetti.node.inventory import Inventory, Snapshot
from gpuppetti.node.metrics import Metrics
from gpuppetti.node.report import gpu_records, print_gpus, slice_records
from gpuppetti.sharing.remarks import config_remarks

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
            if image is None and any(not gpu.simulated for gpu in gpus):
                # The node's own GPUs: an image with their Vulkan drivers, built from this machine's files.
                sandbox = PodmanSandbox(await node_image(gpus))
            await sandbox.ensure_image()
        except SandboxError as exc:
            raise DemoError(str(exc), bad_input=image is not None) from None
    inventory = Inventory(config, gpus)
    metrics = Metrics()
    http = HttpServer(metrics)
    serving: str | None = None
    if serve_at is not None:
        # Before anything starts: an address in use (a daemon runs here) is said at once.
        try:
            await http.start(serve_at)
        except AddressError as exc:
            raise DemoError(f"--http-address: {exc}: a daemon may serve there already; give the demo another "
                            "address") from None
        # What `gpuppetti top` needs to be told to reach it: nothing at the daemons' default address.
        serving = "gpuppetti top" if http.address == DEFAULT_HTTP_ADDRESS else \
            f"gpuppetti top --from http://{http.address}"
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
                # Its row says why, in the widest column; the others stay empty.
                rows.append([pod.name, "", "", "", Text(str(exc), style="red"), "", ""])
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


# -- an image for the node's own GPUs: their Vulkan drivers, from this machine ----------------------------------

NODE_IMAGE = "localhost/gpuppetti-sandbox"
ICD_DIRS = (Path("/usr/share/vulkan/icd.d"), Path("/etc/vulkan/icd.d"))
# Mesa's device selection layer, which reads MESA_VK_DEVICE_SELECT: a container with its GPU's driver has it too.
DEVICE_SELECT = Path("/usr/share/vulkan/implicit_layer.d/VkLayer_MESA_device_select.json")
# The drivers a container needs to reach each kind of GPU, by their ICD manifests' names. Apple's GPU reaches a
# krunkit VM as a virtio-gpu, which Mesa's Venus drives; a simulated GPU is whatever device the container has
# (lavapipe, Mesa's CPU driver).
DRIVER_MANIFESTS: dict[Vendor | None, tuple[str, ...]] = {
    Vendor.VIRTIO: ("virtio_icd*.json",),
    Vendor.APPLE: ("virtio_icd*.json",),
    Vendor.AMD: ("radeon_icd*.json",),
    Vendor.INTEL: ("intel_icd*.json", "intel_hasvk_icd*.json"),
    Vendor.NVIDIA: ("nvidia_icd*.json", "nouveau_icd*.json"),
    None: ("lvp_icd*.json",),
}
IMAGE_APPLETS = ("sh", "env", "ls", "cat", "grep", "sort", "echo")


def driver_manifests(gpus: Iterable[Gpu], directories: Sequence[Path] = ICD_DIRS) -> list[Path]:
    """The ICD manifests on this machine of the drivers that serve ``gpus``."""
    patterns: list[str] = []
    for gpu in gpus:
        for pattern in DRIVER_MANIFESTS.get(None if gpu.simulated else gpu.vendor, ()):
            if pattern not in patterns:
                patterns.append(pattern)
    found: list[Path] = []
    for pattern in patterns:
        for directory in directories:
            found += [path for path in sorted(directory.glob(pattern)) if path not in found]
    return found


def library_of(manifest: Path, key: str = "ICD") -> Path | None:
    """The library a driver's (or layer's) manifest names, as the dynamic linker would find it here."""
    try:
        named = str(json.loads(manifest.read_text(encoding="utf-8"))[key]["library_path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if "/" in named:
        path = Path(named) if named.startswith("/") else manifest.parent / named
        return path if path.is_file() else None
    for directory in (VULKAN_LOADER.parent, Path("/usr/lib64"), Path("/usr/lib"), Path("/lib64")):
        if (directory / named).is_file():
            return directory / named
    return None


async def node_image(gpus: Sequence[Gpu], podman: str = "podman") -> str:
    """A local image with a static busybox, the Vulkan loader and the drivers of ``gpus`` from this machine, tagged
    by a digest of what went in (built once). Raises SandboxError where this machine lacks them."""
    manifests = driver_manifests(gpus)
    if not manifests:
        kinds = ", ".join(sorted({gpu.vendor.value for gpu in gpus}))
        raise SandboxError(f"no Vulkan driver for the GPUs here ({kinds}) in {', '.join(map(str, ICD_DIRS))}: the "
                           "containers could not reach them (Debian: mesa-vulkan-drivers)")
    if not VULKAN_LOADER.is_file():
        raise SandboxError(f"no Vulkan loader at {VULKAN_LOADER} to build the containers' image from (Debian: "
                           "libvulkan1)")
    layers = [DEVICE_SELECT] if DEVICE_SELECT.is_file() and library_of(DEVICE_SELECT, "layer") else []
    binaries = [VULKAN_LOADER]
    for manifest in manifests:
        if (library := library_of(manifest)) is not None:
            binaries.append(library)
    binaries += [library for layer in layers if (library := library_of(layer, "layer")) is not None]
    # What the slice layer and its probe load, which are mounted in, not copied (libpthread.so.0 for the layer,
    # which a newer glibc's drivers no longer bring): without it the loader skips the layer without a word.
    mounted = [BUILT / name for name in (LIBRARY, PROBE) if (BUILT / name).is_file()]
    # And busybox's, where it is not the static one (a distribution's busybox package).
    linked = await linked_libraries([*binaries, *mounted, BUSYBOX])
    libraries = [path for path in linked if path not in (*mounted, BUSYBOX)]
    files = [BUSYBOX, *libraries, *manifests, *layers]
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    tag = f"{NODE_IMAGE}:node-{digest.hexdigest()[:16]}"
    exists = await _podman(podman, "image", "exists", tag)
    if exists[0] == 0:
        return tag
    with tempfile.TemporaryDirectory(prefix="gpuppetti-image-") as workdir:
        root = Path(workdir) / "root"
        for directory in ("bin", "dev", "proc", "sys", "tmp", "usr/local/bin", "etc/vulkan/implicit_layer.d"):
            (root / directory).mkdir(parents=True)
        shutil.copy2(BUSYBOX, root / "bin" / "busybox")
        for applet in IMAGE_APPLETS:
            os.symlink("busybox", root / "bin" / applet)
        for path in [*libraries, *manifests, *layers]:
            # The file itself, at the path it is asked for by (no links to follow inside the image).
            target = root / path.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path.resolve(), target)
            os.chmod(target, 0o755 if path in libraries else 0o644)
        archive = Path(workdir) / "rootfs.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(root, arcname=".")
        code, stderr = await _podman(podman, "import", str(archive), tag)
    if code != 0:
        raise SandboxError(f"building {tag} from this machine's files failed: {stderr.strip()}")
    return tag


async def _podman(podman: str, *args: str) -> tuple[int, str]:
    try:
        code, _, stderr = await run_within([podman, *PODMAN_FLAGS, *args], 300, stdout=asyncio.subprocess.DEVNULL)
    except TimeoutError:
        raise SandboxError(f"podman {args[0]} did not finish in 300s") from None
    return code, stderr.decode(errors="replace")
