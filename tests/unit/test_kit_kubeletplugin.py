"""The kit on its own: a DRA plugin started with ``kit.kubeletplugin.start`` from nothing but the seams' protocols,
met here by small fakes (no inventory, no API client, no daemon's metrics), and driven as the kubelet drives it:
registration, readiness, the pool published, a Prepare, the health stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from gpuppetti._proto.dra.v1 import api_pb2 as v1
from gpuppetti._proto.dra.v1 import api_pb2_grpc as v1_grpc
from gpuppetti._proto.drahealth.v1alpha1 import api_pb2 as health
from gpuppetti._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from gpuppetti._proto.pluginregistration.v1 import api_pb2 as reg
from gpuppetti._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gpuppetti.base.runtime import Runtime
from gpuppetti.core.kubeobjects import ObjectMeta, ResourceSlice, ResourceSliceBody
from gpuppetti.kit import kubeletplugin
from gpuppetti.kit.draplugin import ClaimRef, DeviceHealth, PreparedDevice
from gpuppetti.kit.publisher import PoolContent

NODE = "node1"
DRIVER = "gpu.example.com"
CLAIM = ClaimRef("default", "3f2a1b0c-0000-4000-8000-000000000001", "claim")


@dataclass(frozen=True)
class Pool:
    version: int
    devices: tuple[str, ...]
    healthy: bool = True


class Source:
    def __init__(self, pool: Pool) -> None:
        self.snapshot = pool
        self._changed = asyncio.Event()

    def change(self, pool: Pool) -> None:
        self.snapshot = pool
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, seen: int) -> int:
        while self.snapshot.version == seen:
            await self._changed.wait()
        return self.snapshot.version


def content_of(pool: Pool, node: str) -> PoolContent:
    return PoolContent.of([{"driver": DRIVER, "nodeName": node, "devices": [{"name": d} for d in pool.devices]}])


def health_of(pool: Pool) -> Iterable[DeviceHealth]:
    return [DeviceHealth(device, pool.healthy, "broken") for device in pool.devices]


@dataclass
class Writer:
    slices: dict[str, ResourceSliceBody] = field(default_factory=dict)

    async def node_uid(self, node: str) -> str:
        return "3f2a1b0c-0000-4000-8000-0000000000ff"

    async def list_slices(self, node: str, driver: str) -> list[ResourceSlice]:
        return [ResourceSlice(metadata=ObjectMeta(name=name, resource_version="1")) for name in self.slices]

    async def create_slice(self, body: ResourceSliceBody) -> str:
        self.slices[body["metadata"]["name"]] = body
        return "1"

    async def replace_slice(self, name: str, body: ResourceSliceBody) -> str:
        self.slices[name] = body
        return "1"

    async def delete_slice(self, name: str) -> None:
        self.slices.pop(name, None)

    async def watch_slices(self, node: str, driver: str) -> AsyncIterator[tuple[str, str, str]]:
        await asyncio.Event().wait()
        yield ("", "", "")


class Metrics:
    def __init__(self) -> None:
        registry = CollectorRegistry()
        self.prepare_requests = Counter("prepared", "", ["result"], registry=registry)
        self.prepare_seconds = Histogram("prepare_seconds", "", registry=registry)
        self.unprepare_requests = Counter("unprepared", "", ["result"], registry=registry)
        self.unprepare_seconds = Histogram("unprepare_seconds", "", registry=registry)
        self.slice_publishes = Counter("publishes", "", registry=registry)


class Driver:
    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, Sequence[PreparedDevice] | Exception]:
        return {claim.uid: [PreparedDevice(["gpu"], NODE, "gpu-0", [f"{DRIVER}/gpu=0"])] for claim in claims}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        return {claim.uid: "" for claim in claims}


async def _until(predicate: Callable[[], object]) -> None:
    async with asyncio.timeout(5):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_plugin_started_from_the_seams_alone_registers_publishes_and_serves(tmp_path: Path) -> None:
    source, writer, metrics = Source(Pool(1, ("gpu-0", "gpu-1"))), Writer(), Metrics()
    spec = kubeletplugin.PluginSpec(
        driver_name=DRIVER, node=NODE, plugin_dir=tmp_path / "plugins", registry_dir=tmp_path / "registry",
        source=source, content_of=content_of, health_of=health_of, writer=writer, metrics=metrics)
    spec.plugin_dir.mkdir()
    spec.registry_dir.mkdir()
    started: list[kubeletplugin.KubeletPlugin] = []

    async def begin(runtime: Runtime) -> None:
        started.append(kubeletplugin.start(runtime, Driver(), spec))

    runtime = Runtime(whole_process=False)
    running = asyncio.create_task(runtime.run(begin))
    try:
        await _until(lambda: started and spec.registration_socket.exists())
        [plugin] = started
        assert plugin.waiting_for() == "the kubelet has not confirmed the registration (no answer yet)"
        async with grpc.aio.insecure_channel(f"unix:{spec.registration_socket}") as channel:
            registration = reg_grpc.RegistrationStub(channel)
            info = await registration.GetInfo(reg.InfoRequest())
            assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(spec.socket))
            assert not writer.slices, "nothing is published before the kubelet confirms the registration"
            await registration.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True))
        await _until(lambda: plugin.waiting_for() is None)
        [published] = writer.slices.values()
        assert [d["name"] for d in published["spec"]["devices"]] == ["gpu-0", "gpu-1"]

        source.change(Pool(2, ("gpu-0",), healthy=False))
        await _until(lambda: [d["name"] for d in next(iter(writer.slices.values()))["spec"]["devices"]] == ["gpu-0"])
        async with grpc.aio.insecure_channel(f"unix:{spec.socket}") as channel:
            answer = await v1_grpc.DRAPluginStub(channel).NodePrepareResources(v1.NodePrepareResourcesRequest(
                claims=[v1.Claim(namespace=CLAIM.namespace, uid=CLAIM.uid, name=CLAIM.name)]))
            assert [d.device_name for d in answer.claims[CLAIM.uid].devices] == ["gpu-0"]
            stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                health.NodeWatchResourcesRequest())
            first = await stream.read()
            stream.cancel()
        assert [(d.device.pool_name, d.device.device_name, d.health, d.message) for d in first.devices] == [
            (NODE, "gpu-0", health.UNHEALTHY, "broken")]
        assert metrics.prepare_requests.labels("ok")._value.get() == 1
        assert metrics.slice_publishes._value.get() == 2
    finally:
        runtime.request_stop("the test is over")
        await running
    assert not spec.socket.exists() and not spec.registration_socket.exists()
