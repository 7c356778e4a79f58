"""The cluster ``gpuppetti install`` finds through the kubeconfig, what kind it is, and the calls made to its API
server."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from lightkube import codecs
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core import exceptions as lightkube_errors
from lightkube.generic_resource import create_global_resource
from lightkube.resources.core_v1 import Node as _Node
from lightkube.resources.core_v1 import Pod as _Pod

from gpuppetti.commands import manifests
from gpuppetti.commands.install.errors import InstallError
from gpuppetti.commands.install.settings import Settings
from gpuppetti.node.kube import ApiError, Kube, NotFound

ClusterKind = Literal["minikube", "kind", "k3s", "node"]
FIELD_MANAGER = "gpuppetti-install"

_Slice = create_global_resource(group="resource.k8s.io", version="v1", kind="ResourceSlice",
                                plural="resourceslices")


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
