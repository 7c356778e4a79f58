"""The DRA driver as a subprocess, the kubelet emulator's DRA side, and the API stand-in, through real sockets."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
from typing import Any

import pytest

from gpuppetti.core import cdi
from tests.cdi_checks import spec_problems
from tests.dra_support import DRIVER, NODE, Cluster
from tests.helpers import TWO_M3_MAX
from tests.standins.dra_kubelet import ClaimKey

pytestmark = pytest.mark.e2e


def _spec(cluster: Cluster, claim: ClaimKey) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((cluster.cdi_dir / cdi.spec_filename(cdi.DEFAULT_KIND, claim.uid)).read_text())
    return spec


def _env(spec: dict[str, Any], device: int = 0) -> dict[str, str]:
    return dict(line.split("=", 1) for line in spec["devices"][device]["containerEdits"]["env"])


async def test_registers_publishes_prepares_and_unprepares(cluster: Cluster) -> None:
    driver = cluster.start_driver()
    plugin = await cluster.kubelet.wait_registered(DRIVER)
    assert plugin.service == "v1.DRAPlugin"
    assert plugin.endpoint == str(cluster.plugin_dir / "dra.sock")
    await cluster.wait_slices(lambda s: len(s) == 1)
    [published] = cluster.slices()
    spec = published["spec"]
    assert (spec["driver"], spec["nodeName"], spec["pool"]["name"], spec["pool"]["resourceSliceCount"]) == (
        DRIVER, NODE, NODE, 1)
    assert published["metadata"]["ownerReferences"][0]["kind"] == "Node"
    devices = {d["name"]: d for d in spec["devices"]}
    assert sorted(devices) == ["gpu-apple-0", "gpu-apple-1"]
    gpu = devices["gpu-apple-0"]
    assert gpu["attributes"]["model"] == {"string": "Apple M3 Max"}
    assert gpu["attributes"]["vendor"] == {"string": "apple"}
    assert gpu["attributes"]["cores"] == {"int": 40}
    assert gpu["attributes"]["driverVersion"]["version"].count(".") == 2
    assert gpu["capacity"]["memory"] == {"value": "48Gi"}
    assert gpu["capacity"]["cores"] == {"value": "40"}

    claim = await cluster.allocate("whole", [{"request": "gpu", "device": "gpu-apple-1"}])
    answer = (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid]
    assert answer.error == ""
    [device] = answer.devices
    assert (device.pool_name, device.device_name, list(device.request_names)) == (NODE, "gpu-apple-1", ["gpu"])
    [cdi_id] = device.cdi_device_ids
    assert cdi_id == f"{cdi.DEFAULT_KIND}=claim-{claim.uid}-gpu"
    spec_file = _spec(cluster, claim)
    assert spec_problems(spec_file) == []
    assert spec_file["cdiVersion"] == "0.3.0"
    env = _env(spec_file)
    assert env["GPUPPETTI_VISIBLE_DEVICES"] == "sim-apple-1"
    assert env["GPUPPETTI_SLICES"] == "gpu-apple-1"
    assert env["GPUPPETTI_SHARING"] == "time-slicing"
    assert (env["GPUPPETTI_CORES"], env["GPUPPETTI_MEMORY"]) == ("40", str(48 * 2**30))
    assert env["GPUPPETTI_CLAIM"] == claim.uid

    # Idempotent: the kubelet repeats calls after restarts.
    again = (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid]
    assert list(again.devices[0].cdi_device_ids) == [cdi_id]

    gone = (await cluster.kubelet.unprepare([claim], [DRIVER]))[DRIVER]
    assert gone[claim.uid].error == ""
    assert not (cluster.cdi_dir / cdi.spec_filename(cdi.DEFAULT_KIND, claim.uid)).exists()
    unknown = ClaimKey("default", "never-prepared", "7f3c2d1e-0000-4000-8000-000000000000")
    assert (await cluster.kubelet.unprepare([unknown], [DRIVER]))[DRIVER][unknown.uid].error == ""
    assert await driver.stop() == 0
    assert not (cluster.plugin_dir / "dra.sock").exists()
    assert not (cluster.root / "registry" / f"{DRIVER}-reg.sock").exists()


async def test_every_claim_gets_an_answer_and_errors_say_what_is_wrong(cluster: Cluster) -> None:
    cluster.start_driver()
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 1)
    good = await cluster.allocate("good", [{"request": "gpu", "device": "gpu-apple-0"}])
    foreign = await cluster.allocate("foreign", [{"request": "gpu", "device": "gpu-apple-9"}])
    bad_config = await cluster.allocate(
        "bad-config", [{"request": "gpu", "device": "gpu-apple-1"}],
        config=[{"source": "FromClaim", "requests": ["gpu"], "opaque": {
            "driver": DRIVER,
            "parameters": {"apiVersion": "gpu.gpuppetti.dev/v1alpha1", "kind": "GpuConfig",
                           "sharing": {"strategy": "Sometimes"}}}}],
    )
    answers = await cluster.kubelet.call(DRIVER, "prepare", [
        good, foreign, bad_config, ClaimKey("default", "missing", "11111111-2222-4333-8444-555555555555"),
    ])
    assert answers[good.uid].error == ""
    assert "device gpu-apple-9 is not published by this node" in answers[foreign.uid].error
    assert "config[0] (FromClaim): invalid GpuConfig: sharing.strategy" in answers[bad_config.uid].error
    assert "ResourceClaim default/missing not found" in answers["11111111-2222-4333-8444-555555555555"].error


async def test_opaque_config_class_first_then_claim(cluster: Cluster) -> None:
    cluster.start_driver()
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 1)

    def gpu_config(strategy: str) -> dict[str, Any]:
        return {"driver": DRIVER, "parameters": {"apiVersion": "gpu.gpuppetti.dev/v1alpha1", "kind": "GpuConfig",
                                                 "sharing": {"strategy": strategy}}}

    claim = await cluster.allocate("configured", [{"request": "gpu", "device": "gpu-apple-0"}], config=[
        {"source": "FromClaim", "requests": ["gpu"], "opaque": gpu_config("Exclusive")},
        {"source": "FromClass", "requests": [], "opaque": gpu_config("TimeSlicing")},
    ])
    answer = (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid]
    assert answer.error == ""
    assert _env(_spec(cluster, claim))["GPUPPETTI_SHARING"] == "none"


PARTITIONS = TWO_M3_MAX + "dra: {slicing: partitions, partitions: [2, 4, 8]}\n"


async def test_partitions_as_memory_taken_in_their_sizes(cluster: Cluster) -> None:
    cluster.start_driver(PARTITIONS)
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 1)
    devices = cluster.devices()
    assert set(devices) == {"gpu-apple-0", "gpu-apple-1"}
    gpu = devices["gpu-apple-1"]
    assert gpu["allowMultipleAllocations"] is True
    assert "consumesCounters" not in gpu
    # The partition classes select it; the whole-GPU class does not.
    assert gpu["attributes"]["partitions"] == {"int": 8}
    assert gpu["capacity"] == {"memory": {"value": "48Gi", "requestPolicy": {
        "default": "6Gi", "validValues": ["6Gi", "12Gi", "24Gi", "48Gi"]}}}

    quarter = await cluster.allocate("quarter", [{"request": "gpu", "device": "gpu-apple-1", "shareID": "q1",
                                                  "consumedCapacity": {"memory": "12Gi"}}])
    odd = await cluster.allocate("odd", [{"request": "gpu", "device": "gpu-apple-1", "shareID": "o1",
                                          "consumedCapacity": {"memory": "10Gi"}}])
    answers = (await cluster.kubelet.prepare([quarter, odd]))[DRIVER]
    assert answers[quarter.uid].error == ""
    env = _env(_spec(cluster, quarter))
    assert (env["GPUPPETTI_SHARING"], env["GPUPPETTI_CORES"], env["GPUPPETTI_MEMORY"], env["GPUPPETTI_REPLICAS"]) == (
        "partition", "10", str(12 * 2**30), "4")
    assert env["GPUPPETTI_SHARE_ID"] == "q1"
    assert "not the size of one of its partitions (1/1, 1/2, 1/4, 1/8)" in answers[odd.uid].error


async def test_partitionable_devices(cluster: Cluster) -> None:
    cluster.start_driver(PARTITIONS.replace("[2, 4, 8]", "[2, 4, 8], partitionLayout: counters"))
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 2)
    counters = [s for s in cluster.slices() if "sharedCounters" in s["spec"]]
    assert len(counters) == 1
    sets = {c["name"]: c["counters"] for c in counters[0]["spec"]["sharedCounters"]}
    assert sets["gpu-apple-0-counters"]["cores"] == {"value": "40"}
    devices = cluster.devices()
    assert len(devices) == 2 * (1 + 2 + 4 + 8)
    eighth = devices["gpu-apple-0-p8-3"]
    assert eighth["capacity"]["cores"] == {"value": "5"}
    assert eighth["capacity"]["memory"] == {"value": "6Gi"}
    assert eighth["consumesCounters"][0]["counterSet"] == "gpu-apple-0-counters"
    assert eighth["attributes"]["partitions"] == {"int": 8}

    claim = await cluster.allocate("quarter", [{"request": "gpu", "device": "gpu-apple-1-p4-2"}])
    answer = (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid]
    assert answer.error == ""
    env = _env(_spec(cluster, claim))
    assert (env["GPUPPETTI_SHARING"], env["GPUPPETTI_CORES"], env["GPUPPETTI_MEMORY"]) == (
        "partition", "10", str(12 * 2**30))
    assert env["GPUPPETTI_REPLICAS"] == "4"


async def test_consumable_capacity_with_share_ids(cluster: Cluster) -> None:
    cluster.start_driver(TWO_M3_MAX + "dra: {slicing: consumable, shares: 4}\n")
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 1)
    gpu = cluster.devices()["gpu-apple-0"]
    assert gpu["allowMultipleAllocations"] is True
    assert gpu["capacity"]["cores"]["requestPolicy"]["default"] == "10"
    claims = []
    for n, share_id in enumerate(["a1b2c3", "d4e5f6"]):
        claims.append(await cluster.allocate(f"share-{n}", [{
            "request": "gpu", "device": "gpu-apple-0", "shareID": share_id,
            "consumedCapacity": {"cores": "8", "memory": "16Gi"},
        }]))
    answers = (await cluster.kubelet.prepare(claims))[DRIVER]
    for claim, share_id in zip(claims, ["a1b2c3", "d4e5f6"], strict=True):
        [device] = answers[claim.uid].devices
        assert device.share_id == share_id
        env = _env(_spec(cluster, claim))
        assert (env["GPUPPETTI_SHARING"], env["GPUPPETTI_CORES"], env["GPUPPETTI_MEMORY"]) == (
            "consumable", "8", str(16 * 2**30))
        assert env["GPUPPETTI_SHARE_ID"] == share_id


async def test_sigkill_restart_recovers_claims_and_recreates_wiped_cdi_specs(cluster: Cluster) -> None:
    driver = cluster.start_driver(own_process=True)
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 1)
    claim = await cluster.allocate("survivor", [{"request": "gpu", "device": "gpu-apple-0"}])
    first = (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid]
    spec_path = cluster.cdi_dir / cdi.spec_filename(cdi.DEFAULT_KIND, claim.uid)
    before = spec_path.read_text()

    driver.send(signal.SIGKILL)
    await driver.wait()
    # A reboot empties /var/run/cdi (tmpfs); the checkpoint in the plugin directory survives.
    shutil.rmtree(cluster.cdi_dir)
    cluster.start_driver()
    await cluster.kubelet.wait_registered(DRIVER, count=2)
    assert spec_path.read_text() == before
    again = (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid]
    assert list(again.devices[0].cdi_device_ids) == list(first.devices[0].cdi_device_ids)


async def test_cdi_specs_deleted_while_running_are_recreated(cluster: Cluster) -> None:
    cluster.start_driver()
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 1)
    claim = await cluster.allocate("kept", [{"request": "gpu", "device": "gpu-apple-0"}])
    await cluster.kubelet.prepare([claim])
    spec_path = cluster.cdi_dir / cdi.spec_filename(cdi.DEFAULT_KIND, claim.uid)
    spec_path.unlink()
    async with asyncio.timeout(10):
        while not spec_path.exists():
            await asyncio.sleep(0.02)


async def test_deleted_slices_are_recreated_and_a_kubelet_restart_is_survived(cluster: Cluster) -> None:
    cluster.start_driver()
    await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 1)
    [published] = cluster.slices()
    await cluster.api.delete("resourceslices", published["metadata"]["name"])
    await cluster.wait_slices(lambda s: len(s) == 1)

    await cluster.kubelet.restart()  # deletes every slice of the node, as a starting kubelet does
    await cluster.kubelet.wait_registered(DRIVER, count=2)
    await cluster.wait_slices(lambda s: len(s) == 1)


async def test_corrupt_checkpoint_is_moved_aside_and_the_driver_serves(cluster: Cluster) -> None:
    cluster.plugin_dir.mkdir(parents=True)
    (cluster.plugin_dir / "checkpoint.json").write_text('{"version": "v1", "checksum": "0", "claims": {"x":')
    driver = cluster.start_driver()
    await cluster.kubelet.wait_registered(DRIVER)
    await driver.wait_for_log("is corrupt")
    assert list(cluster.plugin_dir.glob("checkpoint.json.corrupt-*"))
    await cluster.wait_slices(lambda s: len(s) == 1)
    claim = await cluster.allocate("after-corruption", [{"request": "gpu", "device": "gpu-apple-0"}])
    assert (await cluster.kubelet.prepare([claim]))[DRIVER][claim.uid].error == ""


async def test_health_stream_and_taints(cluster: Cluster) -> None:
    driver = cluster.start_driver()
    plugin = await cluster.kubelet.wait_registered(DRIVER)
    await cluster.kubelet.wait_for(lambda: plugin.health_updates > 0)
    assert sorted((pool, name, status) for pool, name, status, _ in plugin.health) == [
        (NODE, "gpu-apple-0", 1), (NODE, "gpu-apple-1", 1)]
    # Slices are published once the registration is confirmed, which may come after the first health list.
    await cluster.wait_slices(lambda s: len(s) == 1)
    assert driver.config_path is not None
    driver.config_path.write_text(TWO_M3_MAX.replace("numaNode: 0}", "numaNode: 0, health: Unhealthy}"))
    driver.send(signal.SIGHUP)
    await cluster.kubelet.wait_for(lambda: {h[2] for h in plugin.health} == {2})
    await cluster.wait_slices(lambda s: all("taints" in d for d in s[0]["spec"]["devices"]) if s else False)
    taint = cluster.devices()["gpu-apple-0"]["taints"][0]
    assert (taint["key"], taint["effect"]) == (f"{DRIVER}/unhealthy", "NoSchedule")
    generations = {s["spec"]["pool"]["generation"] for s in cluster.slices()}
    assert generations == {2}


async def test_v1beta1_serves_the_same_answers_without_share_ids(cluster: Cluster) -> None:
    from gpuppetti._proto.dra.v1beta1 import api_pb2 as v1beta1
    from gpuppetti._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc

    cluster.start_driver(TWO_M3_MAX + "dra: {slicing: consumable}\n")
    plugin = await cluster.kubelet.wait_registered(DRIVER)
    await cluster.wait_slices(lambda s: len(s) == 1)
    claim = await cluster.allocate("old-kubelet", [{"request": "gpu", "device": "gpu-apple-0", "shareID": "abc123",
                                                    "consumedCapacity": {"cores": "4"}}])
    stub = v1beta1_grpc.DRAPluginStub(plugin.channel)
    request = v1beta1.NodePrepareResourcesRequest(
        claims=[v1beta1.Claim(namespace=claim.namespace, name=claim.name, uid=claim.uid)])
    response = await stub.NodePrepareResources(request, timeout=30)
    entry = response.claims[claim.uid]
    assert entry.error == ""
    [device] = entry.devices
    assert (device.device_name, list(device.cdi_device_ids)) == (
        "gpu-apple-0", [f"{cdi.DEFAULT_KIND}=claim-{claim.uid}-gpu"])
    unprepared = await stub.NodeUnprepareResources(v1beta1.NodeUnprepareResourcesRequest(
        claims=[v1beta1.Claim(namespace=claim.namespace, name=claim.name, uid=claim.uid)]), timeout=30)
    assert unprepared.claims[claim.uid].error == ""
