"""Enforced slices through both front ends: what the device plugin's Allocate and the DRA driver's CDI spec give a
container (nothing writable from the node), the ledgers they serve, keep across a restart and close, and (where
podman and lavapipe are here) what such a container then obtains."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuppetti.core import cdi
from gpuppetti.core.model import ContainerEdits, DeviceNode, Mount
from gpuppetti.deviceplugin.enforcement import Enforcer, allocation_id
from gpuppetti.kubelet.emulator import ContainerAllocation, KubeletEmulator, Pod
from gpuppetti.kubelet.sandbox import PodmanSandbox, podman_flags
from gpuppetti.layer.ledgers import Ledgers
from gpuppetti.layer.vulkan import BUILT, LIBRARY, LayerDir
from gpuppetti.sharing.budgets import Budget
from tests.dra_support import DRIVER, Cluster
from tests.e2e.test_vulkan_layer import SIMULATED, vkinfo, why_not_here
from tests.helpers import Daemon, PluginProcess, replicas, short_tmpdir
from tests.ledger_client import Process

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


def _ledger_directories(layer: LayerDir) -> set[str]:
    return {entry.name for entry in layer.ledgers.iterdir()}


def _only_the_daemons(directory: Path) -> None:
    """An allocation's directory on the node: root's, 0755, holding the daemon's socket and nothing else."""
    info = os.lstat(directory)
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o755) or os.geteuid() != 0
    assert [entry.name for entry in directory.iterdir()] == ["ledger.sock"]


async def test_the_plugin_gives_each_container_its_slices_and_nothing_writable(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], plugin_dir: Path
) -> None:
    plugin = start_plugin(SMALL)
    await kubelet.wait_registered("apple.com/gpu")
    await plugin.wait_for_log("slices are enforced through the Vulkan layer")
    [one] = await kubelet.admit(Pod.simple("one", "apple.com/gpu", 1))
    [two] = await kubelet.admit(Pod.simple("two", "apple.com/gpu", 2))
    assert one.response.envs["GPUPPETTI_VK_SLICES"] == f"any={512 * MIB}"
    assert one.response.envs["GPUPPETTI_VK_LEDGER"] == "/run/gpuppetti/vulkan/ledger.sock"
    # Distributed: one slice on each GPU, each GPU's budget its own.
    assert two.response.envs["GPUPPETTI_VK_SLICES"] == f"any={512 * MIB},any={512 * MIB}"
    assert {m.container_path for m in one.response.mounts} == LAYER_MOUNTS
    assert all(mount.read_only for answer in (one, two) for mount in answer.response.mounts)
    layer = LayerDir(plugin_dir.parent / "vulkan")
    assert _ledger_directories(layer) == {allocation_id(one.device_ids), allocation_id(two.device_ids)}
    directory = layer.ledgers / allocation_id(two.device_ids)
    _only_the_daemons(directory)
    process = await asyncio.to_thread(Process, directory)
    assert process.terms == [(512 * MIB, 1000), (512 * MIB, 1000)]
    assert await asyncio.to_thread(process.reserve, 512 * MIB, 1)
    assert not await asyncio.to_thread(process.reserve, 1, 1)
    process.close()
    # The kubelet freed pod one; its units, allocated again, are served by one ledger still.
    kubelet.release("one")
    [again] = await kubelet.admit(Pod.simple("again", "apple.com/gpu", 1))
    assert again.device_ids == one.device_ids
    assert _ledger_directories(layer) == {allocation_id(again.device_ids), allocation_id(two.device_ids)}


