"""The DRA side of the kit, in the shape of Kubernetes' Go kubelet-plugin helper: the DRAPlugin v1 and v1beta1
servicers, the checks of the kubelet's claim references (once, here), the prepare and unprepare metrics, and the
resource health stream. A driver gives it two callbacks (DraDriver): prepare(claims), answering each claim with its
devices or its error, and unprepare(claims), answering each with "" or why not; it sees only claims that passed
the checks. Registration is the kit's too (registration.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

import grpc
import msgspec

from gpuppetti._proto.dra.v1 import api_pb2 as v1
from gpuppetti._proto.dra.v1 import api_pb2_grpc as v1_grpc
from gpuppetti._proto.dra.v1beta1 import api_pb2 as v1beta1
from gpuppetti._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpuppetti._proto.drahealth.v1alpha1 import api_pb2 as health
from gpuppetti._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from gpuppetti.base.memory import give_back_free_memory
from gpuppetti.base.syntax import DNS_LABEL, UID, is_dns_subdomain
from gpuppetti.kit.seams import Changing, PluginMetrics, Versioned

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
PLUGIN_TYPE = "DRAPlugin"
# The kubelet marks a device Unknown when it hears nothing about it for this long; re-send well within it.
HEALTH_REFRESH_S = 10.0


@dataclass(frozen=True)
class ClaimRef:
    """The kubelet's reference to a claim."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


def named(claims: Sequence[ClaimRef], shown: int = 5) -> str:
    """``2 claim(s): default/a (uid), default/b (uid)``, naming at most the first few: one log line per call, and a
    kubelet call can carry a thousand claims."""
    names = ", ".join(str(claim) for claim in claims[:shown])
    more = f" and {len(claims) - shown} more" if len(claims) > shown else ""
    return f"{len(claims)} claim(s): {names}{more}"


# A Struct: compact (a driver holds these for every prepared claim, and a node may hold a thousand), and encoded
# and decoded whole where a driver records them (the DRA driver's checkpoint, which takes a field it does not know
# for damage). Untracked by the cyclic collector (gc=False): it holds strings and lists of them, never itself.
class PreparedDevice(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One device of a prepared claim, as the kubelet is told it."""

    request_names: list[str]
    pool: str
    device: str
    cdi_device_ids: list[str]
    share_id: str | None = None


class DraDriver(Protocol):
    """What a DRA driver gives the helper: the claims it is given passed claim_problem, none listed twice."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, Sequence[PreparedDevice] | Exception]:
        """Each claim's devices, or the error its entry gets."""
        ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Each claim's answer: "" once it is unprepared, else why not."""
        ...


def claim_problem(claim: ClaimRef) -> str | None:
    """Why the kubelet's reference cannot be a real claim; None when it can."""
    # A claim UID becomes part of a file name: nothing but a UID may pass.
    if not UID.fullmatch(claim.uid):
        return f"claim uid {claim.uid[:80]!r} is not a Kubernetes UID"
    if not DNS_LABEL.fullmatch(claim.namespace):
        return f"claim namespace {claim.namespace[:80]!r} is not a valid namespace name"
    if not is_dns_subdomain(claim.name):
        return f"claim name {claim.name[:80]!r} is not a valid object name"
    return None


def _claims(request: Any) -> list[ClaimRef]:
    # A driver keeps these strings for every prepared claim (its records), and a node's claims are in few
    # namespaces: one string per namespace, not one per claim.
    return [ClaimRef(sys.intern(c.namespace), c.uid, c.name) for c in request.claims]


def _malformed(claims: Sequence[ClaimRef]) -> str | None:
    missing = [f"claims[{i}]" for i, c in enumerate(claims) if not (c.uid and c.name and c.namespace)]
    if missing:
        return f"claims need a namespace, uid and name: {', '.join(missing)}"
    uids = [c.uid for c in claims]
    duplicates = sorted(uid for uid, count in Counter(uids).items() if count > 1)
    if duplicates:
        return f"claims listed more than once: {', '.join(duplicates)}"
    return None


def _checked(claims: Sequence[ClaimRef]) -> tuple[list[ClaimRef], dict[str, str]]:
    """The claims that may reach the driver, and the problem of each that may not."""
    valid: list[ClaimRef] = []
    problems: dict[str, str] = {}
    for claim in claims:
        if (problem := claim_problem(claim)) is not None:
            problems[claim.uid] = problem
        else:
            valid.append(claim)
    return valid, problems


class DraService:
    """The version-independent part: one answer per claim, errors per claim, the driver's callbacks around."""

    def __init__(self, driver: DraDriver, metrics: PluginMetrics) -> None:
        self.driver = driver
        self._metrics = metrics

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Sequence[PreparedDevice] | str]:
        answers: dict[str, Sequence[PreparedDevice] | str] = {}
        valid, problems = _checked(claims)
        with self._metrics.prepare_seconds.time():
            try:
                results: Mapping[str, Sequence[PreparedDevice] | Exception] = \
                    await self.driver.prepare(valid) if valid else {}
            except Exception as exc:  # never a gRPC error: the kubelet would ignore every claim's answer
                log.exception("prepare failed")
                results = dict.fromkeys((claim.uid for claim in valid), RuntimeError(f"internal error: {exc}"))
        failed = 0
        for claim in claims:
            result = problems.get(claim.uid) or results[claim.uid]
            if isinstance(result, str | Exception):
                log.warning("prepare %s/%s (%s) failed: %s", claim.namespace, claim.name, claim.uid, result)
                answers[claim.uid] = str(result)
                failed += 1
            else:
                answers[claim.uid] = result
        # Counted once per call, not per claim: a call can carry a thousand.
        if failed:
            self._metrics.prepare_requests.labels("error").inc(failed)
        if len(claims) > failed:
            self._metrics.prepare_requests.labels("ok").inc(len(claims) - failed)
        # A call can name a thousand claims, read and planned at once: what that took is not kept.
        give_back_free_memory()
        return answers

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        valid, answers = _checked(claims)
        with self._metrics.unprepare_seconds.time():
            try:
                answers.update(await self.driver.unprepare(valid) if valid else {})
            except Exception as exc:  # never a gRPC error: the kubelet would ignore every claim's answer
                log.exception("unprepare failed")
                answers.update({claim.uid: f"internal error: {exc}" for claim in valid})
        for claim in claims:
            error = answers[claim.uid]
            if error:
                log.warning("unprepare %s/%s (%s) failed: %s", claim.namespace, claim.name, claim.uid, error)
            self._metrics.unprepare_requests.labels("error" if error else "ok").inc()
        give_back_free_memory()
        return {claim.uid: answers[claim.uid] for claim in claims}


