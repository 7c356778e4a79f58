"""The kubelet's DRA side, as the kubelet behaves: the plugin watcher, and the DRA manager's prepare/unprepare.

It watches the registry directory, calls GetInfo (1 s), picks the first service version in the plugin's order
that it knows, dials the endpoint, sends NotifyRegistrationStatus; it reads ResourceClaims from the API (the
stand-in), makes one NodePrepareResources call per driver, and insists on an answer for every claim. A restart
drops the connections and, like a starting kubelet, deletes every ResourceSlice of the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuppetti._proto.dra.v1 import api_pb2 as v1
from gpuppetti._proto.dra.v1 import api_pb2_grpc as v1_grpc
from gpuppetti._proto.dra.v1beta1 import api_pb2 as v1beta1
from gpuppetti._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpuppetti._proto.drahealth.v1alpha1 import api_pb2 as health
from gpuppetti._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from gpuppetti._proto.pluginregistration.v1 import api_pb2 as reg
from gpuppetti._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from gpuppetti.base.watch import Change, watch_directory
from gpuppetti.kubelet.changes import Changes
from tests.standins.apiserver import ApiStandIn

log = logging.getLogger(__name__)

KNOWN_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
GET_INFO_TIMEOUT_S = 1.0
DIAL_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = 45.0


class DraError(Exception):
    pass


@dataclass(frozen=True)
class ClaimKey:
    namespace: str
    name: str
    uid: str


@dataclass
class DraPlugin:
    driver: str
    registration_socket: Path
    endpoint: str
    service: str
    channel: grpc.aio.Channel
    health: list[tuple[str, str, int, str]] = field(default_factory=list)
    health_updates: int = 0
    health_task: asyncio.Task[None] | None = None

    def stub(self) -> Any:
        if self.service == "v1.DRAPlugin":
            return v1_grpc.DRAPluginStub(self.channel)
        return v1beta1_grpc.DRAPluginStub(self.channel)

    @property
    def messages(self) -> Any:
        return v1 if self.service == "v1.DRAPlugin" else v1beta1


class DraKubelet:
    def __init__(self, registry_dir: Path, api: ApiStandIn | None = None, node: str = "") -> None:
        self.registry_dir = registry_dir
        self.api = api
        self.node = node
        self.plugins: dict[str, DraPlugin] = {}
        self.events: list[tuple[float, str, str]] = []
        self._changes = Changes()
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        if self.api is not None and self.node:
            # A starting kubelet deletes every ResourceSlice of its node; drivers must publish them again.
            wiped = await self.api.delete_where(
                "resourceslices", lambda o: (o.get("spec") or {}).get("nodeName") == self.node)
            self._record("slices-wiped", "", str(wiped))
        ready = asyncio.Event()
        self._watcher = asyncio.create_task(self._watch(ready), name="kubelet plugin watcher")
        await ready.wait()

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        for plugin in list(self.plugins.values()):
            await self._drop(plugin)
        self.plugins.clear()

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def __aenter__(self) -> DraKubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _record(self, kind: str, driver: str, detail: str = "") -> None:
        self.events.append((time.monotonic(), kind, f"{driver} {detail}".strip()))

    async def _notify(self) -> None:
        await self._changes.notify()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until ``predicate()`` holds; it is re-checked after every registration and health update."""
        await self._changes.wait_for(predicate, timeout)

    def registrations(self, driver: str) -> int:
        return sum(1 for _, kind, detail in self.events if kind == "registered" and detail.startswith(driver))

    async def wait_registered(self, driver: str, count: int = 1, timeout: float = 10.0) -> DraPlugin:
        await self.wait_for(lambda: driver in self.plugins and self.registrations(driver) >= count, timeout)
        return self.plugins[driver]

    # -- the plugin watcher -------------------------------------------------------------------------------

    async def _watch(self, ready: asyncio.Event) -> None:
        async for event in watch_directory(self.registry_dir):
            if event.change is Change.READY:
                for entry in sorted(self.registry_dir.iterdir()):
                    await self._consider(entry)
                ready.set()
            elif event.change is Change.CREATED:
                await self._consider(self.registry_dir / event.name)
            elif event.change is Change.DELETED:
                for plugin in list(self.plugins.values()):
                    if plugin.registration_socket.name == event.name:
                        self._record("deregistered", plugin.driver)
                        await self._drop(plugin)
                        del self.plugins[plugin.driver]
                        await self._notify()

    async def _consider(self, path: Path) -> None:
        if path.name.startswith("."):
            return
        try:
            if not stat.S_ISSOCK(path.lstat().st_mode):
                return
        except FileNotFoundError:
            return
        try:
            await self._register(path)
        except (DraError, grpc.aio.AioRpcError, TimeoutError) as exc:
            self._record("registration-failed", path.name, str(exc))
            log.warning("kubelet: registering %s failed: %s", path, exc)

    async def _register(self, path: Path) -> None:
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            async with asyncio.timeout(DIAL_TIMEOUT_S):
                await channel.channel_ready()
            info = await stub.GetInfo(reg.InfoRequest(), timeout=GET_INFO_TIMEOUT_S)

            async def refuse(why: str) -> None:
                await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=False, error=why),
                                                    timeout=5)
                raise DraError(why)

            if info.type != "DRAPlugin":
                await refuse(f"no handler registered for plugin type: {info.type}")
            if not info.supported_versions:
                await refuse("the plugin lists no supported versions")
            service = next((v for v in info.supported_versions if v in KNOWN_SERVICES), None)
            if service is None:
                await refuse(f"none of the versions {list(info.supported_versions)} is supported")
            assert service is not None
            endpoint = info.endpoint or str(path)
            old = self.plugins.get(info.name)
            if old is not None and old.endpoint == endpoint and old.registration_socket != path:
                await refuse(f"driver {info.name} is already registered with endpoint {endpoint}")
            dra_channel = grpc.aio.insecure_channel(f"unix:{endpoint}")
            try:
                async with asyncio.timeout(DIAL_TIMEOUT_S):
                    await dra_channel.channel_ready()
            except TimeoutError:
                await dra_channel.close()
                await refuse(f"cannot connect to {endpoint}")
            if old is not None:
                await self._drop(old)
            plugin = DraPlugin(info.name, path, endpoint, service, dra_channel)
            self.plugins[info.name] = plugin
            if "v1alpha1.DRAResourceHealth" in info.supported_versions:
                plugin.health_task = asyncio.create_task(self._watch_health(plugin), name=f"health {info.name}")
            await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True), timeout=5)
        self._record("registered", info.name, service)
        await self._notify()

    async def _drop(self, plugin: DraPlugin) -> None:
        if plugin.health_task is not None:
            plugin.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await plugin.health_task
        await plugin.channel.close()

    async def _watch_health(self, plugin: DraPlugin) -> None:
        stub = health_grpc.DRAResourceHealthStub(plugin.channel)
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for response in stub.NodeWatchResources(health.NodeWatchResourcesRequest()):
                plugin.health = [
                    (d.device.pool_name, d.device.device_name, d.health, d.message) for d in response.devices
                ]
                plugin.health_updates += 1
                await self._notify()

    # -- the DRA manager ----------------------------------------------------------------------------------

    async def _drivers_of(self, claims: list[ClaimKey]) -> dict[str, list[ClaimKey]]:
        if self.api is None:
            raise DraError("the kubelet needs the API to learn which drivers a claim uses")
        by_driver: dict[str, list[ClaimKey]] = {}
        for claim in claims:
            obj = self.api.get("resourceclaims", claim.name, claim.namespace)
            if obj is None or obj["metadata"]["uid"] != claim.uid:
                raise DraError(f"ResourceClaim {claim.namespace}/{claim.name} ({claim.uid}) not found")
            results = (((obj.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
            if not results:
                raise DraError(f"ResourceClaim {claim.namespace}/{claim.name} is not allocated")
            for driver in dict.fromkeys(r["driver"] for r in results):
                by_driver.setdefault(driver, []).append(claim)
        return by_driver

    async def prepare(self, claims: list[ClaimKey]) -> dict[str, dict[str, Any]]:
        """NodePrepareResources, one call per driver. Returns driver → claim uid → the response entry."""
        answers: dict[str, dict[str, Any]] = {}
        for driver, driver_claims in (await self._drivers_of(claims)).items():
            answers[driver] = await self.call(driver, "prepare", driver_claims)
        return answers

    async def unprepare(self, claims: list[ClaimKey], drivers: list[str]) -> dict[str, dict[str, Any]]:
        # The claim may be gone from the API by now, so the kubelet uses what it checkpointed at prepare time.
        return {driver: await self.call(driver, "unprepare", claims) for driver in drivers}

    async def call(self, driver: str, what: str, claims: list[ClaimKey]) -> dict[str, Any]:
        plugin = self.plugins.get(driver)
        if plugin is None:
            raise DraError(f"DRA driver {driver} is not registered")
        messages = plugin.messages
        stub = plugin.stub()
        wire = [messages.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        if what == "prepare":
            response = await stub.NodePrepareResources(
                messages.NodePrepareResourcesRequest(claims=wire), timeout=CALL_TIMEOUT_S)
        else:
            response = await stub.NodeUnprepareResources(
                messages.NodeUnprepareResourcesRequest(claims=wire), timeout=CALL_TIMEOUT_S)
        sent = {c.uid for c in claims}
        got = set(response.claims)
        if got - sent:
            raise DraError(f"{driver} answered for claims it was not sent: {sorted(got - sent)}")
        if sent - got:
            raise DraError(f"{driver} skipped {len(sent - got)} ResourceClaims")
        return dict(response.claims)