async def test_a_plugin_restarted_under_a_running_workload_loses_nothing(
    kubelet: KubeletEmulator, start_plugin_process: Callable[..., PluginProcess], plugin_dir: Path
) -> None:
    plugin = start_plugin_process(SMALL)
    await kubelet.wait_registered("apple.com/gpu")
    [one] = await kubelet.admit(Pod.simple("one", "apple.com/gpu", 1))
    directory = LayerDir(plugin_dir.parent / "vulkan").ledgers / allocation_id(one.device_ids)
    process = await asyncio.to_thread(Process, directory)
    assert await asyncio.to_thread(process.reserve, 300 * MIB)
    plugin.send(signal.SIGKILL)
    await plugin.wait()
    assert await asyncio.to_thread(process.sock.recv, 16) == b"", "the daemon's end is gone"
    plugin = start_plugin_process(SMALL)
    await kubelet.wait_registered("apple.com/gpu", count=2)
    # The process reconnects and declares what it holds, as the layer does; the new daemon holds it to the budget.
    back = await asyncio.to_thread(Process, directory)
    back.declare(300 * MIB)
    assert not await asyncio.to_thread(back.reserve, 212 * MIB + 1)
    assert await asyncio.to_thread(back.reserve, 212 * MIB)
    async with aiohttp.ClientSession() as session, session.get(f"{await plugin.http_url()}/v1/slices") as response:
        slices = await response.json()
    assert [(row["unit"], row["used_bytes"], row["budget_bytes"]) for row in slices] == [
        (one.device_ids[0], 512 * MIB, 512 * MIB)]


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


async def test_ledgers_of_units_the_kubelet_freed_close(tmp_path: Path) -> None:
    base = short_tmpdir()
    socket = base / "pod-resources" / "kubelet.sock"
    async with KubeletEmulator(base / "dp", pod_resources=socket) as kubelet:
        layer = LayerDir(tmp_path / "vulkan")
        layer.install()
        enforcer = Enforcer(layer, Ledgers(layer.ledgers), socket, grace=0)
        await enforcer.start(set())
        budgets = [Budget(SIMULATED, 512 * MIB)]
        await enforcer.allocate(replicas("gpu-0", 0), budgets)
        await enforcer.allocate(replicas("gpu-0", 1), budgets)
        freed = await asyncio.to_thread(Process, layer.ledgers / allocation_id(["gpu-0::0"]))
        kubelet.allocations.append(ContainerAllocation("still", "c", "apple.com/gpu", ["gpu-0::1"], None, None))  # type: ignore[arg-type]
        await enforcer.check()
        assert _ledger_directories(layer) == {allocation_id(["gpu-0::1"])}, "gpu-0::0 is assigned to no container"
        assert set(layer.read_records()) == {allocation_id(["gpu-0::1"])}
        assert await asyncio.to_thread(freed.sock.recv, 16) == b""
        enforcer.ledgers.close_all()


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
    assert all(mount.read_only for mount in edits.mounts)
    assert _ledger_directories(layer) == {f"dra-{claim.uid}-gpu"}
    directory = layer.ledgers / f"dra-{claim.uid}-gpu"
    _only_the_daemons(directory)
    process = await asyncio.to_thread(Process, directory)
    assert await asyncio.to_thread(process.reserve, 123)
    async with aiohttp.ClientSession() as session, session.get(f"{await driver.http_url()}/metrics") as response:
        metrics = await response.text()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("gpuppetti_slice_")}
    # Who holds it: the claim's namespace and the pod it is reserved for (a claim's containers are not named).
    labels = f'container="",gpu="sim-apple-0",namespace="default",pod="layered-pod",unit="{result["device"]}"'
    assert samples[f"gpuppetti_slice_memory_used_bytes{{{labels}}}"] == 123
    assert samples[f"gpuppetti_slice_memory_budget_bytes{{{labels}}}"] == memory
    # The plan is checkpointed whole: the claim's ledgers and their budgets, by request.
    record = json.loads((cluster.plugin_dir / "checkpoint.json").read_text())["claims"][claim.uid]
    assert record["layer_allocations"] == {f"dra-{claim.uid}-gpu": [memory]}
    # A directory no claim of the checkpoint names (another claim's, left by a crash) goes at the next start.
    foreign = layer.ledgers / f"dra-{claim.uid[:-4]}beef-gpu"
    foreign.mkdir()
    driver.send(signal.SIGKILL)
    await driver.wait()
    assert await asyncio.to_thread(process.sock.recv, 16) == b""
    driver = cluster.start_driver(DRA_SMALL + f"dra: {{slicing: {slicing}, partitions: [4]}}\n", own_process=True)
    await cluster.kubelet.wait_registered(DRIVER, count=2)
    assert not foreign.exists()
    # The claim's ledger is served again, with the request's budget; its process declares what it holds.
    back = await asyncio.to_thread(Process, directory)
    assert back.terms == [(memory, 0)]
    back.declare(123)
    assert not await asyncio.to_thread(back.reserve, memory - 122)
    assert await asyncio.to_thread(back.reserve, memory - 123)
    assert (await cluster.kubelet.unprepare([claim], [DRIVER]))[DRIVER][claim.uid].error == ""
    assert _ledger_directories(layer) == set(), "unprepared: its ledger goes"
    assert await asyncio.to_thread(back.sock.recv, 16) == b""


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
    box = await _box()
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


