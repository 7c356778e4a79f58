"""`gpuppetti install` and `gpuppetti uninstall` on the real node, as a user runs them against a kube context.

The node is a real node of neither minikube, kind nor k3s: its image is the project's own, already imported (the
`image` fixture), so it is named with --image and not loaded. What the loopback-only node forces is the command's
own --host-network (no pod network, no kube-proxy); its GPUs are simulated (--config), and the smoke pod's image is
the sandbox's, whose Vulkan loader and lavapipe let gpuppetti-vkinfo show the slice through the layer.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.realnode import BUSYBOX, RealNode, wait_for, write_config
from tests.cluster.test_enforced_slices import vulkan_image
from tests.helpers import run_cli

__all__ = ["vulkan_image"]  # the fixture, from the enforced slices' tests

GPU = "    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 2Gi, count: 1}\n"
SIMULATED = f"version: v1\nbackend: simulated\nsimulated:\n  gpus:\n{GPU}"
PLUGIN = SIMULATED + "sharing:\n  timeSlicing:\n    resources: [{name: apple.com/gpu, replicas: 4}]\n"
# A claim that asks for no capacity of a consumable GPU gets a quarter of it (shares: 4, the default).
DRA = SIMULATED + "dra: {slicing: consumable}\n"
LAYER = Path("/var/lib/gpuppetti")


@pytest.fixture
def installing(node: RealNode) -> Iterator[None]:
    """The layer's directory goes again after, unless it was there; uninstall runs whatever the test did."""
    existed = LAYER.exists()
    yield
    run_cli("uninstall", "--kubeconfig", str(node.kubeconfig), "--timeout", "120", timeout=300)
    if not existed:
        shutil.rmtree(LAYER, ignore_errors=True)


def install(node: RealNode, *args: str) -> tuple[int, str, str]:
    result = run_cli("install", "--kubeconfig", str(node.kubeconfig), "--host-network", "--timeout", "120", *args,
                     timeout=600)
    print(result.stdout + result.stderr, file=sys.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, result.stdout, result.stderr


def nothing_left(node: RealNode) -> None:
    assert not node.kubectl("get", "namespace", "gpuppetti", "--ignore-not-found", "-o", "name").strip()
    for kind in ("clusterroles", "clusterrolebindings", "deviceclasses"):
        assert not node.kubectl("get", kind, "-l", "app.kubernetes.io/part-of=gpuppetti", "-o", "name").strip(), kind
    assert not node.kubectl("get", "resourceslices", "-o", "name").strip()
    labels = node.get("node", node.name)["metadata"].get("labels", {})
    assert not [key for key in labels if key.startswith("gpuppetti.dev/")], labels


def uninstall(node: RealNode) -> str:
    result = run_cli("uninstall", "--kubeconfig", str(node.kubeconfig), "--timeout", "120", timeout=300)
    print(result.stdout, file=sys.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    nothing_left(node)
    return result.stdout


def first_slice(stdout: str) -> float:
    found = re.search(r"first slice (?:allocatable|published) ([0-9.]+)s after", stdout)
    assert found, stdout
    seconds = float(found.group(1))
    # The figure the issue asks for (under 60 s with the image built): printed, not asserted.
    print(f"install: first slice {seconds:.1f}s after the first object was applied", file=sys.stderr)
    return seconds


def test_install_both_modes_each_ending_with_the_smoke_pods_slice_then_uninstall_leaves_nothing(
        node: RealNode, image: str, workdir: Path, vulkan_image: str, installing: None) -> None:
    plugin = write_config(workdir, "plugin.yaml", PLUGIN)
    code, out, err = install(node, "--image", image, "--config", str(plugin), "--smoke-image", vulkan_image)
    assert code == 0, out + err
    assert "a Kubernetes cluster that is not minikube, kind or k3s, 1 node: localhost" in out
    assert "node localhost: apple.com/gpu=4" in out
    # The smoke pod's slice as the layer shows it: a quarter of the 2 GiB GPU.
    assert "GPUPPETTI_VK_SLICES=any=536870912" in out, out
    assert re.search(r"\| +heap 0: 512 MiB", out), out
    first_slice(out)
    assert node.get("node", node.name)["metadata"]["labels"]["gpuppetti.dev/mode"] == "plugin"
    uninstall(node)
    # The kubelet lists the resource, with nothing allocatable, until its grace period for a stopped plugin ends.
    node.wait_allocatable("apple.com/gpu", 0)

    dra = write_config(workdir, "dra.yaml", DRA)
    code, out, err = install(node, "--mode", "dra", "--image", image, "--config", str(dra),
                             "--smoke-image", vulkan_image)
    assert code == 0, out + err
    assert "node localhost: 1 device of gpu.gpuppetti.dev" in out, out
    assert re.search(r"\| +heap 0: 512 MiB", out), out
    first_slice(out)
    said = uninstall(node)
    assert "/var/lib/gpuppetti/vulkan" in said, "what stays on the node's disk is named"


def test_a_node_without_gpus_is_one_line(node: RealNode, image: str, installing: None) -> None:
    code, out, err = install(node, "--image", image)
    assert code == 1, out + err
    assert err.count("\n") == 1 and "found no GPUs" in err, err


# A container given a slice tries to write where the node's files are mounted (its ledger's directory,
# /run/gpuppetti/vulkan, and the layer's files), lists what is there, and says how each of them is mounted; then it
# waits to be deleted.
FILL = ("cd /run/gpuppetti/vulkan && ls; "
        "if dd if=/dev/zero of=fill bs=1024 count=65536 2>/tmp/dd.err; then echo FILL=all; else echo FILL=refused; fi; "
        "cat /tmp/dd.err; i=0; while [ $i -lt 200 ] && touch f$i 2>/dev/null; do i=$((i+1)); done; echo FILES=$i; "
        "if (: >> /usr/lib/gpuppetti/libVkLayer_gpuppetti.so) 2>/dev/null; then echo LIB=written; fi; "
        "grep -E ' (/run/gpuppetti|/usr/lib/gpuppetti|/usr/local/bin/gpuppetti|/etc/vulkan)' /proc/mounts | "
        "sed 's/^/MOUNT /'; echo DONE; sleep 3600")


def _fill_pod(mode: str, namespace: str, image: str) -> list[dict[str, Any]]:
    container: dict[str, Any] = {"name": "fill", "image": image, "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", FILL]}
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 1, "containers": [container]}
    metadata = {"name": "fill", "namespace": namespace}
    objects: list[dict[str, Any]] = []
    if mode == "dra":
        objects.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": metadata,
                        "spec": {"spec": {"devices": {"requests": [
                            {"name": "gpu", "exactly": {"deviceClassName": "gpu.gpuppetti.dev"}}]}}}})
        container["resources"] = {"claims": [{"name": "gpu"}]}
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "fill"}]
    else:
        container["resources"] = {"limits": {"apple.com/gpu": 1}}
    return [*objects, {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}]


