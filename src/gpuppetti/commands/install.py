"""``gpuppetti install`` and ``gpuppetti uninstall``: from the current kube context to enforced slices, and back.

The objects are those of ``gpuppetti manifests`` (``commands.manifests`` renders them), applied through the API
server with lightkube's server-side apply, not through ``helm``: a Mac user's one command must not need a second
tool, lightkube already talks to the cluster for the DRA driver, and server-side apply makes a second install an
update rather than an error. The Helm chart stays for those who manage releases with Helm (docs/helm.md).

What kind of cluster it is (minikube, and with which driver; kind; k3s; any other node) is read from the nodes'
own facts (minikube's node labels, kind's provider ID, k3s's kubelet version), and decides how the image reaches
the nodes: built in minikube's VM, loaded into kind's nodes, imported into a local k3s's containerd, or pulled from
a registry by any other node. Every step prints what it does; what cannot be done ends the command with one line,
as an InstallError saying whether the user can fix it (exit 2) or the cluster failed (exit 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from lightkube import codecs
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core import exceptions as lightkube_errors
from lightkube.generic_resource import create_global_resource
from lightkube.resources.core_v1 import Node as _Node
from lightkube.resources.core_v1 import Pod as _Pod

from gpuppetti.base.processes import run_within
from gpuppetti.commands import manifests
from gpuppetti.core.config import ConfigError, parse_config
from gpuppetti.node.kube import ApiError, Kube, NotFound

ClusterKind = Literal["minikube", "kind", "k3s", "node"]
FIELD_MANAGER = "gpuppetti-install"
SMOKE_POD = "gpuppetti-smoke"
# The probe the layer mounts into every container given a slice; it prints the Vulkan devices as the layer shows
# them: the slice's memory as the heap, with its budget. It needs the image's Vulkan loader and glibc.
VKINFO = "/usr/local/bin/gpuppetti-vkinfo"
SMOKE_SCRIPT = (
    f"env | grep '^GPUPPETTI_' | sort; echo '--- gpuppetti-vkinfo'; if [ -e {VKINFO} ]; then {VKINFO} 2>&1 || "
    "echo 'gpuppetti-vkinfo could not run: this image has no Vulkan loader (or glibc older than 2.34); "
    "--smoke-image IMAGE picks one that has'; else echo 'gpuppetti-vkinfo is not mounted: this slice is not held "
    "by the layer (a whole GPU, or enforcement off: see GPUPPETTI_LIMITS)'; fi")
# A busybox for the smoke pod's env; the Mac's VM gets the image with the patched Mesa its Venus needs.
SMOKE_IMAGE = "busybox:1.36"
KRUNKIT_SMOKE_IMAGE = "quay.io/slopezpa/fedora-vgpu"
DEFAULT_TIMEOUT_S = 300.0
# Tools that build or load an image may take minutes (a first build downloads its base image).
TOOL_TIMEOUT_S = 1800.0
# How long a daemon pod may run without serving a GPU before its log is read for why.
GRACE_S = 20.0
# Node labels the device plugin sets with --label-node, besides the mode label: all of them under this prefix.
LABEL_PREFIX = "gpuppetti.dev/"

_Slice = create_global_resource(group="resource.k8s.io", version="v1", kind="ResourceSlice",
                                plural="resourceslices")


class InstallError(Exception):
    """Why the command cannot go on, in one line; ``bad_input``: the user can fix it (exit 2), else exit 1."""

    def __init__(self, message: str, bad_input: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input


# -- what the cluster is ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cluster:
    kind: ClusterKind
    # minikube's profile or kind's cluster name; empty for the others.
    name: str
    nodes: tuple[str, ...]
    # minikube's VM driver (krunkit passes an Apple silicon Mac's GPU to the VM), where it could be read.
    driver: str | None = None
    # Whether the API server is on this machine: a k3s's containerd can then be reached here.
    local: bool = False

    def describe(self) -> str:
        count = f"{len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''}: {', '.join(self.nodes)}"
        if self.kind == "minikube":
            return f"minikube profile {self.name} (driver {self.driver or 'unknown'}), {count}"
        if self.kind == "kind":
            return f"kind cluster {self.name}, {count}"
        if self.kind == "k3s":
            return f"k3s ({'on this machine' if self.local else 'on another machine'}), {count}"
        return f"a Kubernetes cluster that is not minikube, kind or k3s, {count}"


def _labels(node: dict[str, Any]) -> dict[str, str]:
    return dict((node.get("metadata") or {}).get("labels") or {})


def _name(node: dict[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name", ""))


def minikube_driver(profile: str, minikube_home: Path) -> str | None:
    """The driver minikube started ``profile`` with, from its profile's config; None where it cannot be read."""
    try:
        config = json.loads((minikube_home / "profiles" / profile / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    driver = config.get("Driver") if isinstance(config, dict) else None
    return driver if isinstance(driver, str) and driver else None


def default_minikube_home() -> Path:
    # MINIKUBE_HOME may name the .minikube folder itself or the folder that holds it, as minikube takes it.
    home = Path(os.environ.get("MINIKUBE_HOME", "~")).expanduser()
    return home if home.name == ".minikube" else home / ".minikube"


def detect(context: str, server: str, nodes: Sequence[dict[str, Any]], minikube_home: Path) -> Cluster:
    """What kind of cluster the nodes (as the API answers them) and the kubeconfig's context say it is."""
    names = tuple(_name(node) for node in nodes)
    local = is_local(server)
    for node in nodes:
        profile = _labels(node).get("minikube.k8s.io/name")
        if profile:
            return Cluster("minikube", profile, names, minikube_driver(profile, minikube_home), local)
    for node in nodes:
        provider = str((node.get("spec") or {}).get("providerID") or "")
        if provider.startswith("kind://"):
            # kind://<provider>/<cluster>/<node>
            parts = provider.removeprefix("kind://").split("/")
            name = parts[1] if len(parts) >= 3 else context.removeprefix("kind-")
            return Cluster("kind", name, names, local=local)
    for node in nodes:
        version = str(((node.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion") or "")
        if "+k3s" in version or _labels(node).get("node.kubernetes.io/instance-type") == "k3s":
            return Cluster("k3s", "", names, local=local)
    return Cluster("node", "", names, local=local)


def is_local(server: str) -> bool:
    host = urlsplit(server).hostname or ""
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


# -- how the image reaches the nodes -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ImagePlan:
    image: str
    # Each command, in order; empty where the nodes pull the image themselves.
    steps: tuple[tuple[str, ...], ...]
    # Why these steps, for the user.
    how: str
    # Whether the image was put on the nodes: the kubelet must not try to pull it then.
    loaded: bool


def container_engine() -> str | None:
    return next((tool for tool in ("docker", "podman") if shutil.which(tool)), None)


def image_plan(cluster: Cluster, image: str | None, build: Path | None, engine: str | None, scratch: Path,
               root: bool) -> ImagePlan:
    """The commands that put the image on ``cluster``'s nodes: built from ``build`` (a checkout with the
    Dockerfile), or ``image`` as the user named it, which the nodes pull. Raises InstallError."""
    if build is None:
        if image is None:
            raise InstallError("no image to run: give --image REF (one the nodes can pull), or --build DIR (a "
                               "gpuppetti checkout) to build one onto the cluster", bad_input=True)
        return ImagePlan(image, (), "nothing to load: the nodes pull it, or have it already", loaded=False)
    if not (build / "Dockerfile").is_file():
        raise InstallError(f"--build {build}: no Dockerfile there (give a gpuppetti checkout)", bad_input=True)
    target = image or manifests.DEFAULT_IMAGE
    context = str(build)
    if cluster.kind == "minikube":
        return ImagePlan(target, (("minikube", "-p", cluster.name, "image", "build", "-t", target, context),),
                         f"built inside minikube's VM (profile {cluster.name})", loaded=True)
    if engine is None:
        raise InstallError(f"building {target} needs docker or podman, and neither is on PATH: install one, or "
                           "give --image REF that the nodes can pull", bad_input=True)
    built = (engine, "build", "-t", target, context)
    archive = str(scratch / "gpuppetti-image.tar")
    if cluster.kind == "kind":
        steps: tuple[tuple[str, ...], ...]
        if engine == "docker":
            steps = (built, ("kind", "load", "docker-image", target, "--name", cluster.name))
        else:
            steps = (built, (engine, "save", "-o", archive, target),
                     ("kind", "load", "image-archive", archive, "--name", cluster.name))
        return ImagePlan(target, steps, f"built with {engine} and loaded into kind cluster {cluster.name}'s nodes",
                         loaded=True)
    if cluster.kind == "k3s":
        if not cluster.local:
            raise InstallError("k3s's containerd is on its node, not here: run gpuppetti install on the node, or give "
                               "--image REF from a registry the node pulls from", bad_input=True)
        sudo = () if root else ("sudo",)
        return ImagePlan(target, (built, (engine, "save", "-o", archive, target),
                                  (*sudo, "k3s", "ctr", "images", "import", archive)),
                         f"built with {engine} and imported into k3s's containerd", loaded=True)
    raise InstallError("this cluster is not minikube, kind or k3s: its nodes pull their image from a registry; push "
                       f"one (`{engine} build -t REGISTRY/gpuppetti:TAG . && {engine} push ...`) and give --image "
                       "REF instead of --build", bad_input=True)


async def run_steps(steps: Iterable[Sequence[str]], say: Callable[[str], None],
                    timeout: float = TOOL_TIMEOUT_S) -> None:
    """Run each command with its output on the terminal. Raises InstallError: a missing tool is the user's to
    install (exit 2), a failing one a failure (exit 1)."""
    for argv in steps:
        tool = argv[1] if argv[0] == "sudo" else argv[0]
        if shutil.which(argv[0]) is None or shutil.which(tool) is None:
            raise InstallError(f"{tool} is not on PATH: install it, or give --image REF that the nodes can pull",
                               bad_input=True)
        say(f"  $ {' '.join(argv)}")
        try:
            code, _, _ = await run_within(list(argv), timeout, stdout=None, stderr=None)
        except TimeoutError:
            raise InstallError(f"`{' '.join(argv)}` did not finish within {timeout:g}s") from None
        except OSError as exc:
            raise InstallError(f"cannot run {tool}: {exc.strerror or exc}") from None
        if code != 0:
            raise InstallError(f"`{' '.join(argv)}` failed (exit {code}); its output is above")


# -- what is applied -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    kubeconfig: Path | None
    context: str | None
    mode: manifests.Mode = "plugin"
    namespace: str = manifests.DEFAULT_NAMESPACE
    image: str | None = None
    build: Path | None = None
    # The config file's text, or None for the cluster's preset (minikube with krunkit) or the default.
    config: str | None = None
    config_source: str | None = None
    replicas: int | None = None
    nodes: tuple[str, ...] = ()
    host_network: bool = False
    smoke_image: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    minikube_home: Path = field(default_factory=default_minikube_home)


def choose_config(cluster: Cluster, settings: Settings) -> tuple[str | None, str]:
    """The config the ConfigMap holds, and where it came from. Raises InstallError."""
    if settings.config is not None:
        return settings.config, settings.config_source or "--config"
    if cluster.kind == "minikube" and cluster.driver == "krunkit":
        return manifests.preset_config("minikube-krunkit", settings.replicas), "the minikube-krunkit preset"
    if cluster.kind == "kind":
        raise InstallError("kind's nodes have no GPUs: give --config with simulated GPUs (see docs/kind.md)",
                           bad_input=True)
    return None, "the default: every GPU the nodes have, " + (
        f"{settings.replicas} replicas each" if settings.replicas else "whole")


def render(settings: Settings, config: str | None, image: str, loaded: bool, server: str) -> list[dict[str, Any]]:
    options = manifests.Options(
        mode=settings.mode, namespace=settings.namespace, image=image, config=config,
        replicas=settings.replicas if config is None else None,
        # A loaded image is on the nodes only: the kubelet must not look for it in a registry.
        image_pull_policy="IfNotPresent" if loaded else None,
    )
    try:
        objects = manifests.render(options)
    except ConfigError as exc:
        raise InstallError(f"the config: {exc}", bad_input=True) from None
    if settings.host_network:
        objects = on_host_network(objects, server)
    return objects


def on_host_network(objects: list[dict[str, Any]], server: str) -> list[dict[str, Any]]:
    """The DaemonSets in the node's network, for a node without a pod network or kube-proxy: their probes reach
    them on the node's address, and they reach the API server at the kubeconfig's address."""
    address = urlsplit(server)
    env = [{"name": "KUBERNETES_SERVICE_HOST", "value": address.hostname or ""},
           {"name": "KUBERNETES_SERVICE_PORT", "value": str(address.port or 443)}]
    for obj in objects:
        if obj["kind"] == "DaemonSet":
            spec = obj["spec"]["template"]["spec"]
            spec["hostNetwork"] = True
            spec["dnsPolicy"] = "ClusterFirstWithHostNet"
            spec["containers"][0]["env"] += env
    return objects


def smoke_objects(settings: Settings, resource: str | None, image: str) -> list[dict[str, Any]]:
    """The smoke pod that asks for one slice (and for DRA, the claim template it asks through)."""
    container: dict[str, Any] = {"name": "smoke", "image": image, "command": ["sh", "-c", SMOKE_SCRIPT]}
    spec: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container]}
    metadata = {"name": SMOKE_POD, "namespace": settings.namespace, "labels": dict(manifests.LABELS)}
    objects: list[dict[str, Any]] = []
    if settings.mode == "dra":
        objects.append({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": dict(metadata),
            "spec": {"spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": manifests.DRIVER}}]}}}})
        container["resources"] = {"claims": [{"name": "gpu"}]}
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": SMOKE_POD}]
    else:
        container["resources"] = {"limits": {resource: 1}}
    objects.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
    return objects


