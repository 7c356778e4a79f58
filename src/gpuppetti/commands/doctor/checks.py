"""Each check of ``gpuppetti doctor``: it looks, and returns what it found and, when something is wrong, the fix.

Checks never raise for what they find: a missing directory, a runtime that does not answer or a broken config is
a result. They look under ``--host-root`` where the host's files are (the CRI socket, the Vulkan drivers), so the
same command works on the node and inside the plugin's pod, which mounts the host's / at /host.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.base.httpclient import FetchError, get
from gpuppetti.base.nodepaths import CRI_SOCKETS, KUBELET_SOCKET
from gpuppetti.base.quantity import format_bytes
from gpuppetti.commands.doctor import cri
from gpuppetti.commands.doctor.result import Result, fail, ok, skip, warn
from gpuppetti.core.config import ConfigError
from gpuppetti.discovery import BackendUnavailable
from gpuppetti.hostagent.client import AgentError
from gpuppetti.layer.ledgers import Ledgers
from gpuppetti.layer.vulkan import (
    BUILD_FIX,
    BUILT,
    LIBRARY,
    MANIFEST,
    PROBE,
    LayerDir,
    missing_files,
    not_built,
)
from gpuppetti.node.daemon import Discovered, Sources, host_agent, load_and_discover, nothing_found
from gpuppetti.node.inventory import Inventory
from gpuppetti.sharing.remarks import config_remarks

SOCKET_TIMEOUT_S = 2.0
# Where distributions put the Vulkan loader, and where the loader looks for drivers (ICD manifests).
VULKAN_LIBRARY_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "usr/lib", "lib64",
                       "usr/local/lib")
VULKAN_ICD_DIRS = ("etc/vulkan/icd.d", "usr/share/vulkan/icd.d", "usr/local/share/vulkan/icd.d")
VULKAN_LOADER = "libvulkan.so.1"


@dataclass(frozen=True)
class Settings:
    sources: Sources
    device_plugin_dir: Path
    registry_dir: Path
    cdi_dir: Path
    runtime_endpoint: Path | None = None
    # containerd's socket as ctr takes it (CONTAINERD_ADDRESS): looked at first when no endpoint is given.
    containerd_address: Path | None = None
    daemon_url: str | None = None
    vulkan_layer_dir: Path | None = None
    # plugin, dra or both: the kubelet directory of a mode the node does not run is not checked.
    mode: str = "both"
    # The API server whose version and feature gates to check (None: the in-cluster account, if any).
    kubeconfig: Path | None = None


def config_and_gpus(sources: Sources) -> tuple[list[Result], Discovered | None]:
    """The config, then the GPUs and the backend that found them. Blocks: run it in a thread."""
    where = str(sources.config_path) if sources.config_path else "the built-in defaults"
    try:
        found = load_and_discover(sources)
    except ConfigError as exc:
        return [fail("config", str(exc).replace("\n", "; "), "correct the config; `gpuppetti discover --config "
                     f"{where}` shows each problem")], None
    except BackendUnavailable as exc:
        return [ok("config", where), fail("GPUs", str(exc), "choose a backend that can run here with --backend, "
                                          "or install what it needs")], None
    results = [ok("config", where)]
    if found.gpus:
        by = ", ".join(sorted({gpu.backend for gpu in found.gpus}))
        listed = ", ".join(f"{gpu.id} ({gpu.model})" for gpu in found.gpus)
        results.append(ok("GPUs", f"{len(found.gpus)} found by {by}: {listed}"))
    else:
        root = sources.host_root
        fix = ("in a pod, mount the host's / at /host and pass --host-root /host" if str(root) == "/" else
               f"check that {root} is the host's root, with its /sys and /dev")
        results.append(fail("GPUs", nothing_found(found).replace(":\n  ", ": ", 1).replace("\n  ", "; "),
                            f"{fix}; for NVIDIA, install nvidia-ml-py (the nvml extra; the image has it) and the "
                            "driver; a virtio-gpu needs the virtio_gpu kernel module"))
    for remark in config_remarks(found.gpus, found.config):
        if remark.warning:
            results.append(warn("sharing", f"{found.config.source}: {remark.path}: {remark.why}"))
    return results, found


def slice_sizes(found: Discovered | None) -> dict[str, list[int]]:
    """Each GPU's time-sliced replicas' memory, in bytes, by GPU id (none for a whole GPU, or one whose memory is
    unknown)."""
    if found is None:
        return {}
    try:
        plan = Inventory(found.config, found.gpus).snapshot.plan
    except ConfigError:
        return {}  # said by the config check
    sizes: dict[str, list[int]] = {}
    for resource in plan.values():
        for unit in resource.units:
            if unit.shared and unit.size is not None and unit.size.memory:
                sizes.setdefault(unit.gpu_id, []).append(unit.size.memory)
    return sizes


async def host_agent_check(sources: Sources, found: Discovered | None) -> Result:
    check = "host agent"
    agent = host_agent(sources, found.config) if found is not None else None
    if agent is None:
        return skip(check, "none configured (--host-agent, or hostAgent.url in the config)")
    try:
        facts = await agent.ask()
    except AgentError as exc:
        return fail(check, str(exc), "on the Mac, run `gpuppetti host-agent --listen 0.0.0.0:9410`, and give the "
                    "token file it names to the cluster (kubectl create secret ... --from-file)")
    cores = f", {facts.cores} cores" if facts.cores else ""
    return ok(check, f"{agent.url} answers with the token: {facts.model}{cores}, "
              f"{format_bytes(facts.memory_bytes)}")


async def device_plugin_dir(directory: Path, mode: str) -> Result:
    check = "kubelet device plugins"
    if mode == "dra":
        return skip(check, "not used by the DRA driver")
    kubelet_fix = ("start the kubelet, or point --device-plugin-dir at its device-plugins directory (under the "
                   "kubelet's --root-dir, /var/lib/kubelet by default; in a pod, mount it as a hostPath)")
    if not directory.is_dir():
        return fail(check, f"{directory} does not exist: no kubelet serves device plugins here", kubelet_fix)
    if not os.access(directory, os.W_OK | os.X_OK):
        return fail(check, f"{directory}: no permission to create sockets there", "run as root")
    kubelet = directory / KUBELET_SOCKET
    problem = await _socket_problem(kubelet)
    if problem is not None:
        return fail(check, f"{kubelet}: {problem}", kubelet_fix)
    return ok(check, f"{kubelet} accepts connections")


async def registry_dir(directory: Path, mode: str) -> Result:
    check = "kubelet plugin registry"
    if mode == "plugin":
        return skip(check, "not used by the device plugin")
    if not directory.is_dir():
        return fail(check, f"{directory} does not exist: the DRA driver cannot register with a kubelet here",
                    "pass --registry-dir with the kubelet's plugins_registry directory (in a pod, mount it)")
    if not os.access(directory, os.W_OK | os.X_OK):
        return fail(check, f"{directory}: no permission to create sockets there", "run as root")
    sockets = sorted(entry.name for entry in directory.iterdir() if _is_socket(entry))
    registered = f"; plugins there: {', '.join(sockets)}" if sockets else "; no plugin registered yet"
    return ok(check, f"{directory} is writable{registered}")


async def runtime_checks(endpoint: Path | None, host_root: Path, cdi_dir: Path,
                         containerd_address: Path | None = None) -> list[Result]:
    check = "container runtime"
    candidates = [endpoint] if endpoint is not None else _cri_candidates(host_root, containerd_address)
    found = next((path for path in candidates if _is_socket(path)), None)
    if found is None:
        looked = ", ".join(str(path) for path in candidates)
        return [fail(check, f"no CRI socket at {looked}",
                     "pass the runtime's socket with --runtime-endpoint (env CONTAINER_RUNTIME_ENDPOINT), or "
                     "containerd's with --containerd-address (env CONTAINERD_ADDRESS); in a pod, mount the host's / "
                     "at /host and pass --host-root /host")]
    if (problem := await _socket_problem(found)) is not None:
        return [fail(check, f"{found}: {problem}", "is the container runtime running? (as root for its socket)")]
    try:
        facts = await cri.ask(found)
    except cri.RuntimeUnreachable as exc:
        return [fail(check, f"{found}: {exc}", "use containerd 1.7+ or CRI-O 1.23+")]
    results = [ok(check, f"{facts.describe()} at {found}")]
    if facts.not_ready:
        results[0] = warn(check, f"{facts.describe()} at {found}, not ready: {', '.join(facts.not_ready)}",
                          "see the runtime's log")
    results.append(cri.judge_cdi(facts, cdi_dir))
    return results


def _cri_candidates(host_root: Path, containerd_address: Path | None = None) -> list[Path]:
    """Where to look for a CRI socket: containerd's own address where one is given, then the usual sockets; each
    under the host root first (in a pod), then as it is."""
    sockets = CRI_SOCKETS if containerd_address is None else (containerd_address, *CRI_SOCKETS)
    paths: list[Path] = []
    for candidate in dict.fromkeys(sockets):
        if str(host_root) != "/" and candidate.is_absolute():
            paths.append(host_root / candidate.relative_to("/"))
        paths.append(candidate)
    return paths


def cdi_dir_check(directory: Path) -> Result:
    check = "CDI directory"
    if directory.is_dir():
        if not os.access(directory, os.W_OK | os.X_OK):
            return fail(check, f"{directory} is not writable here", "run as root; in a pod, mount it read-write")
        specs = sorted(path.name for path in directory.glob("*.json"))
        ours = [name for name in specs if "gpuppetti" in name]
        return ok(check, f"{directory} is writable; {len(specs)} spec(s), {len(ours)} of them gpuppetti's")
    parent = next((p for p in directory.parents if p.exists()), None)
    if parent is not None and parent.is_dir() and os.access(parent, os.W_OK | os.X_OK):
        return ok(check, f"{directory} does not exist yet; the daemons create it")
    return fail(check, f"{directory} does not exist and cannot be created here",
                "run as root; in a pod, mount it (hostPath, DirectoryOrCreate)")


def vulkan_check(host_root: Path) -> Result:
    check = "Vulkan"
    loaders = [host_root / d / VULKAN_LOADER for d in VULKAN_LIBRARY_DIRS if (host_root / d / VULKAN_LOADER).exists()]
    drivers: list[str] = []
    for directory in VULKAN_ICD_DIRS:
        for manifest in sorted((host_root / directory).glob("*.json")):
            drivers.append(_icd_name(manifest))
    fix_loader = "install the Vulkan loader (Debian: libvulkan1)"
    fix_drivers = ("install the GPU's Vulkan driver (Debian: mesa-vulkan-drivers for AMD, Intel, virtio-gpu and "
                   "lavapipe; NVIDIA's driver ships nvidia_icd.json)")
    if not loaders and not drivers:
        return warn(check, "no Vulkan loader and no driver on the host: slices cannot be enforced through Vulkan "
                    "(time-slicing works without)", f"{fix_loader}; {fix_drivers}")
    if not drivers:
        return warn(check, f"loader {loaders[0]}, but no Vulkan driver (ICD manifest) in "
                    f"{', '.join(VULKAN_ICD_DIRS)}", fix_drivers)
    loader = f"loader {loaders[0]}" if loaders else "no loader on the host (the workload's image brings its own)"
    return ok(check, f"{loader}; drivers: {', '.join(drivers)}")


def layer_check(directory: Path | None) -> Result:
    check = "Vulkan layer"
    if directory is None:
        return skip(check, "slices are not enforced (--vulkan-layer-dir '')")
    if missing := missing_files():
        why = not_built()
        return fail(check, f"this installation has no built Vulkan layer ({', '.join(missing)} missing in "
                    f"{BUILT}{'; ' + why if why else ''}): slices are not enforced", BUILD_FIX)
    installed = [name for name in (MANIFEST, LIBRARY, PROBE) if (directory / name).is_file()]
    if len(installed) < 3:
        return warn(check, f"not installed in {directory} yet: the plugin or driver installs it when it starts",
                    "start the daemon with this --vulkan-layer-dir (the DaemonSets mount /var/lib/gpuppetti/vulkan)")
    ledgers = Ledgers(LayerDir(directory).ledgers).on_disk()
    return ok(check, f"installed in {directory}; {len(ledgers)} allocation(s) held to their slices")


def layer_holds(directory: Path | None, found: Discovered | None) -> bool:
    """Whether a daemon with this --vulkan-layer-dir and config holds slices with the layer."""
    enforce = found.config.sharing.enforce_memory if found is not None else True
    return directory is not None and enforce and not missing_files()


def _icd_name(manifest: Path) -> str:
    try:
        document = json.loads(manifest.read_text(encoding="utf-8"))
        library = document["ICD"]["library_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{manifest.name} (unreadable)"
    return f"{manifest.name} ({Path(str(library)).name})"


async def daemon_check(url: str | None) -> Result:
    check = "daemon"
    if url is None:
        return skip(check, "no --daemon address given")
    target = url.rstrip("/") + "/healthz"
    try:
        reply = await get(target, timeout=5)
    except FetchError as exc:
        return fail(check, str(exc), "is the plugin or driver running, serving --http-address at that address?")
    text = reply.body.decode(errors="replace").strip()
    if reply.status == 200:
        return ok(check, f"{target}: {text}")
    if reply.status == 503:
        # The daemon's answer already says it is not ready, and what it waits for.
        text = text.removeprefix("not ready: ")
        return fail(check, f"{target}: not ready: {text}", "its log says what it waits for")
    return fail(check, f"{target} answered {reply.status}: not a gpuppetti daemon?",
                "give the address of a plugin or driver's --http-address")


async def _socket_problem(path: Path) -> str | None:
    """Why nothing serves on the Unix socket at ``path``; None when something accepts a connection."""
    if not path.exists():
        return "does not exist"
    if not _is_socket(path):
        return "is not a socket"
    # In a thread, timed by the socket itself: the other checks share the event loop, and a slow machine (an
    # emulated CPU, a loaded node) can stall it longer than the connection takes.
    return await asyncio.to_thread(_connect, path)


def _connect(path: Path) -> str | None:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    client.settimeout(SOCKET_TIMEOUT_S)
    try:
        client.connect(str(path))
    except TimeoutError:
        return f"no connection within {SOCKET_TIMEOUT_S:g}s"
    except PermissionError:
        return "permission denied (run as root)"
    except ConnectionRefusedError:
        return "refuses connections: what made it has stopped"
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        client.close()
    return None


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False
