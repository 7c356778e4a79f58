"""A kubelet device manager, as the kubelet behaves, for the demo, the sandbox and the tests.

It serves ``v1beta1.Registration`` on ``kubelet.sock`` with the kubelet's validation, dials each plugin back
inside Register, keeps one ListAndWatch stream per resource, admits pods in the kubelet's order
(init containers first, reused devices first, GetPreferredAllocation only when there is a real choice, one
Allocate per container per resource), and restarts the way the kubelet does: by deleting every socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import grpc

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpuppetti._proto.podresources.v1 import api_pb2 as podresources
from gpuppetti._proto.podresources.v1 import api_pb2_grpc as podresources_grpc
from gpuppetti.base.nodepaths import KUBELET_SOCKET
from gpuppetti.core.config import resource_name_problem
from gpuppetti.kubelet.changes import Changes

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("v1beta1",)
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
DIAL_TIMEOUT_S = 10.0
HEALTHY = "Healthy"


class AdmissionError(Exception):
    """The pod cannot be admitted (the kubelet's UnexpectedAdmissionError)."""


@dataclass(frozen=True)
class Container:
    name: str
    requests: Mapping[str, int]


@dataclass(frozen=True)
class Pod:
    name: str
    containers: tuple[Container, ...]
    init_containers: tuple[Container, ...] = ()

    @classmethod
    def simple(cls, name: str, resource: str, count: int = 1) -> Pod:
        return cls(name=name, containers=(Container("main", {resource: count}),))


@dataclass
class ContainerAllocation:
    pod: str
    container: str
    resource: str
    device_ids: list[str]
    response: pb.ContainerAllocateResponse
    preferred: list[str] | None  # what GetPreferredAllocation answered, None if it was not asked


@dataclass
class Event:
    at: float
    kind: str
    resource: str
    detail: str = ""


@dataclass
class PluginEndpoint:
    """The kubelet's view of one registered plugin."""

    resource: str
    socket: Path
    channel: grpc.aio.Channel
    stub: pb_grpc.DevicePluginStub
    options: pb.DevicePluginOptions
    devices: dict[str, str] = field(default_factory=dict)
    topology: dict[str, list[int]] = field(default_factory=dict)
    updates: int = 0
    connected: bool = True
    stream: asyncio.Task[None] | None = None


class _RegistrationService(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletEmulator) -> None:
        self._kubelet = kubelet

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        try:
            await self._kubelet._register(request)
        except _RegistrationRefused as exc:
            self._kubelet._record("registration-refused", request.resource_name, str(exc))
            # The kubelet returns a plain Go error here, which gRPC reports as UNKNOWN.
            await context.abort(grpc.StatusCode.UNKNOWN, str(exc))
        return pb.Empty()


class _RegistrationRefused(Exception):
    pass


class _PodResources(podresources_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources List: the devices assigned to each container of the admitted pods."""

    def __init__(self, kubelet: KubeletEmulator) -> None:
        self._kubelet = kubelet

    async def List(self, request: podresources.ListPodResourcesRequest,
                   context: grpc.aio.ServicerContext) -> podresources.ListPodResourcesResponse:
        pods: dict[str, dict[str, list[ContainerAllocation]]] = {}
        for allocation in self._kubelet.allocations:
            pods.setdefault(allocation.pod, {}).setdefault(allocation.container, []).append(allocation)
        answer = podresources.ListPodResourcesResponse()
        for pod, containers in pods.items():
            entry = answer.pod_resources.add(name=pod, namespace="default")
            for container, allocations in containers.items():
                resources = entry.containers.add(name=container)
                for allocation in allocations:
                    resources.devices.add(resource_name=allocation.resource, device_ids=allocation.device_ids)
        return answer


class KubeletEmulator:
    def __init__(self, directory: Path, pod_resources: Path | None = None) -> None:
        self.directory = directory
        self.socket = directory / KUBELET_SOCKET
        # Where to serve the PodResources API, as the kubelet does beside its device plugin directory; None: not.
        self.pod_resources = pod_resources
        self.endpoints: dict[str, PluginEndpoint] = {}
        self.allocations: list[ContainerAllocation] = []
        self.events: list[Event] = []
        self._server: grpc.aio.Server | None = None
        self._changes = Changes()
        self._admission = asyncio.Lock()

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # Like the real kubelet at start: every socket here belongs to a plugin of a previous kubelet.
        self._delete_sockets()
        server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(_RegistrationService(self), server)
        server.add_insecure_port(f"unix:{self.socket}")
        if self.pod_resources is not None:
            self.pod_resources.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                self.pod_resources.unlink()
            podresources_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), server)
            server.add_insecure_port(f"unix:{self.pod_resources}")
        await server.start()
        self._server = server
        self._record("kubelet-started", "", str(self.socket))

    async def stop(self, remove_socket: bool = True) -> None:
        server, self._server = self._server, None
        for endpoint in list(self.endpoints.values()):
            await self._disconnect(endpoint)
        self.endpoints.clear()
        if server is not None:
            await server.stop(0)
        if remove_socket:
            with contextlib.suppress(FileNotFoundError):
                self.socket.unlink()
        self._record("kubelet-stopped", "")

    async def restart(self, down_for: float = 0.0) -> None:
        """Stop and start again, as a kubelet restart does: plugin sockets are deleted and must re-register.

        A kubelet that dies leaves its socket file behind; the new one deletes every socket when it starts.
        """
        await self.stop(remove_socket=False)
        if down_for:
            await asyncio.sleep(down_for)
        await self.start()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _delete_sockets(self) -> None:
        for entry in self.directory.iterdir():
            if entry.name == CHECKPOINT_FILE:
                continue
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink()

    # -- registration and ListAndWatch ---------------------------------------------------------------------

    async def _register(self, request: pb.RegisterRequest) -> None:
        if request.version not in SUPPORTED_VERSIONS:
            raise _RegistrationRefused(
                f"requested device plugin version {request.version!r} is not supported; "
                f"supported versions: {', '.join(SUPPORTED_VERSIONS)}"
            )
        if problem := resource_name_problem(request.resource_name):
            raise _RegistrationRefused(f"invalid resource name: {problem}")
        if not request.endpoint or "/" in request.endpoint:
            raise _RegistrationRefused(f"invalid endpoint {request.endpoint!r}: expected a socket file name")
        path = self.directory / request.endpoint
        channel = grpc.aio.insecure_channel(f"unix:{path}", options=[("grpc.use_local_subchannel_pool", 1)])
        try:
            async with asyncio.timeout(DIAL_TIMEOUT_S):
                await channel.channel_ready()
            stub = pb_grpc.DevicePluginStub(channel)
            options = await stub.GetDevicePluginOptions(pb.Empty(), timeout=DIAL_TIMEOUT_S)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            await channel.close()
            raise _RegistrationRefused(f"failed to dial device plugin at {path}: {exc}") from exc
        old = self.endpoints.get(request.resource_name)
        if old is not None:
            await self._disconnect(old)
        endpoint = PluginEndpoint(request.resource_name, path, channel, stub, options)
        self.endpoints[request.resource_name] = endpoint
        endpoint.stream = asyncio.create_task(
            self._list_and_watch(endpoint), name=f"kubelet ListAndWatch {request.resource_name}"
        )
        self._record("registered", request.resource_name, request.endpoint)
        await self._notify()

    async def _list_and_watch(self, endpoint: PluginEndpoint) -> None:
        try:
            async for response in endpoint.stub.ListAndWatch(pb.Empty()):
                arrived = time.monotonic()
                # Every response is the complete list: rebuild from scratch, as the kubelet does.
                endpoint.devices = {device.ID: device.health for device in response.devices}
                endpoint.topology = {
                    device.ID: [node.ID for node in device.topology.nodes] for device in response.devices
                }
                endpoint.updates += 1
                healthy = sum(1 for h in endpoint.devices.values() if h == HEALTHY)
                self._record("list", endpoint.resource, f"{len(endpoint.devices)} devices, {healthy} healthy",
                             at=arrived)
                await self._notify()
        except grpc.aio.AioRpcError as exc:
            self._record("stream-ended", endpoint.resource, f"{exc.code().name}: {exc.details()}")
        except asyncio.CancelledError:
            raise
        else:
            self._record("stream-ended", endpoint.resource, "closed by the plugin")
        # The kubelet marks every device of a lost endpoint unhealthy until the plugin registers again.
        endpoint.connected = False
        endpoint.devices = dict.fromkeys(endpoint.devices, "Unhealthy")
        await self._notify()

    async def _disconnect(self, endpoint: PluginEndpoint) -> None:
        endpoint.connected = False
        if endpoint.stream is not None:
            endpoint.stream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await endpoint.stream
        await endpoint.channel.close()

    # -- observation ---------------------------------------------------------------------------------------

    def _record(self, kind: str, resource: str, detail: str = "", at: float | None = None) -> None:
        self.events.append(Event(time.monotonic() if at is None else at, kind, resource, detail))
        log.debug("kubelet: %s %s %s", kind, resource, detail)

    async def _notify(self) -> None:
        await self._changes.notify()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until ``predicate()`` holds; it is re-checked after every registration and list update."""
        await self._changes.wait_for(predicate, timeout)

    def registrations(self, resource: str) -> int:
        return sum(1 for e in self.events if e.kind == "registered" and e.resource == resource)

    async def wait_registered(self, resource: str, count: int = 1, timeout: float = 10.0) -> PluginEndpoint:
        def ready() -> bool:
            endpoint = self.endpoints.get(resource)
            return (
                self.registrations(resource) >= count
                and endpoint is not None
                and endpoint.connected
                and endpoint.updates > 0
            )

        await self.wait_for(ready, timeout)
        return self.endpoints[resource]

    def capacity(self, resource: str) -> int:
        endpoint = self.endpoints.get(resource)
        return len(endpoint.devices) if endpoint else 0

    def allocatable(self, resource: str) -> int:
        endpoint = self.endpoints.get(resource)
        if endpoint is None:
            return 0
        return sum(1 for health in endpoint.devices.values() if health == HEALTHY)

    def in_use(self, resource: str) -> set[str]:
        return {d for a in self.allocations if a.resource == resource for d in a.device_ids}

    def pod_of(self, resource: str, device_id: str) -> str | None:
        for allocation in self.allocations:
            if allocation.resource == resource and device_id in allocation.device_ids:
                return allocation.pod
        return None

    # -- admission -----------------------------------------------------------------------------------------

    async def admit(self, pod: Pod) -> list[ContainerAllocation]:
        """Allocate devices for every container of ``pod``, in the kubelet's order.

        Raises AdmissionError (and releases what the pod got) when any container cannot be served. Pods are
        admitted one at a time, as the kubelet's admission does, so concurrent callers never share a device.
        """
        async with self._admission:
            return await self._admit(pod)

    async def _admit(self, pod: Pod) -> list[ContainerAllocation]:
        if any(a.pod == pod.name for a in self.allocations):
            raise AdmissionError(f"pod {pod.name!r} is already admitted")
        result: list[ContainerAllocation] = []
        reusable: dict[str, list[str]] = {}
        try:
            for container in pod.init_containers:
                for resource, count in container.requests.items():
                    allocation = await self._allocate(pod.name, container.name, resource, count, reusable)
                    result.append(allocation)
                    # Init containers run one after another, so app containers may reuse their devices.
                    reusable[resource] = list(dict.fromkeys(reusable.get(resource, []) + allocation.device_ids))
            for container in pod.containers:
                for resource, count in container.requests.items():
                    allocation = await self._allocate(pod.name, container.name, resource, count, reusable)
                    result.append(allocation)
                    taken = set(allocation.device_ids)
                    reusable[resource] = [d for d in reusable.get(resource, []) if d not in taken]
        except AdmissionError:
            self.release(pod.name)
            raise
        return result

    def release(self, pod_name: str) -> None:
        self.allocations = [a for a in self.allocations if a.pod != pod_name]

    async def _allocate(
        self, pod: str, container: str, resource: str, needed: int, reusable: dict[str, list[str]]
    ) -> ContainerAllocation:
        endpoint = self.endpoints.get(resource)
        if endpoint is None or not endpoint.connected:
            raise AdmissionError(f"{pod}/{container}: no device plugin is registered for {resource}")
        healthy = [d for d, h in endpoint.devices.items() if h == HEALTHY]
        reuse = [d for d in reusable.get(resource, []) if d in endpoint.devices]
        picked = reuse[:needed]
        preferred: list[str] | None = None
        if len(picked) < needed:
            in_use = self.in_use(resource)
            available = [d for d in healthy if d not in in_use and d not in picked]
            missing = needed - len(picked)
            if len(available) < missing:
                raise AdmissionError(
                    f"{pod}/{container}: requested number of devices unavailable for {resource}. "
                    f"Requested: {needed}, Available: {len(available) + len(picked)}"
                )
            if len(available) == missing:
                picked += available
            elif endpoint.options.get_preferred_allocation_available:
                request = pb.PreferredAllocationRequest()
                request.container_requests.add(
                    available_deviceIDs=available + picked,
                    must_include_deviceIDs=picked,
                    allocation_size=needed,
                )
                try:
                    answer = await endpoint.stub.GetPreferredAllocation(request)
                except grpc.aio.AioRpcError as exc:
                    raise AdmissionError(f"{pod}/{container}: GetPreferredAllocation failed: {exc.details()}") from exc
                preferred = list(answer.container_responses[0].deviceIDs) if answer.container_responses else []
                # The kubelet trusts the answer only as far as it names real candidates.
                for device in preferred:
                    if device in available and device not in picked and len(picked) < needed:
                        picked.append(device)
                for device in available:
                    if len(picked) >= needed:
                        break
                    if device not in picked:
                        picked.append(device)
            else:
                picked += available[:missing]
        allocate = pb.AllocateRequest()
        allocate.container_requests.add(devices_ids=picked)
        try:
            response = await endpoint.stub.Allocate(allocate)
        except grpc.aio.AioRpcError as exc:
            raise AdmissionError(f"{pod}/{container}: Allocate failed: {exc.code().name}: {exc.details()}") from exc
        if not response.container_responses:
            raise AdmissionError(f"{pod}/{container}: Allocate returned no container response")
        allocation = ContainerAllocation(pod, container, resource, picked, response.container_responses[0], preferred)
        self.allocations.append(allocation)
        self._record("allocated", resource, f"{pod}/{container}: {', '.join(picked)}")
        return allocation
