"""``gpuppetti uninstall``: every object install made deleted, the daemons first, the nodes' labels removed, and
what stays on the nodes' disks said."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpuppetti.commands import manifests
from gpuppetti.commands.install.applying import all_objects
from gpuppetti.commands.install.cluster import Cluster, InstallApi, connected
from gpuppetti.commands.install.errors import InstallError
from gpuppetti.commands.install.settings import Settings
from gpuppetti.commands.install.smoke import SMOKE_IMAGE, SMOKE_POD, smoke_objects
from gpuppetti.node.kube import ApiError

# Node labels the device plugin sets with --label-node, besides the mode label: all of them under this prefix.
LABEL_PREFIX = "gpuppetti.dev/"


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
