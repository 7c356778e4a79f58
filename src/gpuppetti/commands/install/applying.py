"""What ``gpuppetti install`` applies: the objects of ``gpuppetti manifests`` with the config it chose, applied by
server-side apply, and the mode label on the nodes that run the daemon; and every object it may have made, for
uninstall."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from gpuppetti.commands import manifests
from gpuppetti.commands.install.cluster import Cluster, InstallApi
from gpuppetti.commands.install.errors import InstallError
from gpuppetti.commands.install.settings import Settings
from gpuppetti.core.config import ConfigError
from gpuppetti.node.kube import ApiError


def chosen_nodes(cluster: Cluster, given: Sequence[str]) -> list[str]:
    """The nodes to label: those given with --node, each one of the cluster's, or else all of them. Raises
    InstallError."""
    unknown = [node for node in given if node not in cluster.nodes]
    if unknown:
        raise InstallError(f"--node {unknown[0]}: the cluster has no such node (it has {', '.join(cluster.nodes)})",
                           bad_input=True)
    return list(given) or list(cluster.nodes)


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
            # On the node's network a port is the node's (the API server makes it a hostPort), and the scheduler
            # would keep a surging DaemonSet's new pod off the node while the old one holds it.
            spec["containers"][0].pop("ports", None)
    return objects


async def apply(api: InstallApi, objects: Sequence[dict[str, Any]], say: Callable[[str], None]) -> None:
    """Apply each object in turn, saying which. Raises InstallError."""
    for obj in objects:
        try:
            await api.apply(obj)
        except ApiError as exc:
            raise InstallError(str(exc)) from None
        say(f"  {obj['kind']} {obj['metadata']['name']}")


async def label(api: InstallApi, nodes: Sequence[str], mode: manifests.Mode) -> None:
    """Give each node the mode label, which the DaemonSet of ``mode`` selects its nodes by. Raises InstallError."""
    for node in nodes:
        try:
            await api.label_node(node, {manifests.MODE_LABEL: mode})
        except ApiError as exc:
            raise InstallError(str(exc)) from None


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
