"""The Helm chart, installed and uninstalled on the real node by Helm itself (helm-python-sdk: Helm v4's library, no
helm binary), in both modes.

Everything the pods run with is the chart's, from its values: the image the cluster tier packs from the clean wheel
(`image.repository`, `image.tag`, `image.pullPolicy: Never`), a config of simulated GPUs (`config`: this node has
none), and a Vulkan layer directory in the node's state directory (`vulkanLayerDir`) rather than the host's /var/lib.
What this loopback-only node forces, and nothing else, is patched into the DaemonSet after Helm installs it, as
tests/cluster/test_daemonsets.py changes what `gpuppetti manifests` renders: `hostNetwork: true` (the node has no
pod network) and, for the DRA driver, the API server's address (there is no kube-proxy).
"""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.realnode import RealNode, pod, wait_for

helm: Any = None
try:
    helm = importlib.import_module("helm_python")
except (ImportError, OSError) as exc:  # no wheel for this platform, or its native library does not load
    pytestmark = pytest.mark.skip(reason=f"the Helm SDK (helm-python-sdk, in the dev extra) cannot be imported: {exc}")

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpuppetti"
RELEASE = "gpuppetti"
NAMESPACE = "gpuppetti-helm"
MODE_LABEL = "gpuppetti.dev/mode"
DRIVER = "gpu.gpuppetti.dev"
SIMULATED = {"version": "v1", "backend": "simulated",
             "simulated": {"gpus": [{"model": "Apple M3 Max", "vendor": "apple", "cores": 40, "memory": "48Gi",
                                     "count": 2}]}}
CONFIGS = {
    "plugin": {**SIMULATED, "sharing": {"timeSlicing": {"resources": [{"name": "apple.com/gpu", "replicas": 4}]}}},
    "dra": {**SIMULATED, "dra": {"slicing": "whole"}},
}
COMPONENTS = {"plugin": "device-plugin", "dra": "dra"}


def _ready_pods(node: RealNode, component: str) -> list[Any]:
    pods = node.get("pods", namespace=NAMESPACE, selector=f"app.kubernetes.io/component={component}")["items"]
    return [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                   for c in p["status"].get("conditions", []))]


def _owned(node: RealNode) -> list[str]:
    """What the release made that is still there: every kind the chart renders, by Helm's instance label."""
    kinds = "daemonsets,configmaps,serviceaccounts,clusterroles,clusterrolebindings,deviceclasses"
    out = node.kubectl("get", kinds, "-A", "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name")
    return out.split()


@pytest.fixture
def helm_config(node: RealNode) -> Iterator[Any]:
    """Helm's connection to the node, and the node as it was after: no release, no label, no namespace."""
    layer = node.dir / "helm-vulkan"
    # The cluster-wide objects that `kubectl apply` left from the other tests' manifests: Helm installs nothing over
    # an object of the same name that it does not own, as it would refuse on a user's cluster too.
    node.delete("deviceclasses,clusterroles,clusterrolebindings", "-l", "app.kubernetes.io/part-of=gpuppetti")
    with helm.Config(kubeconfig_path=node.kubeconfig, namespace=NAMESPACE) as config:
        try:
            yield config
        finally:
            config.uninstall(RELEASE, ignore_not_found=True, wait="watcher", timeout=120)
            node.kubectl("label", "node", node.name, f"{MODE_LABEL}-", check=False)
            node.delete("namespace", NAMESPACE)
            shutil.rmtree(layer, ignore_errors=True)


def _install(node: RealNode, config: Any, image: str, mode: str) -> dict[str, Any]:
    repository, _, tag = image.rpartition(":")
    values = {"mode": mode, "config": CONFIGS[mode], "vulkanLayerDir": str(node.dir / "helm-vulkan"),
              "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"}}
    release: dict[str, Any] = config.install(CHART, RELEASE, values, namespace=NAMESPACE, create_namespace=True,
                                             timeout=120)
    assert (release["status"], release["chart_name"]) == ("deployed", "gpuppetti")
    # NOTES.txt: the command that lets the DaemonSet run anywhere.
    assert f"kubectl label node NODE {MODE_LABEL}={mode}" in release["notes"]
    component = COMPONENTS[mode]
    patch: dict[str, Any] = {"spec": {"template": {"spec": {"hostNetwork": True}}}}
    if mode == "dra":
        patch["spec"]["template"]["spec"]["containers"] = [{"name": component, "env": [
            {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
            {"name": "KUBERNETES_SERVICE_PORT", "value": "16443"}]}]
    node.kubectl("-n", NAMESPACE, "patch", "daemonset", f"gpuppetti-{component}", "--type=strategic", "-p",
                 json.dumps(patch))
    return release


def _uninstall(node: RealNode, config: Any, component: str) -> None:
    assert _owned(node), "the release's objects, before it is uninstalled"
    config.uninstall(RELEASE, wait="watcher", timeout=120)
    assert _owned(node) == []
    wait_for(f"the {component} pod gone", lambda: not node.get(
        "pods", namespace=NAMESPACE, selector=f"app.kubernetes.io/component={component}")["items"], 120)
    assert not [r for r in config.list() if r["name"] == RELEASE]


def test_helm_installs_the_dra_driver_which_publishes_slices_and_uninstalls_it(
        node: RealNode, image: str, helm_config: Any) -> None:
    _install(node, helm_config, image, "dra")
    classes = {c["metadata"]["name"] for c in node.get("deviceclasses")["items"]}
    assert {DRIVER, f"apple.{DRIVER}"} <= classes
    node.kubectl("label", "node", node.name, f"{MODE_LABEL}=dra", "--overwrite")
    wait_for("the DRA driver pod Ready (registered, slices published)", lambda: _ready_pods(node, "dra"), 120)

    seen: list[list[str]] = []

    def devices() -> bool:
        slices = [s for s in node.get("resourceslices")["items"]
                  if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == node.name]
        seen.append(sorted(d["name"] for s in slices for d in s["spec"].get("devices", [])))
        # An earlier driver's pool (another test's config) may still be there until this one's replaces it.
        return seen[-1] == ["gpu-apple-0", "gpu-apple-1"]

    try:
        wait_for("the driver's ResourceSlices: the config's two simulated GPUs", devices, 90)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; devices seen: {seen[-3:]}") from None
    assert (node.dir / "helm-vulkan").is_dir(), "vulkanLayerDir reached the node"
    node.apply([{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one"},
                 "spec": {"spec": {"devices": {"requests": [
                     {"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}}},
                pod("helm-dra-user", claims=[("gpu", "template", "one")])])
    node.wait_running("helm-dra-user")
    assert node.env_of("helm-dra-user")["GPUPPETTI_VISIBLE_DEVICES"] in ("sim-apple-0", "sim-apple-1")
    node.delete("pod", "helm-dra-user", "--grace-period=0", "--force")
    node.delete("resourceclaimtemplate", "one")
    _uninstall(node, helm_config, "dra")
    assert DRIVER not in {c["metadata"]["name"] for c in node.get("deviceclasses")["items"]}


def test_helm_installs_the_device_plugin_whose_gpus_are_allocatable_and_uninstalls_it(
        node: RealNode, image: str, helm_config: Any) -> None:
    _install(node, helm_config, image, "plugin")
    node.kubectl("label", "node", node.name, f"{MODE_LABEL}=plugin", "--overwrite")
    wait_for("the device plugin pod Ready", lambda: _ready_pods(node, "device-plugin"), 120)
    node.wait_allocatable("apple.com/gpu", 8)
    _uninstall(node, helm_config, "device-plugin")
