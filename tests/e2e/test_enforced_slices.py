"""Enforced slices through both front ends: what the device plugin's Allocate and the DRA driver's CDI spec give a
container, the allocation directories they keep and remove, and (where podman and lavapipe are here) what such a
container then obtains."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuppetti.core import cdi
from gpuppetti.core.model import ContainerEdits, DeviceNode, Mount
from gpuppetti.deviceplugin.enforcement import Enforcer, allocation_id
from gpuppetti.kubelet.emulator import ContainerAllocation, KubeletEmulator, Pod
from gpuppetti.kubelet.sandbox import PodmanSandbox
from gpuppetti.layer.vulkan import (
    ACCT_LOCK_BASE,
    ACCT_NOT_BEFORE_OFFSET,
    ACCT_SLOT_BYTES_OFFSET,
    BUILT,
    LIBRARY,
    LayerDir,
)
from gpuppetti.sharing.budgets import Budget
from tests.dra_support import DRIVER, Cluster
from tests.e2e.test_vulkan_layer import SIMULATED, vkinfo, why_not_here
from tests.helpers import Daemon, replicas, short_tmpdir

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not (BUILT / LIBRARY).exists(),
                                 reason="the Vulkan layer is not built here (make native: needs a C compiler and "
                                 "libvulkan-dev)")]

MIB = 2**20
SMALL = """\
version: v1
backend: simulated
simulated:
  gpus:
    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 2Gi, count: 2}
sharing:
  timeSlicing:
    resources:
      - {name: apple.com/gpu, replicas: 4}
