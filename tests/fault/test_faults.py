"""Fault injection against the real processes: restarts, garbage, concurrency, hostile input."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpuppetti.kubelet.emulator import AdmissionError, KubeletEmulator, Pod
from tests.dra_support import DRIVER, Cluster
from tests.helpers import TWO_M3_MAX, Daemon, DaemonProcess, PluginProcess
from tests.standins.dra_kubelet import ClaimKey

pytestmark = pytest.mark.fault
APPLE = "apple.com/gpu"
SRC = Path(__file__).resolve().parents[2] / "src" / "gpuppetti"


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


async def test_twenty_kubelet_restarts_in_a_row_leak_nothing(
    kubelet: KubeletEmulator, start_plugin_process: Callable[..., PluginProcess], plugin_dir: Path
) -> None:
    plugin = start_plugin_process(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)
    await kubelet.restart()
    await kubelet.wait_registered(APPLE, count=2)
    await asyncio.sleep(0.3)
    pid = plugin.pid
    fds, threads = _fds(pid), _threads(pid)
    for restart in range(20):
        await kubelet.restart()
        endpoint = await kubelet.wait_registered(APPLE, count=3 + restart, timeout=5)
        assert len(endpoint.devices) == 8
    await asyncio.sleep(0.5)
    assert sorted(p.name for p in plugin_dir.iterdir()) == ["gpuppetti-apple.com_gpu.sock", "kubelet.sock"]
    assert _fds(pid) <= fds + 2, f"file descriptors grew from {fds} to {_fds(pid)}"
    assert _threads(pid) <= threads + 1, f"threads grew from {threads} to {_threads(pid)}"


async def test_garbage_config_on_reload_keeps_the_old_one(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    endpoint = await kubelet.wait_registered(APPLE)
    assert plugin.config_path is not None
    plugin.config_path.write_bytes(b"\x00\xff garbage: [\n\x80")
    plugin.send(signal.SIGHUP)
    await plugin.wait_for_log("keeping the previous config")
    assert str(plugin.config_path) in plugin.log()
    plugin.write_config(TWO_M3_MAX + "sharing: {}\n")
    plugin.send(signal.SIGHUP)
    await plugin.wait_for_log("duplicate key 'sharing'")
    assert endpoint.connected and len(endpoint.devices) == 8
    await kubelet.admit(Pod.simple("served", APPLE))


async def test_500_concurrent_allocates_and_no_exclusive_gpu_twice(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin("version: v1\nsimulated:\n  gpus:\n    - {model: Whole, vendor: nvidia, count: 8}\n")
    endpoint = await kubelet.wait_registered("nvidia.com/gpu")
    ids = sorted(endpoint.devices)

    async def allocate(n: int) -> str:
        request = pb.AllocateRequest()
        request.container_requests.add(devices_ids=[ids[n % len(ids)]])
        response = await endpoint.stub.Allocate(request)
        return str(response.container_responses[0].envs["GPUPPETTI_VISIBLE_DEVICES"])

    answers = await asyncio.gather(*(allocate(n) for n in range(500)))
    assert answers == [ids[n % len(ids)] for n in range(500)]

    outcomes = await asyncio.gather(
        *(kubelet.admit(Pod.simple(f"pod-{n}", "nvidia.com/gpu")) for n in range(500)), return_exceptions=True)
    admitted = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, AdmissionError)]
    assert len(admitted) == 8 and len(refused) == 492
    handed_out = [allocation.device_ids[0] for pod in admitted for allocation in pod]
    assert sorted(handed_out) == ids, "every exclusive GPU exactly once"


METHODS = ("GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer")


async def test_malformed_protobuf_bytes_get_clean_errors_and_the_server_stays_up(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], plugin_dir: Path
) -> None:
    start_plugin(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)
    async with grpc.aio.insecure_channel(f"unix:{plugin_dir / 'gpuppetti-apple.com_gpu.sock'}") as channel:
        for method in METHODS:
            call = channel.unary_unary(f"/v1beta1.DevicePlugin/{method}",
                                       request_serializer=lambda b: b, response_deserializer=lambda b: b)
            for junk in (b"\xff\xff\xff\xff", b"\x0a\x05abc", b"\x08" * 7, os.urandom(64)):
                try:
                    if method == "ListAndWatch":
                        stream = channel.unary_stream(f"/v1beta1.DevicePlugin/{method}",
                                                      request_serializer=lambda b: b,
                                                      response_deserializer=lambda b: b)
                        async for _ in stream(junk, timeout=2):
                            pass
                    else:
                        await call(junk, timeout=2)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, junk, exc)
                    assert f"/v1beta1.DevicePlugin/{method}: malformed request" in str(exc.details())
                else:
                    # Some junk happens to be valid protobuf (unknown fields); then the call must just work.
                    pass
        stub = pb_grpc.DevicePluginStub(channel)
        options = await stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        assert options.get_preferred_allocation_available


ids = st.lists(st.one_of(st.sampled_from(["sim-apple-0::0", "sim-apple-1::3", "sim-apple-0"]),
                         st.text(max_size=80)), max_size=12)


@pytest.mark.timeout(300)
def test_hypothesis_requests_to_every_rpc(
        plugin_dir: Path, start_plugin_process: Callable[..., PluginProcess]) -> None:
    # A process of its own: the test drives its own event loop.
    plugin = start_plugin_process(TWO_M3_MAX)
    socket = plugin_dir / "gpuppetti-apple.com_gpu.sock"

    async def wait_for_socket() -> None:
        async with asyncio.timeout(10):
            while not socket.exists():
                await asyncio.sleep(0.02)

    asyncio.run(wait_for_socket())
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    channel = grpc.aio.insecure_channel(f"unix:{socket}")
    stub = pb_grpc.DevicePluginStub(channel)
    allowed = {grpc.StatusCode.INVALID_ARGUMENT}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(containers=st.lists(ids, max_size=4), must=ids, size=st.integers(-5, 20))
    def check(containers: list[list[str]], must: list[str], size: int) -> None:
        async def calls() -> None:
            allocate = pb.AllocateRequest()
            preferred = pb.PreferredAllocationRequest()
            for container in containers:
                allocate.container_requests.add(devices_ids=container)
                preferred.container_requests.add(available_deviceIDs=container, must_include_deviceIDs=must,
                                                 allocation_size=size)
            for rpc, request in ((stub.Allocate, allocate), (stub.GetPreferredAllocation, preferred),
                                 (stub.PreStartContainer, pb.PreStartContainerRequest(devices_ids=must))):
                try:
                    await rpc(request, timeout=5)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() in allowed, (rpc, exc.code(), exc.details())
                    assert exc.details()

        loop.run_until_complete(calls())

    try:
        check()
        assert loop.run_until_complete(stub.GetDevicePluginOptions(pb.Empty(), timeout=5)) is not None
        assert plugin.running()
    finally:
        loop.run_until_complete(channel.close())
        asyncio.set_event_loop(None)
        loop.close()


async def test_a_socket_directory_that_cannot_be_made_is_waited_for_and_said(tmp_path: Path) -> None:
    # Not even root may create directories under /proc: nor may the kubelet, and the plugin, which makes none in its
    # place, says what it waits for instead of waiting in silence.
    plugin = DaemonProcess(["plugin", "--device-plugin-dir", "/proc/gpuppetti-test/dp", "--http-address", ""],
                           TWO_M3_MAX, tmp_path, "proc")
    try:
        await plugin.wait_for_log("waiting for the kubelet's device plugin directory /proc/gpuppetti-test/dp to exist")
        assert plugin.running() and "Traceback" not in plugin.log()
    finally:
        plugin.kill()


def _listening_inodes() -> dict[int, str]:
    listening: dict[int, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                listening[int(fields[9])] = fields[1]
    return listening


async def test_the_only_tcp_listener_is_the_http_endpoint(
    kubelet: KubeletEmulator, start_plugin_process: Callable[..., PluginProcess]
) -> None:
    plugin = start_plugin_process(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)
    url = await plugin.http_url()
    port = int(url.rsplit(":", 1)[1])
    sockets = set()
    for fd in os.listdir(f"/proc/{plugin.pid}/fd"):
        target = os.readlink(f"/proc/{plugin.pid}/fd/{fd}")
        if target.startswith("socket:["):
            sockets.add(int(target[8:-1]))
    mine = [address for inode, address in _listening_inodes().items() if inode in sockets]
    assert len(mine) == 1, mine
    host_hex, port_hex = mine[0].split(":")
    assert int(port_hex, 16) == port
    assert host_hex == "0100007F", "127.0.0.1 by default"


def test_no_shell_command_is_built_from_input() -> None:
    for path in SRC.rglob("*.py"):
        if "_proto" in path.parts:
            continue
        text = path.read_text()
        for banned in ("shell=True", "os.system(", "os.popen(", "create_subprocess_shell", "subprocess.getoutput"):
            assert banned not in text, f"{path}: {banned}"


async def test_dra_sockets_are_private_and_garbage_gets_clean_errors(cluster: Cluster) -> None:
    cluster.start_driver()
    plugin = await cluster.kubelet.wait_registered(DRIVER)
    registration = cluster.root / "registry" / f"{DRIVER}-reg.sock"
    for socket in (cluster.plugin_dir / "dra.sock", registration):
        assert stat.S_IMODE(socket.stat().st_mode) == 0o600, socket
    async with grpc.aio.insecure_channel(f"unix:{plugin.endpoint}") as channel:
        for service in ("k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin", "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"):
            call = channel.unary_unary(f"/{service}/NodePrepareResources", request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(b"\x0a\xff\xff", timeout=5)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = [ClaimKey("", "uid-1", "x"), ClaimKey("ns", "uid-2", "y"), ClaimKey("ns", "uid-2", "y")]
    with pytest.raises(grpc.aio.AioRpcError) as malformed:
        await cluster.kubelet.call(DRIVER, "prepare", bad)
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "claims[0]" in str(malformed.value.details())
    # Still serving: a well-formed call for a claim that does not exist gets its per-claim error.
    unknown = ClaimKey("default", "nope", "00000000-0000-4000-8000-000000000001")
    answer = await cluster.kubelet.call(DRIVER, "prepare", [unknown])
    assert "not found" in answer[unknown.uid].error


claim_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=40)


@pytest.mark.timeout(300)
async def test_hypothesis_claims_to_the_dra_driver(cluster: Cluster) -> None:
    cluster.start_driver()
    await cluster.kubelet.wait_registered(DRIVER)
    loop = asyncio.get_running_loop()

    async def both(claims: list[ClaimKey]) -> None:
        for what in ("prepare", "unprepare"):
            try:
                answer = await cluster.kubelet.call(DRIVER, what, claims)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
                assert exc.details()
                continue
            assert set(answer) == {c.uid for c in claims}

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.builds(ClaimKey, claim_text, claim_text, claim_text), max_size=6))
    def check(claims: list[ClaimKey]) -> None:
        # Hypothesis drives from a thread; the calls run on the test's loop, where the kubelet's channels live.
        asyncio.run_coroutine_threadsafe(both(claims), loop).result(60)

    await asyncio.to_thread(check)
    assert cluster.started[0].running()