def all_objects(namespace: str) -> list[dict[str, Any]]:
    """Every object any install makes, in either mode, in the order they are deleted: the DaemonSets first, so
    that each daemon, stopped, removes what it put on its node, and the namespace last."""
    rendered: dict[tuple[str, str], dict[str, Any]] = {}
    for mode in ("plugin", "dra"):
        for obj in manifests.render(manifests.Options(mode=mode, namespace=namespace, label_node=True)):
            rendered[(obj["kind"], obj["metadata"]["name"])] = obj
    order = ("DaemonSet", "ConfigMap", "ServiceAccount", "ClusterRoleBinding", "ClusterRole", "DeviceClass",
             "Namespace")
    return sorted(rendered.values(), key=lambda obj: order.index(obj["kind"]) if obj["kind"] in order else 0)


# -- the API server ------------------------------------------------------------------------------------------------

def load_kubeconfig(kubeconfig: Path | None, context: str | None) -> tuple[KubeConfig, str, str]:
    """The kubeconfig (the first file of a KUBECONFIG list that exists, else ~/.kube/config), with ``context``
    current, its context's name and its API server. Raises InstallError."""
    if kubeconfig is None:
        listed = os.environ.get("KUBECONFIG", "")
        candidates = [Path(part).expanduser() for part in listed.split(os.pathsep) if part]
        candidates = candidates or [Path("~/.kube/config").expanduser()]
        path = next((candidate for candidate in candidates if candidate.is_file()), None)
        if path is None:
            where = f"KUBECONFIG={listed}" if listed else "~/.kube/config"
            raise InstallError(f"no kubeconfig: {where} does not exist (start a cluster, or give --kubeconfig)",
                               bad_input=True)
    else:
        candidates = [Path(part).expanduser() for part in str(kubeconfig).split(os.pathsep) if part]
        path = next((candidate for candidate in candidates if candidate.is_file()), candidates[0])
    try:
        config = KubeConfig.from_file(path)
        if context is not None:
            config.current_context = context
        single = config.get()
    except (lightkube_errors.ConfigError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InstallError(f"kubeconfig {path}: {exc or type(exc).__name__}", bad_input=True) from None
    if single is None:
        raise InstallError(f"kubeconfig {path}: no current context (give --context)", bad_input=True)
    return config, single.context_name, single.cluster.server


class InstallApi(Kube):
    """The calls install and uninstall make, on Kube's boundary: bounded in time, every failure an ApiError."""

    async def nodes(self) -> list[dict[str, Any]]:
        async def listed() -> list[dict[str, Any]]:
            return [node.to_dict() async for node in self._client.list(_Node)]
        return await self._call("listing Nodes", listed())

    async def node(self, name: str) -> dict[str, Any]:
        found = await self._call(f"reading Node {name}", self._client.get(_Node, name))
        result: dict[str, Any] = found.to_dict()
        return result

    async def apply(self, obj: dict[str, Any]) -> None:
        what = f"applying {obj['kind']} {obj['metadata']['name']}"
        try:
            resource = codecs.from_dict(obj)
        except lightkube_errors.LoadResourceError as exc:
            raise ApiError(f"{what}: {exc}") from None
        await self._call(what, self._client.apply(resource, field_manager=FIELD_MANAGER, force=True))

    async def delete(self, obj: dict[str, Any]) -> bool:
        """Delete the object ``obj`` names; False where there was none."""
        kind: Any = type(codecs.from_dict(obj))
        name, namespace = obj["metadata"]["name"], obj["metadata"].get("namespace")
        try:
            if namespace:
                await self._call(f"deleting {obj['kind']} {namespace}/{name}",
                                 self._client.delete(kind, name, namespace=namespace))
            else:
                await self._call(f"deleting {obj['kind']} {name}", self._client.delete(kind, name))
        except NotFound:
            return False
        return True

    async def exists(self, obj: dict[str, Any]) -> bool:
        kind: Any = type(codecs.from_dict(obj))
        name, namespace = obj["metadata"]["name"], obj["metadata"].get("namespace")
        try:
            if namespace:
                await self._call(f"reading {obj['kind']} {name}", self._client.get(kind, name, namespace=namespace))
            else:
                await self._call(f"reading {obj['kind']} {name}", self._client.get(kind, name))
        except NotFound:
            return False
        return True

    async def pods(self, namespace: str, selector: dict[str, Any]) -> list[dict[str, Any]]:
        async def listed() -> list[dict[str, Any]]:
            return [pod.to_dict() async for pod in self._client.list(_Pod, namespace=namespace, labels=selector)]
        return await self._call(f"listing the Pods of namespace {namespace}", listed())

    async def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = await self._call(f"reading Pod {namespace}/{name}",
                                     self._client.get(_Pod, name, namespace=namespace))
        except NotFound:
            return None
        result: dict[str, Any] = found.to_dict()
        return result

    async def log(self, namespace: str, name: str) -> str:
        async def read() -> str:
            return "".join([line async for line in self._client.log(name, namespace=namespace)])
        return await self._call(f"reading the log of Pod {namespace}/{name}", read())

    async def slices(self) -> list[dict[str, Any]]:
        async def listed() -> list[dict[str, Any]]:
            items: Any = self._client.list(_Slice, fields={"spec.driver": manifests.DRIVER})
            return [item.to_dict() async for item in items]
        return await self._call("listing ResourceSlices", listed())

    async def delete_slices(self) -> int:
        count = 0
        for item in await self.slices():
            name = item["metadata"]["name"]
            with contextlib.suppress(NotFound):
                await self._call(f"deleting ResourceSlice {name}", self._client.delete(_Slice, name))
                count += 1
        return count


@contextlib.asynccontextmanager
async def connected(settings: Settings, say: Callable[[str], None]
                    ) -> AsyncIterator[tuple[InstallApi, Cluster, str]]:
    """The API, the cluster it serves, and its address. Raises InstallError."""
    config, context, server = load_kubeconfig(settings.kubeconfig, settings.context)
    say(f"  context {context}: API server {server}")
    api = InstallApi(config)
    try:
        try:
            nodes = await api.nodes()
        except ApiError as exc:
            raise InstallError(f"cannot reach the cluster of context {context} at {server}: {exc}") from None
        if not nodes:
            raise InstallError(f"the cluster of context {context} has no nodes")
        yield api, detect(context, server, nodes, settings.minikube_home), server
    finally:
        await api.close()


def served_names(config: str | None) -> frozenset[str]:
    """The extended resources the device plugin may advertise with ``config``: every vendor's default name, the
    config's own names and renames, and the names renameByDefault gives."""
    names = set(manifests.ALL_RESOURCES)
    if config is not None:
        for entry in parse_config(config, "the config").sharing.time_slicing.resources:
            names |= {entry.name, *([entry.rename] if entry.rename else [])}
    return frozenset(names | {f"{name}.shared" for name in names})


def extended_resources(node: dict[str, Any], names: Collection[str]) -> dict[str, int]:
    """A node's allocatable resources among ``names``, with a count."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    found = {}
    for name, value in allocatable.items():
        if name in names:
            with contextlib.suppress(ValueError):
                if int(str(value)) > 0:
                    found[name] = int(str(value))
    return found


def ready_nodes(pods: Iterable[dict[str, Any]]) -> set[str]:
    """The nodes whose daemon pod is Ready: registered with the kubelet (and for DRA, its slices published)."""
    return {str((pod.get("spec") or {}).get("nodeName")) for pod in pods
            if any(condition.get("type") == "Ready" and condition.get("status") == "True"
                   for condition in (pod.get("status") or {}).get("conditions") or [])}


def slice_devices(slices: Iterable[dict[str, Any]], nodes: Iterable[str]) -> dict[str, int]:
    """How many devices the driver publishes for each of ``nodes``."""
    wanted = set(nodes)
    counts: dict[str, int] = {}
    for item in slices:
        spec = item.get("spec") or {}
        node = spec.get("nodeName")
        if node in wanted:
            counts[node] = counts.get(node, 0) + len(spec.get("devices") or [])
    return {node: count for node, count in counts.items() if count}


def daemon_problem(pod: dict[str, Any], log: str | None) -> str | None:
    """Why a daemon's pod serves nothing, from its status and its log; None where it may yet."""
    node = (pod.get("spec") or {}).get("nodeName") or "?"
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason", "")
        if reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"):
            return (f"node {node} cannot get the image {status.get('image')}: {reason}: "
                    f"{waiting.get('message', '').strip()}".rstrip(": "))
        if reason == "CrashLoopBackOff" and log:
            return f"the daemon on node {node} keeps exiting; its last line: {log.strip().splitlines()[-1]}"
    if log and "no GPUs found" in log:
        looked = [line.strip() for line in log.split("no GPUs found", 1)[1].splitlines()[1:]
                  if line.startswith("  ")]
        where = f" (looked at: {'; '.join(looked)})" if looked else ""
        return f"the daemon on node {node} found no GPUs{where}"
    return None


# -- install ----------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What install did: the resources served, how long from the first object applied to the first slice, and
    what the smoke pod printed."""

    served: dict[str, str] = field(default_factory=dict)
    # From the first object applied: what the image's build or load, which varies most, does not count in.
    seconds_to_first_slice: float = 0.0
    smoke_log: str = ""


async def install(settings: Settings, say: Callable[[str], None]) -> Outcome:
    """Install gpuppetti on the kube context's cluster, wait for its GPUs, and run the smoke pod. Raises
    InstallError."""
    outcome = Outcome()
    begun = time.monotonic()
    say("1. finding the cluster")
    async with connected(settings, say) as (api, cluster, server):
        say(f"  {cluster.describe()}")
        nodes = _chosen_nodes(cluster, settings.nodes)
        config, config_source = choose_config(cluster, settings)
        say("2. getting the image onto the nodes")
        with tempfile.TemporaryDirectory(prefix="gpuppetti-install-") as scratch:
            plan = image_plan(cluster, settings.image, settings.build, container_engine(), Path(scratch),
                              os.geteuid() == 0)
            say(f"  {plan.image}: {plan.how}")
            await run_steps(plan.steps, say)
        objects = render(settings, config, plan.image, plan.loaded, server)
        say(f"3. applying the objects of `gpuppetti manifests --mode {settings.mode}` by server-side apply (config: "
            f"{config_source})")
        started = time.monotonic()
        for obj in objects:
            try:
                await api.apply(obj)
            except ApiError as exc:
                raise InstallError(str(exc)) from None
            say(f"  {obj['kind']} {obj['metadata']['name']}")
        say(f"4. labelling {', '.join(nodes)} {manifests.MODE_LABEL}={settings.mode} (where the DaemonSet runs)")
        for node in nodes:
            try:
                await api.label_node(node, {manifests.MODE_LABEL: settings.mode})
            except ApiError as exc:
                raise InstallError(str(exc)) from None
        what = ("the GPUs are allocatable" if settings.mode == "plugin" else
                "the devices are published in ResourceSlices")
        say(f"5. waiting until {what} (up to {settings.timeout:g}s)")
        outcome.served = await _wait_served(api, settings, nodes, served_names(config))
        outcome.seconds_to_first_slice = time.monotonic() - started
        for node, served in outcome.served.items():
            say(f"  node {node}: {served}")
        say(f"  first slice {'allocatable' if settings.mode == 'plugin' else 'published'} "
            f"{outcome.seconds_to_first_slice:.1f}s after the first object was applied "
            f"({time.monotonic() - begun:.1f}s since the command started)")
        say("6. running the smoke pod, which asks for one slice and prints it as the Vulkan layer shows it")
        resource = next(iter(outcome.served.values())).split("=", 1)[0] if settings.mode == "plugin" else None
        smoke_image = settings.smoke_image or (KRUNKIT_SMOKE_IMAGE if cluster.driver == "krunkit" else SMOKE_IMAGE)
        outcome.smoke_log = await _smoke(api, settings, resource, smoke_image)
        for line in outcome.smoke_log.rstrip().splitlines():
            say(f"  | {line}")
        say(next_steps(settings, cluster, resource))
    return outcome


def _chosen_nodes(cluster: Cluster, given: Sequence[str]) -> list[str]:
    unknown = [node for node in given if node not in cluster.nodes]
    if unknown:
        raise InstallError(f"--node {unknown[0]}: the cluster has no such node (it has {', '.join(cluster.nodes)})",
                           bad_input=True)
    return list(given) or list(cluster.nodes)


async def _wait_served(api: InstallApi, settings: Settings, nodes: Sequence[str], names: Collection[str]
                       ) -> dict[str, str]:
    deadline = time.monotonic() + settings.timeout
    component = manifests.COMPONENTS[settings.mode]
    running_since: dict[str, float] = {}
    while True:
        try:
            pods = await api.pods(settings.namespace, {"app.kubernetes.io/component": component})
            # Only where gpuppetti's own pod is ready: another plugin's resources on a node are not its.
            ready = ready_nodes(pods)
            served = await _served(api, settings.mode, [node for node in nodes if node in ready], names)
            if served:
                return served
            for pod in pods:
                name = pod["metadata"]["name"]
                if (pod.get("status") or {}).get("phase") == "Running":
                    running_since.setdefault(name, time.monotonic())
                log = None
                if time.monotonic() - running_since.get(name, time.monotonic()) > GRACE_S:
                    with contextlib.suppress(ApiError):
                        log = await api.log(settings.namespace, name)
                if (problem := daemon_problem(pod, log)) is not None:
                    raise InstallError(problem)
        except ApiError as exc:
            raise InstallError(str(exc)) from None
        if time.monotonic() > deadline:
            raise InstallError(f"no GPU served within {settings.timeout:g}s on {', '.join(nodes)}: see `kubectl -n "
                               f"{settings.namespace} describe daemonset gpuppetti-{component}` and its pods' logs")
        await asyncio.sleep(0.5)


async def _served(api: InstallApi, mode: manifests.Mode, nodes: Sequence[str], names: Collection[str]
                  ) -> dict[str, str]:
    if mode == "dra":
        return {node: f"{count} device{'s' if count != 1 else ''} of {manifests.DRIVER}"
                for node, count in slice_devices(await api.slices(), nodes).items()}
    served = {}
    for node in nodes:
        resources = extended_resources(await api.node(node), names)
        if resources:
            served[node] = ", ".join(f"{name}={count}" for name, count in sorted(resources.items()))
    return served


async def _smoke(api: InstallApi, settings: Settings, resource: str | None, image: str) -> str:
    objects = smoke_objects(settings, resource, image)
    try:
        # A smoke pod of an earlier install goes first: a pod's spec cannot be changed.
        for obj in reversed(objects):
            await api.delete(obj)
        deadline = time.monotonic() + settings.timeout
        while await api.pod(settings.namespace, SMOKE_POD) is not None:
            if time.monotonic() > deadline:
                raise InstallError(f"the smoke pod of an earlier install is still going after {settings.timeout:g}s")
            await asyncio.sleep(0.5)
        for obj in objects:
            await api.apply(obj)
        while True:
            pod = await api.pod(settings.namespace, SMOKE_POD) or {}
            status = pod.get("status") or {}
            if status.get("phase") in ("Succeeded", "Failed"):
                log = await api.log(settings.namespace, SMOKE_POD)
                if status["phase"] == "Failed":
                    raise InstallError(f"the smoke pod failed: {log.strip().splitlines()[-1] if log.strip() else ''}")
                return log
            if time.monotonic() > deadline:
                why = "; ".join(f"{c.get('reason')}: {c.get('message')}" for c in status.get("conditions") or []
                                if c.get("status") == "False" and c.get("message"))
                raise InstallError(f"the smoke pod did not finish within {settings.timeout:g}s"
                                   + (f" ({why})" if why else "") + f": kubectl -n {settings.namespace} describe pod "
                                   f"{SMOKE_POD}")
            await asyncio.sleep(0.5)
    except ApiError as exc:
        raise InstallError(str(exc)) from None


def next_steps(settings: Settings, cluster: Cluster, resource: str | None) -> str:
    ns = settings.namespace
    daemonset = f"ds/gpuppetti-{manifests.COMPONENTS[settings.mode]}"
    asking = (f"resources.limits {{{resource}: 1}}" if settings.mode == "plugin" else
              f"a ResourceClaim of DeviceClass {manifests.DRIVER} (see deploy/examples/dra/)")
    lines = [
        "done. Next:",
        f"  kubectl -n {ns} logs {SMOKE_POD}    # what the smoke pod printed",
        f"  give a pod a slice with {asking}; in it, gpuppetti-vkinfo shows the slice",
        f"  kubectl -n {ns} exec {daemonset} -- gpuppetti top    # who holds which slice",
        "  gpuppetti uninstall    # removes all of it again",
    ]
    if cluster.driver == "krunkit":
        lines.insert(4, "  gpuppetti host-agent on the Mac gives the VM its GPU's model, cores and memory "
                        "(docs/apple-silicon.md)")
    return "\n".join(lines)


# -- uninstall --------------------------------------------------------------------------------------------------

async def uninstall(settings: Settings, say: Callable[[str], None]) -> list[str]:
    """Remove every object install made, the smoke pod and the nodes' gpuppetti labels; returns what stays on the
    nodes' disks. Raises InstallError."""
    say("1. finding the cluster")
    async with connected(settings, say) as (api, cluster, _):
        say(f"  {cluster.describe()}")
        try:
            return await _uninstall(api, settings, cluster, say)
        except ApiError as exc:
            raise InstallError(str(exc)) from None


async def _uninstall(api: InstallApi, settings: Settings, cluster: Cluster, say: Callable[[str], None]
                     ) -> list[str]:
    objects = all_objects(settings.namespace)
    ns = settings.namespace
    say("2. stopping the daemons (each removes its sockets, CDI specs and slices as it stops)")
    for obj in objects:
        if obj["kind"] == "DaemonSet" and await api.delete(obj):
            say(f"  deleted DaemonSet {obj['metadata']['name']}")
    await _until(lambda: _daemon_pods(api, ns), settings.timeout, "the daemons' pods to stop")
    say("3. deleting the smoke pod and gpuppetti's objects")
    for obj in smoke_objects(replace(settings, mode="dra"), None, SMOKE_IMAGE):
        if await api.delete(obj):
            say(f"  deleted {obj['kind']} {ns}/{SMOKE_POD}")
    for obj in objects:
        if obj["kind"] != "DaemonSet" and await api.delete(obj):
            say(f"  deleted {obj['kind']} {obj['metadata']['name']}")
    namespace = objects[-1]
    await _until(lambda: api.exists(namespace), settings.timeout, f"namespace {ns} to go")
    # A daemon killed before it could clean up leaves its slices; the kubelet removes them only when it restarts.
    if count := await api.delete_slices():
        say(f"  deleted {count} ResourceSlice(s) of {manifests.DRIVER}")
    say("4. removing gpuppetti's node labels")
    for node in cluster.nodes:
        found = (await api.node(node)).get("metadata", {}).get("labels") or {}
        ours = {key: None for key in found if key.startswith(LABEL_PREFIX)}
        if ours:
            await api.label_node(node, ours)  # type: ignore[arg-type]
            say(f"  {node}: {', '.join(sorted(ours))}")
    return left_on_disk(settings, cluster)


async def _daemon_pods(api: InstallApi, namespace: str) -> bool:
    pods = await api.pods(namespace, {"app.kubernetes.io/part-of": "gpuppetti"})
    return any(pod["metadata"]["name"] != SMOKE_POD for pod in pods)


async def _until(busy: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while await busy():
        if time.monotonic() > deadline:
            raise InstallError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.5)


def left_on_disk(settings: Settings, cluster: Cluster) -> list[str]:
    """What stays on each node's disk: nothing in the API, but the layer's directory and the image."""
    layer = str(manifests.Options().vulkan_layer_dir)
    left = [f"{layer}: the Vulkan layer and its ledgers' sockets (the daemons' hostPath); on each node: "
            f"rm -rf {layer}"]
    image = settings.image or manifests.DEFAULT_IMAGE
    removal = {"minikube": f"minikube -p {cluster.name} image rm {image}",
               "kind": f"docker exec NODE crictl rmi {image}, for each of kind cluster {cluster.name}'s nodes",
               "k3s": f"sudo k3s crictl rmi {image}"}.get(cluster.kind, f"crictl rmi {image}, on each node")
    left.append(f"the image {image} in each node's image store: {removal}")
    left.append("where the device plugin ran, the node's status lists its resources, with none allocatable, until "
                "the kubelet forgets a stopped plugin (5 minutes)")
    return left