async def _box() -> PodmanSandbox:
    if (reason := why_not_here()) is not None:
        pytest.skip(f"the layer's container tests cannot run: {reason}")
    box = PodmanSandbox()
    if (problem := await box.why_not()) is not None:
        pytest.skip(f"podman cannot run containers here: {problem}")
    await box.ensure_image()
    return box


async def _restart_under_a_workload(box: PodmanSandbox, edits: ContainerEdits, restart: Callable[[], Any]) -> None:
    """A container holding 320 MiB of its 512 MiB slice while its daemon is killed and started again (``restart``):
    an allocation made while the daemon is away waits, then fails as Vulkan fails; once the daemon is back, the
    holder has declared what it holds, and a second container of the allocation obtains exactly the rest."""
    name = f"holder-{os.getpid()}"
    holder = asyncio.create_task(box.shell(name, podman_flags(edits), "gpuppetti-vkinfo --json --allocate 64 "
                                           "--limit 320 --hold 25"))
    await asyncio.sleep(6)  # the holder has its 320 MiB (the container starts in a second or two)
    away = ContainerEdits(env={**edits.env, "GPUPPETTI_VK_LEDGER_WAIT_MS": "1000"}, mounts=list(edits.mounts))
    await restart()
    [refused] = await vkinfo(box, away, "gpuppetti-vkinfo --json --allocate 64")
    assert refused["allocation"]["obtained"] == 0, "the daemon is away: nothing is handed out"
    assert refused["allocation"]["refused_with"] == "VK_ERROR_OUT_OF_DEVICE_MEMORY"
    await restart()
    [rest] = await vkinfo(box, edits, "gpuppetti-vkinfo --json --allocate 64")
    code, out, err = await holder
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["allocation"]["obtained"] == 320 * MIB, "the holder ran on"
    assert rest["allocation"]["obtained"] == 192 * MIB, "the restarted daemon holds the holder's 320 MiB"


async def test_the_plugin_restarted_under_a_running_container_loses_nothing(
    kubelet: KubeletEmulator, start_plugin_process: Callable[..., PluginProcess]
) -> None:
    box = await _box()
    plugin = start_plugin_process(SMALL)
    await kubelet.wait_registered("apple.com/gpu")
    [one] = await kubelet.admit(Pod.simple("one", "apple.com/gpu", 1))
    phase: list[str] = []

    async def restart() -> None:
        nonlocal plugin
        if not phase:  # first: killed, and left away
            plugin.send(signal.SIGKILL)
            await plugin.wait()
        else:
            plugin = start_plugin_process(SMALL)
            await kubelet.wait_registered("apple.com/gpu", count=2)
        phase.append("done")

    await _restart_under_a_workload(box, _edits_of(one.response), restart)


async def test_the_dra_driver_restarted_under_a_running_container_loses_nothing(cluster: Cluster) -> None:
    box = await _box()
    config = DRA_SMALL + "dra: {slicing: consumable}\n"
    driver = cluster.start_driver(config, own_process=True)
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) >= 1)
    claim = await cluster.allocate("held", [{"request": "gpu", "device": "gpu-apple-1", "shareID": "beef01",
                                             "consumedCapacity": {"memory": "512Mi"}}])
    assert not (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error
    [device] = _spec(cluster, claim.uid)["devices"]
    phase: list[str] = []

    async def restart() -> None:
        nonlocal driver
        if not phase:
            driver.send(signal.SIGKILL)
            await driver.wait()
        else:
            driver = cluster.start_driver(config, own_process=True)
            await cluster.kubelet.wait_registered(DRIVER, count=2)
        phase.append("done")

    await _restart_under_a_workload(box, _spec_edits(device), restart)