def test_a_tenant_writes_nothing_on_the_node_in_both_modes(node: RealNode, image: str, workdir: Path,
                                                          installing: None) -> None:
    for mode, config in (("plugin", PLUGIN), ("dra", DRA)):
        path = write_config(workdir, f"{mode}.yaml", config)
        # The flag of the bounded directories is accepted once more, and said to do nothing.
        code, out, err = install(node, "--mode", mode, "--image", image, "--config", str(path),
                                 "--bound-allocation-dirs", "--smoke-image", BUSYBOX)
        assert code == 0, out + err
        assert "--bound-allocation-dirs no longer does anything" in err, err
        component = "device-plugin" if mode == "plugin" else "dra"
        [daemon] = node.get("pods", namespace="gpuppetti",
                            selector=f"app.kubernetes.io/component={component}")["items"]
        context = daemon["spec"]["containers"][0]["securityContext"]
        assert not context.get("privileged") and context["capabilities"] == {"drop": ["ALL"]}, context
        node.apply(_fill_pod(mode, "default", BUSYBOX))
        node.wait_running("fill")
        def done() -> str | None:
            text = node.logs("fill")
            return text if "DONE" in text else None
        printed = wait_for("the fill pod's DONE", done, 120)
        print(printed, file=sys.stderr)
        assert printed.split("\n", 1)[0].strip() == "ledger.sock", "the directory holds the daemon's socket alone"
        assert "FILL=refused" in printed and "Read-only file system" in printed, printed
        assert "FILES=0" in printed and "LIB=written" not in printed, printed
        mounts = [line.split() for line in printed.splitlines() if line.startswith("MOUNT ")]
        assert len(mounts) == 4, printed
        assert all(fields[4].split(",")[0] == "ro" for fields in mounts), printed
        node.delete("pod", "fill", "--grace-period=0", "--force")
        node.delete("resourceclaimtemplate", "fill")
        uninstall(node)
