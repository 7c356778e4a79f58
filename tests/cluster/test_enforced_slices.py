"""Enforced slices on the real node: pods whose containers run a Vulkan workload on lavapipe, given a slice by the
device plugin (Allocate's mounts) or by the DRA driver (a CDI spec that containerd applies), obtain exactly the
slice's memory, and where the config turns it on, their share of the GPU's time."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from gpuppetti.kubelet.sandbox import VULKAN_IMAGE, PodmanSandbox, vulkan_icd
from gpuppetti.layer.vulkan import BUILT, LIBRARY
from tests.cluster.realnode import RealNode, wait_for, write_config
from tests.cluster.test_dra import classes, template
from tests.cluster.test_dra import start as start_driver
from tests.helpers import run_cli

__all__ = ["classes"]  # the fixture, from the DRA tests

MIB = 2**20
GPU = "    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 2Gi, count: 1}\n"
PLUGIN = (f"version: v1\nbackend: simulated\nsimulated:\n  gpus:\n{GPU}"
          "sharing:\n  timeSlicing:\n    resources: [{name: apple.com/gpu, replicas: 4}]\n")
DRA = f"version: v1\nbackend: simulated\nsimulated:\n  gpus:\n{GPU}dra:\n  slicing: consumable\n"


@pytest.fixture(scope="module")
def vulkan_image(realnode: RealNode) -> str:
    """The sandbox's image (busybox, the host's Vulkan loader and lavapipe), imported into the node's containerd."""
    if not (BUILT / LIBRARY).exists():
        pytest.skip("the Vulkan layer is not built here (make native: needs a C compiler and libvulkan-dev)")
    if vulkan_icd() is None:
        pytest.skip("no Vulkan loader and lavapipe on this host (Debian: libvulkan1 mesa-vulkan-drivers)")
    sandbox = PodmanSandbox()
    if (problem := asyncio.run(sandbox.why_not())) is not None:
        pytest.skip(f"podman cannot build the Vulkan image here: {problem}")
    asyncio.run(sandbox.ensure_image())
    with tempfile.TemporaryDirectory(prefix="gp-vk-image-") as directory:
        archive = Path(directory) / "vulkan.tar"
        subprocess.run(["podman", "save", "--format", "docker-archive", "-o", str(archive), VULKAN_IMAGE],
                       check=True, capture_output=True)
        realnode.import_image(archive)
    return VULKAN_IMAGE


def workload(name: str, image: str, limits: dict[str, Any] | None = None,
             claims: list[tuple[str, str]] | None = None, args: tuple[str, ...] = ("--json", "--allocate", "16"),
             ) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "vk", "image": image, "imagePullPolicy": "Never",
                                 "command": ["/usr/local/bin/gpuppetti-vkinfo", *args]}
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container]}
    if limits:
        container["resources"] = {"limits": limits}
    if claims:
        container["resources"] = {"claims": [{"name": n} for n, _ in claims]}
        spec["resourceClaims"] = [{"name": n, "resourceClaimTemplateName": t} for n, t in claims]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def report(node: RealNode, name: str) -> dict[str, Any]:
    wait_for(f"pod {name} Succeeded", lambda: node.phase(name) == "Succeeded" or (
        node.phase(name) == "Failed" and pytest.fail(f"{name} failed: {node.logs(name)}")), 120)
    result: dict[str, Any] = json.loads(node.logs(name))
    return result


def test_device_plugin_slices_hold_their_containers(node: RealNode, workdir: Path, vulkan_image: str) -> None:
    path = write_config(workdir, "plugin.yaml", PLUGIN)
    daemon = node.gpuppetti("gpuppetti-plugin", "plugin", "--config", str(path), "--http-address", "127.0.0.1:0")
    daemon.wait_ready()
    daemon.wait_log("slices are enforced through the Vulkan layer")
    node.wait_allocatable("apple.com/gpu", 4)
    node.apply([workload("one-slice", vulkan_image, limits={"apple.com/gpu": 1}),
                workload("two-slices", vulkan_image, limits={"apple.com/gpu": 2})])
    one, two = report(node, "one-slice"), report(node, "two-slices")
    assert one["layer"] is True
    assert one["devices"][0]["heaps"][0]["size"] == 512 * MIB
    assert one["allocation"]["obtained"] == 512 * MIB
    assert two["allocation"]["obtained"] == 1024 * MIB


def test_a_consumable_claims_memory_through_containerd_cdi(
        node: RealNode, workdir: Path, classes: None, vulkan_image: str) -> None:
    start_driver(node, workdir, DRA)
    node.apply([template("vk-384", {"memory": "384Mi"}),
                workload("consumer", vulkan_image, claims=[("gpu", "vk-384")])])
    consumer = report(node, "consumer")
    assert consumer["layer"] is True
    assert consumer["devices"][0]["heaps"][0]["size"] == 384 * MIB
    assert consumer["allocation"]["obtained"] == 384 * MIB
    assert os.path.isdir(node.dir / "vulkan" / "ledgers")


