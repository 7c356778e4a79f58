"""The five DevicePlugin RPCs for one extended resource, answered from the inventory."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import grpc

from gpuppetti import cdi
from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpuppetti.deviceplugin import cdispec
from gpuppetti.edits import container_edits
from gpuppetti.inventory import Inventory
from gpuppetti.metrics import Metrics
from gpuppetti.model import ContainerEdits, Health, Unit
from gpuppetti.sharing import ResourcePlan, preferred_allocation

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the plugin refuses; becomes INVALID_ARGUMENT with this message."""


class DeviceLists:
    """Builds ListAndWatch responses, reusing each unit's Device message while its GPU's state is unchanged.

    Building 10,000 Device messages costs more than copying them, and a health change touches one GPU's units.
    """

    def __init__(self) -> None:
        self._cache: dict[str, tuple[tuple[str, int | None], pb.Device]] = {}

    def build(self, inventory: Inventory, plan: ResourcePlan | None) -> pb.ListAndWatchResponse:
        response = pb.ListAndWatchResponse()
        if plan is None:
            return response
        devices = []
        cache = self._cache
        fresh: dict[str, tuple[tuple[str, int | None], pb.Device]] = {}
        for unit in plan.units:
            gpu = inventory.gpus[unit.gpu_id]
            state = (str(gpu.health), gpu.numa_node)
            cached = cache.get(unit.id)
            if cached is not None and cached[0] == state:
                device = cached[1]
            else:
                device = pb.Device(ID=unit.id, health=state[0])
                if gpu.numa_node is not None and gpu.numa_node >= 0:
                    device.topology.nodes.add(ID=gpu.numa_node)
            fresh[unit.id] = (state, device)
            devices.append(device)
        self._cache = fresh
        response.devices.extend(devices)
        return response


def edits_to_response(
    edits: ContainerEdits, strategies: Sequence[str] = ("envvar",), cdi_names: Sequence[str] = (),
    annotation: str = "",
) -> pb.ContainerAllocateResponse:
    """Render edits the ways ``strategies`` ask: device specs and mounts (envvar), CDI names (cdi-cri), or
    CDI annotations. The env always goes in: it depends on the allocation, and no CDI spec can carry it."""
    response = pb.ContainerAllocateResponse(envs=edits.env)
    if "envvar" in strategies:
        for node in edits.device_nodes:
            response.devices.add(container_path=node.path, host_path=node.source, permissions=node.permissions)
        for mount in edits.mounts:
            response.mounts.add(
                container_path=mount.container_path, host_path=mount.host_path, read_only=mount.read_only
            )
    if "cdi-cri" in strategies:
        for name in cdi_names:
            response.cdi_devices.add(name=name)
    if "cdi-annotations" in strategies and cdi_names:
        response.annotations[annotation] = ",".join(cdi_names)
    return response


def _quoted(ids: Sequence[str]) -> str:
    return ", ".join(repr(i) for i in ids)


def resolve_request(inventory: Inventory, resource: str, ids: Sequence[str]) -> list[Unit]:
    """The units behind one container request. Raises RequestError naming every offending id."""
    plan = inventory.resource(resource)
    if not ids:
        raise RequestError(f"{resource}: the container request names no device ids")
    if plan is None:
        raise RequestError(f"{resource}: this plugin no longer advertises the resource; unknown ids {_quoted(ids)}")
    duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)
    if duplicates:
        raise RequestError(f"{resource}: device ids requested more than once: {_quoted(duplicates)}")
    unknown = [i for i in ids if i not in plan.by_id]
    if unknown:
        raise RequestError(f"{resource}: unknown device ids {_quoted(unknown)}")
    units = [plan.by_id[i] for i in ids]
    unhealthy = [u.id for u in units if inventory.gpus[u.gpu_id].health != Health.HEALTHY]
    if unhealthy:
        raise RequestError(f"{resource}: unhealthy device ids {_quoted(unhealthy)}")
    time_slicing = inventory.config.sharing.time_slicing
    if time_slicing.fail_requests_greater_than_one and len(units) > 1 and any(u.shared for u in units):
        raise RequestError(
            f"request for '{resource}: {len(units)}' is too large: failRequestsGreaterThanOne is set, so a "
            "container may ask for at most one unit of a time-sliced resource (more replicas of one GPU "
            "give it no more compute)"
        )
    return units


class DevicePluginService(pb_grpc.DevicePluginServicer):
    def __init__(self, inventory: Inventory, resource: str, metrics: Metrics, cdi_kind: str = cdispec.KIND) -> None:
        self._inventory = inventory
        self._resource = resource
        self._metrics = metrics
        self._cdi_kind = cdi_kind

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        inventory = self._inventory
        seen = inventory.version
        last: pb.ListAndWatchResponse | None = None
        lists = DeviceLists()
        log.info("%s: kubelet opened ListAndWatch", self._resource)
        while True:
            current = lists.build(inventory, inventory.resource(self._resource))
            # Health or config changes elsewhere in the inventory need not reach this resource's kubelet.
            if current != last:
                yield current
                last = current
            seen = await inventory.wait_for_change(seen)

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        plan = self._inventory.resource(self._resource)
        response = pb.PreferredAllocationResponse()
        policy = self._inventory.config.plugin.allocation_policy
        for container in request.container_requests:
            if container.allocation_size < 0:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{self._resource}: allocation_size must not be negative, got {container.allocation_size}",
                )
            chosen: list[str] = []
            if plan is not None:
                chosen = preferred_allocation(
                    plan,
                    list(container.available_deviceIDs),
                    list(container.must_include_deviceIDs),
                    container.allocation_size,
                    policy,
                )
            response.container_responses.add(deviceIDs=chosen)
        return response

    async def Allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> pb.AllocateResponse:
        started = time.perf_counter()
        try:
            response = await self._allocate(request, context)
        except BaseException:
            self._metrics.allocate_requests.labels(self._resource, "error").inc()
            raise
        finally:
            self._metrics.allocate_seconds.labels(self._resource).observe(time.perf_counter() - started)
        self._metrics.allocate_requests.labels(self._resource, "ok").inc()
        return response

    async def _allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        if not request.container_requests:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self._resource}: no container requests")
        response = pb.AllocateResponse()
        inventory = self._inventory
        for number, container in enumerate(request.container_requests):
            try:
                units = resolve_request(inventory, self._resource, list(container.devices_ids))
            except RequestError as exc:
                prefix = f"container request {number}: " if len(request.container_requests) > 1 else ""
                log.warning("Allocate refused: %s%s", prefix, exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{prefix}{exc}")
            strategies = inventory.config.plugin.device_list_strategy
            gpu_ids = list(dict.fromkeys(u.gpu_id for u in units))
            names = [cdi.qualified_name(self._cdi_kind, cdispec.device_name(inventory.gpus[g])) for g in gpu_ids]
            response.container_responses.append(edits_to_response(
                container_edits(units, inventory.gpus), strategies, names,
                cdispec.annotation_key(self._resource, [u.id for u in units]),
            ))
            self._metrics.allocated_units.labels(self._resource).inc(len(units))
            log.info("%s: allocated %s", self._resource, ", ".join(u.id for u in units))
        return response

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreStartContainerResponse:
        # Advertised off (pre_start_required=False); answered anyway so a confused caller gets no error.
        return pb.PreStartContainerResponse()
