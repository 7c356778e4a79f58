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

import pytest

from tests.cluster.realnode import RealNode, write_config
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