class _DraPlugin:
    """Both DRAPlugin versions: their messages differ only in v1's Device.share_id."""

    def __init__(self, service: DraService, messages: ModuleType, share_ids: bool) -> None:
        self._service = service
        self._messages = messages
        self._share_ids = share_ids

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        claims = _claims(request)
        if problem := _malformed(claims):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        response = self._messages.NodePrepareResourcesResponse()
        for uid, answer in (await self._service.prepare(claims)).items():
            entry = response.claims[uid]
            if isinstance(answer, str):
                entry.error = answer
                continue
            for device in answer:
                added = entry.devices.add(request_names=device.request_names, pool_name=device.pool,
                                          device_name=device.device, cdi_device_ids=device.cdi_device_ids)
                # v1beta1 has no share_id; there the CDI ids alone tell the runtime what to inject.
                if device.share_id and self._share_ids:
                    added.share_id = device.share_id
        return response

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        claims = _claims(request)
        if problem := _malformed(claims):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        response = self._messages.NodeUnprepareResourcesResponse()
        for uid, error in (await self._service.unprepare(claims)).items():
            response.claims[uid].error = error
        return response


class DraPluginV1(_DraPlugin, v1_grpc.DRAPluginServicer):
    def __init__(self, service: DraService) -> None:
        super().__init__(service, v1, share_ids=True)


class DraPluginV1beta1(_DraPlugin, v1beta1_grpc.DRAPluginServicer):
    def __init__(self, service: DraService) -> None:
        super().__init__(service, v1beta1, share_ids=False)


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """One device of the pool, as the health stream tells the kubelet of it: the message says why it is not healthy."""

    device: str
    healthy: bool
    message: str = ""


S = TypeVar("S", bound=Versioned)


def health_list(devices: Iterable[DeviceHealth], node: str) -> health.NodeWatchResourcesResponse:
    response = health.NodeWatchResourcesResponse()
    now = int(time.time())
    for device in devices:
        response.devices.add(
            device=health.DeviceIdentifier(pool_name=node, device_name=device.device),
            health=health.HEALTHY if device.healthy else health.UNHEALTHY, last_updated_time=now,
            message="" if device.healthy else device.message,
        )
    return response


class ResourceHealth(health_grpc.DRAResourceHealthServicer, Generic[S]):
    """The health stream of the pool on ``node``: ``health_of`` reads its devices' health from one of ``source``'s
    snapshots."""

    def __init__(self, source: Changing[S], health_of: Callable[[S], Iterable[DeviceHealth]], node: str) -> None:
        self._source = source
        self._health_of = health_of
        self._node = node

    async def NodeWatchResources(
        self, request: health.NodeWatchResourcesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health.NodeWatchResourcesResponse]:
        source = self._source
        while True:
            snapshot = source.snapshot
            seen = snapshot.version
            yield health_list(self._health_of(snapshot), self._node)
            # Each message is the complete list; re-send it before the kubelet's staleness timeout too.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HEALTH_REFRESH_S):
                    await source.wait_for_change(seen)


def add_services(server: grpc.aio.Server, service: DraService, resource_health: ResourceHealth[Any]) -> None:
    v1_grpc.add_DRAPluginServicer_to_server(DraPluginV1(service), server)
    v1beta1_grpc.add_DRAPluginServicer_to_server(DraPluginV1beta1(service), server)
    health_grpc.add_DRAResourceHealthServicer_to_server(resource_health, server)