"""
LAYER_MOUNTS = {"/etc/vulkan/implicit_layer.d/VkLayer_gpuppetti.json", "/usr/lib/gpuppetti/libVkLayer_gpuppetti.so",
                "/usr/local/bin/gpuppetti-vkinfo", "/run/gpuppetti/vulkan"}


def _edits_of(response: Any) -> ContainerEdits:
    edits = ContainerEdits(env=dict(response.envs))
    for mount in response.mounts:
        edits.add_mount(Mount(mount.container_path, mount.host_path, mount.read_only))
    for device in response.devices:
        edits.add_device_node(DeviceNode(device.container_path, device.host_path, device.permissions))
    return edits


async def test_the_plugin_gives_each_container_its_slices(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], plugin_dir: Path
) -> None:
    plugin = start_plugin(SMALL)
    await kubelet.wait_registered("apple.com/gpu")
    await plugin.wait_for_log("slices are enforced through the Vulkan layer")
    [one] = await kubelet.admit(Pod.simple("one", "apple.com/gpu", 1))
    [two] = await kubelet.admit(Pod.simple("two", "apple.com/gpu", 2))
    assert one.response.envs["GPUPPETTI_VK_SLICES"] == f"any={512 * MIB}"
    # Distributed: one slice on each GPU, each GPU's budget its own.
    assert two.response.envs["GPUPPETTI_VK_SLICES"] == f"any={512 * MIB},any={512 * MIB}"
    assert {m.container_path for m in one.response.mounts} == LAYER_MOUNTS
    layer = LayerDir(plugin_dir.parent / "vulkan")
    directories = layer.existing()
    assert directories == {allocation_id(one.device_ids): sorted(one.device_ids),
                           allocation_id(two.device_ids): sorted(two.device_ids)}
    accounting = layer.allocations / allocation_id(two.device_ids)
    assert sorted(p.name for p in accounting.glob("*.acct")) == ["slice-0.acct", "slice-1.acct"]
    # The kubelet freed pod one; its units, allocated again, replace its directory.
    kubelet.release("one")
    [again] = await kubelet.admit(Pod.simple("again", "apple.com/gpu", 1))
    assert again.device_ids == one.device_ids
    assert set(layer.existing()) == {allocation_id(again.device_ids), allocation_id(two.device_ids)}


async def test_a_whole_gpu_gets_no_layer(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(SMALL.replace("replicas: 4", "replicas: 1"))
    await kubelet.wait_registered("apple.com/gpu")
    [whole] = await kubelet.admit(Pod.simple("whole", "apple.com/gpu", 1))
    assert "GPUPPETTI_VK_SLICES" not in whole.response.envs
    assert not whole.response.mounts


async def test_enforcement_off_in_the_config(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(SMALL + "  enforceMemory: false\n")
    await kubelet.wait_registered("apple.com/gpu")
    [shared] = await kubelet.admit(Pod.simple("shared", "apple.com/gpu", 1))
    assert "GPUPPETTI_VK_SLICES" not in shared.response.envs


async def test_compute_shares_when_the_config_turns_them_on(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(SMALL + "  enforceCompute: true\n")
    await kubelet.wait_registered("apple.com/gpu")
    [one] = await kubelet.admit(Pod.simple("one", "apple.com/gpu", 1))
    [two] = await kubelet.admit(Pod.simple("two", "apple.com/gpu", 2))
    assert one.response.envs["GPUPPETTI_VK_COMPUTE"] == "250", "a quarter of the GPU's time, in thousandths"
    assert two.response.envs["GPUPPETTI_VK_COMPUTE"] == "250,250", "one share per slice, in the slices' order"
    assert two.response.envs["GPUPPETTI_VK_SLICES"] == f"any={512 * MIB},any={512 * MIB}"


async def test_compute_shares_without_memory_budgets(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(SMALL + "  enforceMemory: false\n  enforceCompute: true\n")
    await kubelet.wait_registered("apple.com/gpu")
    [one] = await kubelet.admit(Pod.simple("one", "apple.com/gpu", 1))
    assert one.response.envs["GPUPPETTI_VK_SLICES"] == "any=0", "the memory is not limited"
    assert one.response.envs["GPUPPETTI_VK_COMPUTE"] == "250"


async def test_no_compute_shares_by_default(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(SMALL)
    await kubelet.wait_registered("apple.com/gpu")
    [one] = await kubelet.admit(Pod.simple("one", "apple.com/gpu", 1))
    assert "GPUPPETTI_VK_COMPUTE" not in one.response.envs


async def test_directories_of_units_the_kubelet_freed_go(tmp_path: Path) -> None:
    base = short_tmpdir()
    socket = base / "pod-resources" / "kubelet.sock"
    async with KubeletEmulator(base / "dp", pod_resources=socket) as kubelet:
        layer = LayerDir(tmp_path / "vulkan")
        layer.install()
        enforcer = Enforcer(layer, socket, grace=0)
        await enforcer.start(set())
        budgets = [Budget(SIMULATED, 512 * MIB)]
        await enforcer.allocate(replicas("gpu-0", 0), budgets)
        await enforcer.allocate(replicas("gpu-0", 1), budgets)
        kubelet.allocations.append(ContainerAllocation("still", "c", "apple.com/gpu", ["gpu-0::1"], None, None))  # type: ignore[arg-type]
        await enforcer.check()
        assert set(layer.existing()) == {allocation_id(["gpu-0::1"])}, "gpu-0::0 is assigned to no container"


def _spec(cluster: Cluster, uid: str) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((cluster.cdi_dir / cdi.spec_filename(cdi.DEFAULT_KIND, uid)).read_text())
    return spec


def _spec_edits(device: dict[str, Any]) -> ContainerEdits:
    container = device["containerEdits"]
    edits = ContainerEdits(env=dict(line.split("=", 1) for line in container.get("env", [])))
    for mount in container.get("mounts", []):
        edits.add_mount(Mount(mount["containerPath"], mount["hostPath"], "ro" in mount.get("options", [])))
    return edits


DRA_SMALL = SMALL.split("sharing:")[0]


@pytest.mark.parametrize(("slicing", "result", "memory"), [
    ("consumable", {"device": "gpu-apple-0", "shareID": "a1b2c3", "consumedCapacity": {"memory": "256Mi"}},
     256 * MIB),
    ("partitions", {"device": "gpu-apple-0", "shareID": "p1", "consumedCapacity": {"memory": "512Mi"}}, 512 * MIB),
    # The slicing is written into a flow mapping: the counters layout comes along.
    ("partitions, partitionLayout: counters", {"device": "gpu-apple-0-p4-1"}, 512 * MIB),
    ("whole", {"device": "gpu-apple-0"}, None),
])
async def test_the_dra_driver_puts_the_claims_memory_in_its_cdi_spec(
    cluster: Cluster, slicing: str, result: dict[str, Any], memory: int | None
) -> None:
    # Killed below, when it holds a slice's memory: a process of its own.
    driver = cluster.start_driver(DRA_SMALL + f"dra: {{slicing: {slicing}, partitions: [4]}}\n",
                                  own_process=memory is not None)
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) >= 1)
    claim = await cluster.allocate("layered", [{"request": "gpu", **result}])
    answers = (await cluster.kubelet.prepare([claim]))[DRIVER]
    assert not answers[claim.uid].error, answers[claim.uid].error
    [device] = _spec(cluster, claim.uid)["devices"]
    edits = _spec_edits(device)
    layer = LayerDir(cluster.root / "vulkan")
    if memory is None:
        assert "GPUPPETTI_VK_SLICES" not in edits.env and not edits.mounts
        return
    assert edits.env["GPUPPETTI_VK_SLICES"] == f"any={memory}"
    assert {m.container_path for m in edits.mounts} == LAYER_MOUNTS
    assert set(layer.existing()) == {f"dra-{claim.uid}-gpu"}
    acct = layer.allocations / f"dra-{claim.uid}-gpu" / "slice-0.acct"
    # A driver killed and started again keeps what running containers counted, and forgets the time before which
    # the slice may not submit (from a clock that a reboot would have started again).
    data = bytearray(acct.read_bytes())
    data[24:32] = (123).to_bytes(8, "little")
    data[ACCT_SLOT_BYTES_OFFSET:ACCT_SLOT_BYTES_OFFSET + 8] = (123).to_bytes(8, "little")
    data[ACCT_NOT_BEFORE_OFFSET:ACCT_NOT_BEFORE_OFFSET + 8] = (10**18).to_bytes(8, "little")
    acct.write_bytes(bytes(data))
    # /metrics says what the claim's live containers hold of its slice: slot 0's, while this process holds its lock
    # as a process of the layer does.
    with acct.open("r+b") as live:
        fcntl.fcntl(live.fileno(), fcntl.F_OFD_SETLK,
                    struct.pack("@hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, ACCT_LOCK_BASE, 1, 0))
        async with aiohttp.ClientSession() as session, session.get(f"{await driver.http_url()}/metrics") as response:
            metrics = await response.text()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("gpuppetti_slice_")}
    # Who holds it: the claim's namespace and the pod it is reserved for (a claim's containers are not named).
    labels = f'container="",gpu="sim-apple-0",namespace="default",pod="layered-pod",unit="{result["device"]}"'
    assert samples[f"gpuppetti_slice_memory_used_bytes{{{labels}}}"] == 123
    assert samples[f"gpuppetti_slice_memory_budget_bytes{{{labels}}}"] == memory
    # The plan is checkpointed whole: the claim's directories and their budgets, by request.
    record = json.loads((cluster.plugin_dir / "checkpoint.json").read_text())["claims"][claim.uid]
    assert record["layer_allocations"] == {f"dra-{claim.uid}-gpu": [memory]}
    # A directory no claim of the checkpoint names (another claim's, left by a crash) goes at the next start.
    foreign = layer.create(f"dra-{claim.uid[:-4]}beef-gpu", [1])
    driver.send(signal.SIGKILL)
    await driver.wait()
    driver = cluster.start_driver(DRA_SMALL + f"dra: {{slicing: {slicing}, partitions: [4]}}\n", own_process=True)
    await cluster.kubelet.wait_registered(DRIVER, count=2)
    assert int.from_bytes(acct.read_bytes()[24:32], "little") == 123
    assert acct.read_bytes()[ACCT_NOT_BEFORE_OFFSET:ACCT_NOT_BEFORE_OFFSET + 8] == bytes(8)
    assert not foreign.exists()
    # Lost (a wiped disk): made again from the checkpointed plan, with the request's budget.
    shutil.rmtree(acct.parent)
    driver.send(signal.SIGKILL)
    await driver.wait()
    cluster.start_driver(DRA_SMALL + f"dra: {{slicing: {slicing}, partitions: [4]}}\n")
    await cluster.kubelet.wait_registered(DRIVER, count=3)
    assert int.from_bytes(acct.read_bytes()[16:24], "little") == memory
    assert (await cluster.kubelet.unprepare([claim], [DRIVER]))[DRIVER][claim.uid].error == ""
    assert layer.existing() == {}, "unprepared: its directory goes"


@pytest.mark.parametrize(("slicing", "result", "compute"), [
    # A consumable share's part of the GPU's cores; where it names none, the part of the GPU it takes.
    ("consumable", {"device": "gpu-apple-0", "shareID": "a1b2c3", "consumedCapacity": {"cores": "10"}}, "250"),
    ("consumable", {"device": "gpu-apple-0", "shareID": "a1b2c3", "consumedCapacity": {"memory": "512Mi"}}, "250"),
    ("partitions", {"device": "gpu-apple-0", "shareID": "p1", "consumedCapacity": {"memory": "512Mi"}}, "250"),
    ("partitions, partitionLayout: counters", {"device": "gpu-apple-0-p4-1"}, "250"),
    ("whole", {"device": "gpu-apple-0"}, None),
])
async def test_the_dra_driver_puts_the_claims_compute_share_in_its_cdi_spec(
    cluster: Cluster, slicing: str, result: dict[str, Any], compute: str | None
) -> None:
    cluster.start_driver(DRA_SMALL + f"sharing: {{enforceCompute: true}}\ndra: {{slicing: {slicing}, "
                         "partitions: [4]}\n")
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) >= 1)
    claim = await cluster.allocate("timed", [{"request": "gpu", **result}])
    answers = (await cluster.kubelet.prepare([claim]))[DRIVER]
    assert not answers[claim.uid].error, answers[claim.uid].error
    [device] = _spec(cluster, claim.uid)["devices"]
    assert _spec_edits(device).env.get("GPUPPETTI_VK_COMPUTE") == compute


async def test_a_consumable_claims_container_obtains_its_memory(cluster: Cluster) -> None:
    if (reason := why_not_here()) is not None:
        pytest.skip(f"the layer's container tests cannot run: {reason}")
    box = PodmanSandbox()
    if (problem := await box.why_not()) is not None:
        pytest.skip(f"podman cannot run containers here: {problem}")
    await box.ensure_image()
    cluster.start_driver(DRA_SMALL + "dra: {slicing: consumable}\n")
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) >= 1)
    claim = await cluster.allocate("consumer", [{"request": "gpu", "device": "gpu-apple-1", "shareID": "f00d01",
                                                 "consumedCapacity": {"memory": "384Mi"}}])
    (await cluster.kubelet.prepare([claim]))[DRIVER]
    [device] = _spec(cluster, claim.uid)["devices"]
    [report] = await vkinfo(box, _spec_edits(device), "gpuppetti-vkinfo --json --allocate 32")
    assert report["devices"][0]["heaps"][0]["size"] == 384 * MIB
    assert report["allocation"]["obtained"] == 384 * MIB
