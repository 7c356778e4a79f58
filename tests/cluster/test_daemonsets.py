"""The shipped DaemonSets, from the project's own image, with the shipped RBAC and security settings.

What this loopback-only node forces, and nothing else, is changed in what `gpuppetti manifests` renders:
- `hostNetwork: true`: the node has no pod network (pods get only a loopback interface), so the probes could not
  reach a pod's own address, and the API server listens on the machine's loopback only;
- for the DRA driver, `KUBERNETES_SERVICE_HOST=127.0.0.1` and `KUBERNETES_SERVICE_PORT=16443`: there is no
  kube-proxy, so the in-cluster service address leads nowhere.
The image (`--image`) and the config (`--config`, simulated GPUs: this node has none) are the command's own
options, as a user passes them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.realnode import IMAGE_VENV, RealNode, pod, wait_for, write_config

NAMESPACE = "gpuppetti"
MODE_LABEL = "gpuppetti.dev/mode"
SIMULATED = ("version: v1\nbackend: simulated\nsimulated:\n  gpus:\n"
             "    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: 2}\n")
PLUGIN_CONFIG = SIMULATED + "sharing:\n  timeSlicing:\n    resources: [{name: apple.com/gpu, replicas: 4}]\n"
DRA_CONFIG = SIMULATED + "dra: {slicing: whole}\n"


def render(mode: str, image: str, config: Path) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "gpuppetti", "manifests", "--mode", mode, "--image", image,
                          "--config", str(config)], check=True, capture_output=True, text=True).stdout
    objects = [o for o in yaml.safe_load_all(out) if o]
    for obj in objects:
        if obj["kind"] != "DaemonSet":
            continue
        spec = obj["spec"]["template"]["spec"]
        spec["hostNetwork"] = True
        if mode == "dra":
            spec["containers"][0]["env"] += [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                                             {"name": "KUBERNETES_SERVICE_PORT", "value": "16443"}]
    return objects


def daemonset(node: RealNode, name: str) -> Any:
    return node.get("daemonset", name, NAMESPACE)


def ready_pods(node: RealNode, component: str) -> list[Any]:
    pods = node.get("pods", namespace=NAMESPACE, selector=f"app.kubernetes.io/component={component}")["items"]
    return [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                   for c in p["status"].get("conditions", []))]


def _healthz() -> int | None:
    try:
        with urllib.request.urlopen("http://127.0.0.1:9400/healthz", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def doctor_in_pod(node: RealNode, component: str) -> dict[str, dict[str, Any]]:
    """`gpuppetti doctor` in the component's pod, which sees the node as the daemon does (its env), asked only for
    the runtime's socket: this node's containerd listens under the state directory, not at a usual path."""
    # The pod shares the node's network here: its endpoint is the node's 127.0.0.1:9400.
    wait_for(f"the {component} pod's /healthz answering 200", lambda: _healthz() == 200, 120)
    pods = node.get("pods", namespace=NAMESPACE, selector=f"app.kubernetes.io/component={component}")["items"]
    [name] = [p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running"]
    socket = Path("/host") / (node.dir / "containerd" / "containerd.sock").relative_to("/")
    result = subprocess.run([str(node.dir / "bin" / "kubectl"), "-n", NAMESPACE, "exec", name, "--",
                             str(IMAGE_VENV / "bin" / "gpuppetti"), "doctor", "--json", "--runtime-endpoint",
                             str(socket)], env=node.env, capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in result.stderr, result.stderr
    checks = {check["check"]: check for check in json.loads(result.stdout)}
    failed = {n: c for n, c in checks.items() if c["status"] == "fail"}
    assert (result.returncode, failed) == (0, {}), result.stdout
    return checks


@pytest.fixture
def label(node: RealNode) -> Iterator[None]:
    # The DaemonSets install the Vulkan layer on the host, where they run: gone again after, unless it was there.
    layer = Path("/var/lib/gpuppetti")
    existed = layer.exists()
    yield
    node.kubectl("label", "node", node.name, f"{MODE_LABEL}-", check=False)
    node.delete("namespace", NAMESPACE)
    if not existed:
        shutil.rmtree(layer, ignore_errors=True)


def test_both_daemonsets_run_from_the_image_one_mode_per_node(
        node: RealNode, image: str, workdir: Path, label: None) -> None:
    plugin = render("plugin", image, write_config(workdir, "plugin.yaml", PLUGIN_CONFIG))
    dra = render("dra", image, write_config(workdir, "dra.yaml", DRA_CONFIG))
    node.apply(plugin)
    node.apply(dra)
    # Each mode keeps its own config: applying the DRA base left the plugin's alone.
    maps = node.get("configmaps", namespace=NAMESPACE, selector="app.kubernetes.io/part-of=gpuppetti")["items"]
    configs = {c["metadata"]["name"]: c["data"].get("config.yaml") for c in maps}
    assert configs == {"gpuppetti-device-plugin-config": PLUGIN_CONFIG, "gpuppetti-dra-config": DRA_CONFIG}
    # No node is labelled yet: neither runs anywhere.
    for name in ("gpuppetti-device-plugin", "gpuppetti-dra"):
        def observed(name: str = name) -> bool:
            return bool(daemonset(node, name)["status"].get("observedGeneration"))
        wait_for(f"{name} observed", observed)
        assert daemonset(node, name)["status"]["desiredNumberScheduled"] == 0

    node.kubectl("label", "node", node.name, f"{MODE_LABEL}=plugin")
    wait_for("the device plugin pod Ready", lambda: ready_pods(node, "device-plugin"), 120)
    node.wait_allocatable("apple.com/gpu", 8)
    node.apply([pod("dp-user", limits={"apple.com/gpu": 1})])
    node.wait_running("dp-user")
    assert node.env_of("dp-user")["GPUPPETTI_SHARING"] == "time-slicing"
    assert daemonset(node, "gpuppetti-dra")["status"]["desiredNumberScheduled"] == 0, "one mode per node"
    node.delete("pod", "dp-user", "--grace-period=0", "--force")
    checks = doctor_in_pod(node, "device-plugin")
    assert checks["kubelet device plugins"]["status"] == "ok"
    assert checks["kubelet plugin registry"]["status"] == "skip", "the device plugin's pod does not mount it"
    assert checks["CDI in the runtime"]["detail"].startswith("containerd 2.3.4 (CRI v1) applies CDI devices")
    assert checks["daemon"]["detail"] == "http://127.0.0.1:9400/healthz: ok"

    node.kubectl("label", "node", node.name, f"{MODE_LABEL}=dra", "--overwrite")
    wait_for("the device plugin pod gone", lambda: not node.get(
        "pods", namespace=NAMESPACE, selector="app.kubernetes.io/component=device-plugin")["items"], 120)
    wait_for("the DRA driver pod Ready (registered, slices published)", lambda: ready_pods(node, "dra"), 120)
    checks = doctor_in_pod(node, "dra")
    assert (checks["kubelet plugin registry"]["status"], checks["kubelet device plugins"]["status"]) == ("ok", "skip")
    # Named for the pod, so that a rolling update's next pod registers beside it.
    [uid] = [p["metadata"]["uid"] for p in node.get(
        "pods", namespace=NAMESPACE, selector="app.kubernetes.io/component=dra")["items"]]
    assert f"gpu.gpuppetti.dev-{uid}-reg.sock" in checks["kubelet plugin registry"]["detail"]
    node.apply([{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one"},
                 "spec": {"spec": {"devices": {"requests": [
                     {"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuppetti.dev"}}]}}}},
                pod("dra-user", claims=[("gpu", "template", "one")])])
    node.wait_running("dra-user")
    assert node.env_of("dra-user")["GPUPPETTI_VISIBLE_DEVICES"] in ("sim-apple-0", "sim-apple-1")
    # The claim's status, written with the shipped RBAC and the pod's own token (Kubernetes 1.36 checks that the
    # driver writes only its own entries, from the claim's node).
    [claim] = [c["metadata"]["name"] for c in node.get("resourceclaims")["items"]
               if c["metadata"]["name"].startswith("dra-user-")]

    def ready() -> list[Any] | None:
        entries = node.get("resourceclaims", claim)["status"].get("devices") or []
        return [c for e in entries for c in e.get("conditions", []) if c["type"] == "Ready"] or None

    assert wait_for(f"ResourceClaim {claim}'s Ready condition", ready, 30)[0]["status"] == "True"
    node.delete("pod", "dra-user")
    node.delete("resourceclaimtemplate", "one")
