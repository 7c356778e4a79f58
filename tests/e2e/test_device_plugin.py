"""The plugin as a subprocess, the emulator as the kubelet, real Unix sockets in between."""

from __future__ import annotations

import asyncio
import signal
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.kubelet.emulator import AdmissionError, Container, KubeletEmulator, Pod
from tests.helpers import TWO_M3_MAX, Daemon
from tests.ledger_client import Process, handed_over

pytestmark = pytest.mark.e2e
APPLE = "apple.com/gpu"
SOCKET = "gpuppetti-apple.com_gpu.sock"


async def test_registers_and_lists_every_replica(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], plugin_dir: Path
) -> None:
    start_plugin(TWO_M3_MAX)
    endpoint = await kubelet.wait_registered(APPLE)

    assert endpoint.socket == plugin_dir / SOCKET
    assert endpoint.options.get_preferred_allocation_available
    assert not endpoint.options.pre_start_required
    assert sorted(endpoint.devices) == [f"sim-apple-{g}::{n}" for g in range(2) for n in range(4)]
    assert set(endpoint.devices.values()) == {"Healthy"}
    assert all(nodes == [0] for nodes in endpoint.topology.values())
    assert kubelet.capacity(APPLE) == kubelet.allocatable(APPLE) == 8
    assert stat.S_IMODE((plugin_dir / SOCKET).stat().st_mode) == 0o600