def test_device_plugin_compute_shares_hold_their_containers(node: RealNode, workdir: Path, vulkan_image: str) -> None:
    path = write_config(workdir, "plugin.yaml", PLUGIN + "  enforceCompute: true\n")
    daemon = node.gpuppetti("gpuppetti-plugin", "plugin", "--config", str(path), "--http-address", "127.0.0.1:0")
    daemon.wait_ready()
    node.wait_allocatable("apple.com/gpu", 4)
    # One after the other, so that neither slows the other on the node's CPUs (lavapipe is the GPU here).
    busy = ("--busy", "3", "--fill", "32")
    node.apply([workload("whole-time", vulkan_image, limits={"apple.com/gpu": 4}, args=busy)])
    whole = report(node, "whole-time")["busy"]
    node.apply([workload("quarter-time", vulkan_image, limits={"apple.com/gpu": 1}, args=busy)])
    quarter = report(node, "quarter-time")["busy"]
    # Four replicas of four are the GPU's whole time (1000 thousandths: not throttled); one is a quarter of it.
    assert whole["gpu_seconds"] / whole["seconds"] >= 0.6, whole
    assert 0.1 <= quarter["gpu_seconds"] / quarter["seconds"] <= 0.4, quarter


def test_top_shows_the_pods_holding_memory(node: RealNode, workdir: Path, vulkan_image: str) -> None:
    """gpuppetti top against the device plugin on the real node: the kubelet's PodResources API names the pods."""
    path = write_config(workdir, "plugin.yaml", PLUGIN)
    daemon = node.gpuppetti("gpuppetti-plugin", "plugin", "--config", str(path), "--http-address", "127.0.0.1:0")
    daemon.wait_ready()
    node.wait_allocatable("apple.com/gpu", 4)
    holding = ("--json", "--allocate", "16", "--limit", "256", "--hold", "600")
    node.apply([workload("holder", vulkan_image, limits={"apple.com/gpu": 1}, args=holding)])
    url = daemon.http_url()

    def shown() -> list[dict[str, Any]]:
        result = run_cli("top", "--from", url, "--json")
        assert result.returncode == 0, result.stderr
        slices: list[dict[str, Any]] = json.loads(result.stdout)["slices"]
        return [s for s in slices if s["pod"] == "holder" and s["used_bytes"] == 256 * MIB]

    wait_for("top to show the holder pod's 256 MiB", lambda: bool(shown()), 120, 0.5)
    [held] = shown()
    assert (held["namespace"], held["container"], held["budget_bytes"]) == ("default", "vk", 512 * MIB)
    table = run_cli("top", "--from", url, "--once", env={"COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    assert all(len(line) <= 80 for line in table.stdout.splitlines())
    assert any("default/holder/vk" in line and "256 MiB" in line for line in table.stdout.splitlines())


def _holding(url: str) -> int:
    """What the processes of the namespace's slices hold, as the daemon's /v1/slices says (0 where it says nothing).
    Not by pod: a DRA driver learns a claim's pods when it prepares it, not when it restarts."""
    result = run_cli("top", "--from", url, "--json")
    if result.returncode != 0:
        return 0
    return sum(s["used_bytes"] for s in json.loads(result.stdout)["slices"] if s["namespace"] == "default")


@pytest.mark.parametrize("mode", ["plugin", "dra"])
def test_a_daemon_killed_and_started_again_under_a_running_pod_loses_nothing(
        node: RealNode, workdir: Path, classes: None, vulkan_image: str, mode: str) -> None:
    """The pod's process holds 320 MiB of its slice in its daemon's ledger; the daemon is SIGKILLed and started again
    (as a crashed or upgraded DaemonSet pod is): the pod runs on, and the new daemon's ledger holds its 320 MiB."""
    holding = ("--json", "--allocate", "64", "--limit", "320", "--hold", "600")
    if mode == "plugin":
        daemon = node.gpuppetti("gpuppetti-plugin", "plugin", "--config", str(write_config(workdir, "p.yaml", PLUGIN)),
                                "--http-address", "127.0.0.1:0")
        daemon.wait_ready()
        node.wait_allocatable("apple.com/gpu", 4)
        node.apply([workload("holder", vulkan_image, limits={"apple.com/gpu": 1}, args=holding)])
    else:
        daemon = start_driver(node, workdir, DRA)
        node.apply([template("vk-512", {"memory": "512Mi"}),
                    workload("holder", vulkan_image, claims=[("gpu", "vk-512")], args=holding)])
    url = daemon.http_url()
    wait_for("the holder's 320 MiB in the ledger", lambda: _holding(url) == 320 * MIB, 180, 0.5)
    daemon.kill9()
    daemon.start()
    daemon.wait_ready()
    url = daemon.http_url()
    # The pod's process reconnects as soon as the socket is back, and declares what it holds.
    wait_for("the holder's 320 MiB in the new daemon's ledger", lambda: _holding(url) == 320 * MIB, 60,
             0.5)
    assert node.phase("holder") == "Running", "the workload ran on"
