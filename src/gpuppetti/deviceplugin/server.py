"""The five DevicePlugin RPCs for one extended resource, answered from the inventory's current snapshot.

ListAndWatch sends the resource's encoded list (devicelists) as it is (bytes, not messages), so a list of 10,000
units costs a join. At most ``MAX_STREAMS`` ListAndWatch streams are kept per resource: the kubelet opens one, a
new one ends the oldest (a kubelet that re-registers wins over a stream left behind), and a client that never
reads holds at most one list in flight, never a queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.core import cdi
from gpuppetti.core.model import ContainerEdits, Health
from gpuppetti.deviceplugin import cdispec
from gpuppetti.deviceplugin.devicelists import DeviceLists
from gpuppetti.node.inventory import Inventory, Snapshot
from gpuppetti.node.metrics import Metrics
from gpuppetti.sharing.budgets import Enforce, unit_budgets
from gpuppetti.sharing.edits import container_edits
from gpuppetti.sharing.limits import with_limits
from gpuppetti.sharing.policy import preferred_allocation
from gpuppetti.sharing.replicas import Unit

if TYPE_CHECKING:
    from gpuppetti.deviceplugin.enforcement import Enforcer

log = logging.getLogger(__name__)

SERVICE = "v1beta1.DevicePlugin"
MAX_STREAMS = 2
# The kubelet's gRPC receive limit: a longer list (about 140,000 units) would end its stream.
KUBELET_MAX_MESSAGE = 4 * 1024 * 1024


def too_big(resource: str, size: int) -> str | None:
    """Why a list of ``size`` bytes cannot go to the kubelet; None when it can."""
    if size <= KUBELET_MAX_MESSAGE:
        return None
    return (f"{resource}: the device list is {size:,} bytes, more than the kubelet accepts ({KUBELET_MAX_MESSAGE:,} "
            "bytes, about 140,000 units): fewer replicas or fewer GPUs per resource")
# How many offending ids an error message names before it just counts them.
NAMED_IDS = 5


class RequestError(Exception):
    """A request the plugin refuses; becomes INVALID_ARGUMENT with this message."""


def edits_to_response(
    edits: ContainerEdits, strategies: Sequence[str] = ("envvar",), cdi_names: Sequence[str] = (),
    annotation: str = "",
) -> pb.ContainerAllocateResponse:
    """Render edits the ways ``strategies`` ask: device specs (envvar), CDI names (cdi-cri), or CDI annotations.
    The env and the mounts always go in: they depend on the allocation (the Vulkan layer's mounts name its own
    directory), and the plugin's CDI spec carries only each GPU's device nodes."""
    response = pb.ContainerAllocateResponse(envs=edits.env)
    for mount in edits.mounts:
        response.mounts.add(container_path=mount.container_path, host_path=mount.host_path, read_only=mount.read_only)
    if "envvar" in strategies:
        for node in edits.device_nodes:
            response.devices.add(container_path=node.path, host_path=node.source, permissions=node.permissions)
    if "cdi-cri" in strategies:
        for name in cdi_names:
            response.cdi_devices.add(name=name)
    if "cdi-annotations" in strategies and cdi_names:
        response.annotations[annotation] = ",".join(cdi_names)
    return response


def quoted(ids: Sequence[str]) -> str:
    """The first few ids, quoted and cut to a sane length, and how many more there are: a request with 100,000
    ids (or one id of megabytes) gets an error message of a line, not of megabytes."""
    named = ", ".join(repr(i if len(i) <= 80 else i[:77] + "...") for i in ids[:NAMED_IDS])
    more = len(ids) - NAMED_IDS
    return f"{named} and {more} more ({len(ids)} in all)" if more > 0 else named


def resolve_request(snapshot: Snapshot, resource: str, ids: Sequence[str]) -> list[Unit]:
    """The units behind one container request. Raises RequestError naming the offending ids."""
    plan = snapshot.resource(resource)
    if not ids:
        raise RequestError(f"{resource}: the container request names no device ids")
    if plan is None:
        raise RequestError(f"{resource}: this plugin no longer advertises the resource; unknown ids {quoted(ids)}")
    duplicates = sorted(i for i, n in Counter(ids).items() if n > 1) if len(set(ids)) != len(ids) else []
    if duplicates:
        raise RequestError(f"{resource}: device ids requested more than once: {quoted(duplicates)}")
    unknown = [i for i in ids if i not in plan.by_id]
    if unknown:
        raise RequestError(f"{resource}: unknown device ids {quoted(unknown)}")
    units = [plan.by_id[i] for i in ids]
    unhealthy = [u.id for u in units if snapshot.gpus[u.gpu_id].health != Health.HEALTHY]
    if unhealthy:
        raise RequestError(f"{resource}: unhealthy device ids {quoted(unhealthy)}")
    time_slicing = snapshot.config.sharing.time_slicing
    if time_slicing.fail_requests_greater_than_one and len(units) > 1 and any(u.shared for u in units):
        raise RequestError(
            f"request for '{resource}: {len(units)}' is too large: failRequestsGreaterThanOne is set, so a "
            "container may ask for at most one unit of a time-sliced resource (more replicas of one GPU "
            "give it no more compute)"
        )
    return units


class DevicePluginService:
    """The RPCs of one resource. ``streams`` tells the endpoint how many kubelet streams are open."""

    def __init__(self, inventory: Inventory, resource: str, metrics: Metrics, cdi_kind: str = cdispec.KIND,
                 on_streams: Callable[[int], None] | None = None, enforcer: Enforcer | None = None,
                 lists: DeviceLists | None = None) -> None:
        self._inventory = inventory
        # One per process, shared by every resource's service: the GPUs' encoded blocks are kept once.
        self._lists = lists or DeviceLists()
        self._enforcer = enforcer
        self._resource = resource
        self._metrics = metrics
        self._cdi_kind = cdi_kind
        self._on_streams = on_streams
        # Labelled once: looking a child up per call costs more than the rest of a small Allocate.
        self._ok = metrics.allocate_requests.labels(resource, "ok")
        self._error = metrics.allocate_requests.labels(resource, "error")
        self._seconds = metrics.allocate_seconds.labels(resource)
        self._units = metrics.allocated_units.labels(resource)
        # The tasks grpc runs the open ListAndWatch calls in: ending one is cancelling it.
        self._streams: list[asyncio.Task[Any]] = []

    def handler(self) -> grpc.GenericRpcHandler:
        """The service, with ListAndWatch answering pre-encoded bytes."""
        def passthrough(data: bytes) -> bytes:
            return data

        handlers: dict[str, Any] = {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                self.GetDevicePluginOptions, pb.Empty.FromString, pb.DevicePluginOptions.SerializeToString),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                self.ListAndWatch, pb.Empty.FromString, passthrough),
            "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
                self.GetPreferredAllocation, pb.PreferredAllocationRequest.FromString,
                pb.PreferredAllocationResponse.SerializeToString),
            "Allocate": grpc.unary_unary_rpc_method_handler(
                self.Allocate, pb.AllocateRequest.FromString, pb.AllocateResponse.SerializeToString),
            "PreStartContainer": grpc.unary_unary_rpc_method_handler(
                self.PreStartContainer, pb.PreStartContainerRequest.FromString,
                pb.PreStartContainerResponse.SerializeToString),
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    @property
    def streams(self) -> int:
        return len(self._streams)

    def _streams_changed(self) -> None:
        if self._on_streams is not None:
            self._on_streams(len(self._streams))

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        this = asyncio.current_task()
        assert this is not None
        self._streams.append(this)
        while len(self._streams) > MAX_STREAMS:
            oldest = self._streams.pop(0)
            log.warning("%s: more than %d ListAndWatch streams; ending the oldest", self._resource, MAX_STREAMS)
            oldest.cancel()
        self._streams_changed()
        log.info("%s: kubelet opened ListAndWatch", self._resource)
        inventory = self._inventory
        last: bytes | None = None
        try:
            while True:
                snapshot = inventory.snapshot
                current = self._lists.of(snapshot, self._resource)
                # Changes elsewhere in the inventory need not reach this resource's kubelet.
                if current != last:
                    if (problem := too_big(self._resource, len(current))) is not None:
                        # Sent, it would end the kubelet's stream; not sent, it is said loudly (and on /healthz).
                        log.error("not sending the device list: %s", problem)
                    else:
                        yield current
                    last = current
                await inventory.wait_for_change(snapshot.version)
        finally:
            if this in self._streams:
                self._streams.remove(this)
            self._streams_changed()

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        snapshot = self._inventory.snapshot
        plan = snapshot.resource(self._resource)
        response = pb.PreferredAllocationResponse()
        policy = snapshot.config.plugin.allocation_policy
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
            self._error.inc()
            raise
        finally:
            self._seconds.observe(time.perf_counter() - started)
        self._ok.inc()
        return response

    async def _allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        if not request.container_requests:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self._resource}: no container requests")
        response = pb.AllocateResponse()
        snapshot = self._inventory.snapshot
        strategies = snapshot.config.plugin.device_list_strategy
        with_cdi = "cdi-cri" in strategies or "cdi-annotations" in strategies
        for number, container in enumerate(request.container_requests):
            try:
                units = resolve_request(snapshot, self._resource, list(container.devices_ids))
            except RequestError as exc:
                prefix = f"container request {number}: " if len(request.container_requests) > 1 else ""
                log.warning("Allocate refused: %s%s", prefix, exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{prefix}{exc}")
            names: list[str] = []
            annotation = ""
            if with_cdi:
                gpu_ids = list(dict.fromkeys(u.gpu_id for u in units))
                names = [cdi.qualified_name(self._cdi_kind, cdispec.device_name(snapshot.gpus[g])) for g in gpu_ids]
                annotation = cdispec.annotation_key(self._resource, [u.id for u in units])
            edits = container_edits(units, snapshot.gpus)
            layer = await self._layer_edits(snapshot, units)
            if layer is not None:
                edits.merge(layer)
            response.container_responses.append(edits_to_response(edits, strategies, names, annotation))
            self._units.inc(len(units))
            # Debug, not info: a line per Allocate costs more than the Allocate itself.
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s: allocated %s", self._resource, ", ".join(u.id for u in units))
        return response

    async def _layer_edits(self, snapshot: Snapshot, units: Sequence[Unit]) -> ContainerEdits | None:
        """The Vulkan layer's edits for a container given shares of a GPU; None where nothing is enforced."""
        enforcer = self._enforcer
        sharing = snapshot.config.sharing
        enforce = Enforce(sharing.enforce_memory, sharing.enforce_compute)
        if not enforce:
            return None
        budgets = unit_budgets(units, snapshot.gpus, enforce)
        if not budgets:
            return None
        edits = await enforcer.allocate(units, budgets) if enforcer is not None else None
        return with_limits(edits, budgets, enforcer.layer.path if enforcer is not None else None, hooks=False)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreStartContainerResponse:
        # Advertised off (pre_start_required=False); answered anyway so a confused caller gets no error.
        return pb.PreStartContainerResponse()