async def test_list_is_not_resent_without_a_change(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(TWO_M3_MAX)
    endpoint = await kubelet.wait_registered(APPLE)
    await asyncio.sleep(0.5)
    assert endpoint.updates == 1


async def test_pods_get_their_slices_and_env(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)

    first = (await kubelet.admit(Pod.simple("one", APPLE)))[0]
    second = (await kubelet.admit(Pod.simple("two", APPLE)))[0]

    # Distributed (the default) spreads single slices over both GPUs.
    gpus = {first.device_ids[0].split("::")[0], second.device_ids[0].split("::")[0]}
    assert gpus == {"sim-apple-0", "sim-apple-1"}
    env = dict(first.response.envs)
    expected = {
        "GPUPPETTI_VISIBLE_DEVICES": first.device_ids[0].split("::")[0],
        "GPUPPETTI_SLICES": first.device_ids[0],
        "GPUPPETTI_SHARING": "time-slicing",
        "GPUPPETTI_REPLICAS": "4",
        "GPUPPETTI_ENFORCED_BY": "none",
    }
    if "GPUPPETTI_VK_SLICES" in env:  # where the Vulkan layer is built: a quarter of 48 GiB, enforced
        expected |= {"GPUPPETTI_VK_SLICES": f"any={12 * 2**30}",
                     "GPUPPETTI_VK_LEDGER": "/run/gpuppetti/vulkan/ledger.sock", "GPUPPETTI_LIMITS": "vulkan",
                     "GPUPPETTI_ENFORCED_BY": "vulkan-layer"}
    assert env == expected

    pair = (await kubelet.admit(Pod.simple("pair", APPLE, 2)))[0]
    assert pair.preferred is not None, "with 6 free slices the kubelet has a choice and must ask"
    assert len(set(pair.device_ids)) == 2
    assert dict(pair.response.envs)["GPUPPETTI_SLICES"] == ",".join(pair.device_ids)


async def test_packed_policy_fills_one_gpu_first(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(TWO_M3_MAX + "plugin:\n  allocationPolicy: packed\n")
    await kubelet.wait_registered(APPLE)
    allocations = [(await kubelet.admit(Pod.simple(f"p{n}", APPLE)))[0] for n in range(4)]
    assert {a.device_ids[0].split("::")[0] for a in allocations} == {"sim-apple-0"}
    fifth = (await kubelet.admit(Pod.simple("p4", APPLE)))[0]
    assert fifth.device_ids[0].startswith("sim-apple-1::")


async def test_init_container_devices_are_must_include(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)
    pod = Pod(
        name="with-init",
        init_containers=(Container("init", {APPLE: 1}),),
        containers=(Container("main", {APPLE: 2}),),
    )
    init, main = await kubelet.admit(pod)
    assert init.device_ids[0] in main.device_ids
    assert main.preferred is not None and init.device_ids[0] in main.preferred


async def test_over_capacity_is_refused_by_the_kubelet(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)
    await kubelet.admit(Pod.simple("big", APPLE, 8))
    with pytest.raises(AdmissionError, match="Requested: 1, Available: 0"):
        await kubelet.admit(Pod.simple("late", APPLE))


async def _allocate(endpoint_stub: object, *requests: list[str]) -> pb.AllocateResponse:
    request = pb.AllocateRequest()
    for ids in requests:
        request.container_requests.add(devices_ids=ids)
    return await endpoint_stub.Allocate(request)  # type: ignore[attr-defined, no-any-return]


async def test_bad_allocate_requests_get_invalid_argument_and_the_server_keeps_serving(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(TWO_M3_MAX)
    endpoint = await kubelet.wait_registered(APPLE)
    stub = endpoint.stub

    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await _allocate(stub, ["sim-apple-0::0", "nope-1", "sim-apple-9::0"])
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'nope-1'" in str(unknown.value.details())
    assert "'sim-apple-9::0'" in str(unknown.value.details())

    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await _allocate(stub, [])
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "names no device ids" in str(empty.value.details())

    with pytest.raises(grpc.aio.AioRpcError) as no_containers:
        await _allocate(stub)
    assert no_containers.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with pytest.raises(grpc.aio.AioRpcError) as twice:
        await _allocate(stub, ["sim-apple-0::1", "sim-apple-0::1"])
    assert twice.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than once" in str(twice.value.details())

    ok = await _allocate(stub, ["sim-apple-0::0"], ["sim-apple-1::0", "sim-apple-1::1"])
    assert [dict(c.envs)["GPUPPETTI_SLICES"] for c in ok.container_responses] == [
        "sim-apple-0::0", "sim-apple-1::0,sim-apple-1::1"
    ]


async def test_unhealthy_ids_are_refused(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin("""\
        version: v1
        simulated:
          gpus:
            - {model: Good, vendor: amd}
            - {model: Broken, vendor: amd, health: Unhealthy}
        """)
    endpoint = await kubelet.wait_registered("amd.com/gpu")
    assert endpoint.devices == {"sim-amd-0": "Healthy", "sim-amd-1": "Unhealthy"}
    assert kubelet.allocatable("amd.com/gpu") == 1
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _allocate(endpoint.stub, ["sim-amd-1"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unhealthy device ids 'sim-amd-1'" in str(refused.value.details())
    whole = await _allocate(endpoint.stub, ["sim-amd-0"])
    assert dict(whole.container_responses[0].envs)["GPUPPETTI_SHARING"] == "none"


async def test_fail_requests_greater_than_one(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(TWO_M3_MAX.replace("    resources:", "    failRequestsGreaterThanOne: true\n    resources:"))
    await kubelet.wait_registered(APPLE)
    with pytest.raises(AdmissionError, match="failRequestsGreaterThanOne"):
        await kubelet.admit(Pod.simple("greedy", APPLE, 2))
    assert kubelet.in_use(APPLE) == set()
    await kubelet.admit(Pod.simple("modest", APPLE, 1))


async def test_per_gpu_replicas_and_rename(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin("""\
        version: v1
        simulated:
          gpus:
            - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: 3}
        sharing:
          timeSlicing:
            resources:
              - {name: apple.com/gpu, replicas: 4, devices: ["0"], rename: apple.com/gpu-shared}
              - {name: apple.com/gpu, replicas: 2, devices: [sim-apple-1]}
        """)
    shared = await kubelet.wait_registered("apple.com/gpu-shared")
    plain = await kubelet.wait_registered(APPLE)
    assert sorted(shared.devices) == [f"sim-apple-0::{n}" for n in range(4)]
    assert sorted(plain.devices) == ["sim-apple-1::0", "sim-apple-1::1", "sim-apple-2"]


async def test_rename_by_default(kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]) -> None:
    start_plugin(TWO_M3_MAX.replace("    resources:", "    renameByDefault: true\n    resources:"))
    endpoint = await kubelet.wait_registered("apple.com/gpu.shared")
    assert len(endpoint.devices) == 8


async def test_reregisters_after_kubelet_restarts(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], plugin_dir: Path
) -> None:
    start_plugin(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)
    for restart in range(1, 4):
        await kubelet.restart()
        endpoint = await kubelet.wait_registered(APPLE, count=1 + restart, timeout=5)
        assert len(endpoint.devices) == 8
    assert (plugin_dir / SOCKET).exists()


async def test_waits_for_a_kubelet_that_is_down(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], plugin_dir: Path
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)
    await kubelet.stop()
    (plugin_dir / SOCKET).unlink()
    await plugin.wait_for_log("waiting for the kubelet")
    await kubelet.start()
    endpoint = await kubelet.wait_registered(APPLE, count=2, timeout=5)
    assert len(endpoint.devices) == 8


async def test_plugin_started_before_the_kubelet(
    plugin_dir: Path, start_plugin: Callable[..., Daemon]
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    await plugin.wait_for_log("waiting for the kubelet")
    async with KubeletEmulator(plugin_dir) as kubelet:
        endpoint = await kubelet.wait_registered(APPLE, timeout=5)
        assert len(endpoint.devices) == 8


class _KubeletThatDiesDuringRegister(KubeletEmulator):
    """Fails the first Register half-way: the plugin's socket is gone and the call errors."""

    failed = False

    async def _register(self, request: pb.RegisterRequest) -> None:
        if not self.failed:
            self.failed = True
            (self.directory / request.endpoint).unlink()
            raise ConnectionError("kubelet went away during Register")
        await super()._register(request)


async def test_register_failing_half_way_is_retried_with_the_socket_recreated(
    plugin_dir: Path, start_plugin: Callable[..., Daemon]
) -> None:
    async with _KubeletThatDiesDuringRegister(plugin_dir) as kubelet:
        plugin = start_plugin(TWO_M3_MAX)
        endpoint = await kubelet.wait_registered(APPLE, timeout=10)
        assert kubelet.failed
        assert len(endpoint.devices) == 8
    assert "Register with" in plugin.log() and "retrying" in plugin.log()


async def test_health_change_reaches_the_kubelet_on_reload(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    endpoint = await kubelet.wait_registered(APPLE)
    plugin.write_config(TWO_M3_MAX.replace("numaNode: 0}", "numaNode: 0, health: Unhealthy}"))
    plugin.send(signal.SIGHUP)
    await kubelet.wait_for(lambda: set(endpoint.devices.values()) == {"Unhealthy"})
    assert endpoint.updates == 2
    assert kubelet.allocatable(APPLE) == 0


async def test_broken_config_on_reload_keeps_the_old_one(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    endpoint = await kubelet.wait_registered(APPLE)
    plugin.write_config(TWO_M3_MAX.replace("replicas: 4", "replicas: lots"))
    plugin.send(signal.SIGHUP)
    await plugin.wait_for_log("keeping the previous config")
    assert "sharing.timeSlicing.resources[0].replicas" in plugin.log()
    assert str(plugin.config_path) in plugin.log()
    assert len(endpoint.devices) == 8 and endpoint.connected
    await kubelet.admit(Pod.simple("still-served", APPLE))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_stops_cleanly_and_removes_its_socket(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], plugin_dir: Path, signum: int
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)
    assert await plugin.stop(signum) == 0
    assert not (plugin_dir / SOCKET).exists()
    assert (plugin_dir / "kubelet.sock").exists()


OLD = "0b3f1d6e-2a4c-4e8f-9a1b-3c5d7e9f1a2b"
NEW = "7c9e2f4a-6b8d-4c1e-8f3a-5b7d9e1f3a5c"


async def test_two_instances_take_turns_and_the_new_one_takes_the_old_ones_ledgers(
    kubelet: KubeletEmulator, start_plugin_process: Callable[..., Daemon], plugin_dir: Path
) -> None:
    """A rolling update that surges: the new instance serves on a socket of its own beside the old one, the kubelet
    takes its registration, and it serves the old one's ledgers once that one has stopped."""
    old = start_plugin_process(TWO_M3_MAX, "--instance", OLD)
    first = await kubelet.wait_registered(APPLE)
    assert first.socket == plugin_dir / f"gpuppetti-apple.com_gpu-{OLD}.sock"
    [held] = await kubelet.admit(Pod.simple("held", APPLE))
    if "GPUPPETTI_VK_LEDGER" not in dict(held.response.envs):
        pytest.skip("the Vulkan layer is not built here: no ledger to hand over")
    [ledger] = (plugin_dir.parent / "vulkan" / "ledgers").iterdir()
    tenant = await asyncio.to_thread(Process, ledger)

    new = start_plugin_process(TWO_M3_MAX, "--instance", NEW)
    second = await kubelet.wait_registered(APPLE, count=2)
    assert second.socket == plugin_dir / f"gpuppetti-apple.com_gpu-{NEW}.sock"
    assert old.running() and (plugin_dir / f"gpuppetti-apple.com_gpu-{OLD}.sock").exists()
    # Still the old one's: its process is connected there.
    await asyncio.to_thread(tenant.sync)
    async with asyncio.timeout(10):
        while len(second.devices) < 8:  # the new instance's first list
            await asyncio.sleep(0.02)
    [other] = await kubelet.admit(Pod.simple("other", APPLE))
    assert other.device_ids != held.device_ids

    assert await old.stop() == 0
    # The old one never took the resource back, whatever the kubelet did with its stream.
    registered = [event.detail for event in kubelet.events if event.kind == "registered"]
    assert registered[-1] == second.socket.name and registered.count(first.socket.name) == 1, registered
    assert kubelet.endpoints[APPLE].connected
    await handed_over(tenant, ledger, new)
    assert not (plugin_dir / f"gpuppetti-apple.com_gpu-{OLD}.sock").exists()
    assert new.running()
