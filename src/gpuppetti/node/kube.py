"""The Kubernetes API, as the DRA driver and the node labeller use it: the one boundary every call goes through.

lightkube loads the kubeconfig or the in-cluster service account and makes the requests: the official client's
asyncio fork loads every model of every API group when it is imported, which a driver's start and memory would pay
for the seven calls below (bench/README.md has what that weighed).

At this boundary every request is bounded in time, every answer is validated into a typed object of ``kubeobjects``
(a malformed one is a failure like any other), and every failure is an ApiError, which callers retry with backoff.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import msgspec
from lightkube import AsyncClient
from lightkube.config import client_adapter
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core import exceptions as lightkube_errors
from lightkube.core import resource as lightkube_resource
from lightkube.operators import BinaryOperator, SequenceOperator
from lightkube.types import PatchType

# ApiError is the kit's word for a failed call too (its slice writer raises it): it lives with the objects.
from gpuppetti.core.kubeobjects import ApiError as ApiError
from gpuppetti.core.kubeobjects import Node, ObjectMeta, ResourceClaim, ResourceSlice, ResourceSliceBody

log = logging.getLogger(__name__)

# One request, connect to last byte: a hung API server must not hold a kubelet call (45 s) or a lock.
REQUEST_TIMEOUT_S = 10.0
# A watch is ended by the server after this long, and started again by its caller.
WATCH_TIMEOUT_S = 300
FIELD_MANAGER = "gpuppetti"
# Claims read per request when a namespace is listed. A page is decoded whole before its claims are handed on:
# smaller pages make a large Prepare wait on more requests, larger ones leave the driver holding more memory after
# it for no gain in time (bench/README.md has the figures). A call lists only where it names at least LIST_FROM
# claims of one namespace.
LIST_PAGE = 250

T = TypeVar("T")


def _api(group: str, kind: str, plural: str, verbs: list[str]) -> lightkube_resource.ApiInfo:
    return lightkube_resource.ApiInfo(resource=lightkube_resource.ResourceDef(group, "v1", kind), plural=plural,
                                      verbs=verbs)


# What is read is decoded by lightkube straight into kubeobjects' types (it decodes into any msgspec Struct that
# names its API): only the fields the driver uses are built, and a slice's 128 devices, which the API echoes back
# after every write and in every watch event, are skipped unread, as are a claim's managedFields: building a dict
# of the whole object, then a model of it, would be most of what publishing a large pool costs the driver's CPU. An
# answer that is not what it says fails to decode: a msgspec.ValidationError, so an ApiError here.
class _Meta(ObjectMeta, frozen=True):
    # lightkube's watch asks each object for its version by the API's name.
    @property
    def resourceVersion(self) -> str | None:
        return self.resource_version


class _Claim(ResourceClaim, lightkube_resource.NamespacedResource, frozen=True):
    _api_info = _api("resource.k8s.io", "ResourceClaim", "resourceclaims", ["get", "list"])


class _Slice(ResourceSlice, lightkube_resource.GlobalResource, frozen=True):
    _api_info = _api("resource.k8s.io", "ResourceSlice", "resourceslices", ["delete", "list", "watch"])
    metadata: _Meta = msgspec.field(default_factory=_Meta)


class _Node(Node, lightkube_resource.GlobalResource, frozen=True):
    _api_info = _api("", "Node", "nodes", ["get", "patch"])


class _WrittenSlice(msgspec.Struct, lightkube_resource.GlobalResource, kw_only=True, omit_defaults=True):
    """A slice to create or replace. The request carries the body whole; its answer (lightkube decodes it into
    the class it sent) is read for the metadata alone, the spec kept as the bytes it came in."""

    _api_info = _api("resource.k8s.io", "ResourceSlice", "resourceslices", ["post", "put"])
    # The API's own names, as lightkube reads them.
    apiVersion: str
    kind: str
    metadata: _Meta
    spec: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _ClaimStatus(msgspec.Struct, lightkube_resource.NamespacedSubResource, kw_only=True, omit_defaults=True):
    """A claim's status, as the driver applies its own entries of it; the answer is read for its metadata alone."""

    _api_info = lightkube_resource.ApiInfo(
        resource=lightkube_resource.ResourceDef("resource.k8s.io", "v1", "ResourceClaim"),
        parent=lightkube_resource.ResourceDef("resource.k8s.io", "v1", "ResourceClaim"), plural="resourceclaims",
        verbs=["patch"], action="status")
    apiVersion: str = "resource.k8s.io/v1"
    kind: str = "ResourceClaim"
    metadata: _Meta = msgspec.field(default_factory=_Meta)


class NotFound(ApiError):
    pass


class ConfigError(Exception):
    """No API server can be configured from what was given; the message says why, after the file it is about."""

    def __init__(self, message: str, problem: str | None = None) -> None:
        super().__init__(message)
        self.problem = problem or message


def _bad(path: Path, problem: str) -> ConfigError:
    return ConfigError(f"{path}: {problem}", problem)


def _error(exc: BaseException, what: str, timeout: float) -> ApiError:
    if isinstance(exc, KeyError) and isinstance(exc.__context__, httpx2.HTTPStatusError):
        # lightkube reads an error answer's Content-Type, and fails with a KeyError where there is none: what
        # answered is what to say.
        exc = exc.__context__
    if isinstance(exc, lightkube_errors.ApiError):
        status = exc.status.code or exc.response.status_code
        kind = NotFound if status == 404 else ApiError
        return kind(f"{what}: {status} {exc.status.message or exc.status.reason or ''}".rstrip(), status)
    if isinstance(exc, httpx2.HTTPStatusError):
        # An answer that is not the API's own Status (a proxy's, say).
        status = exc.response.status_code
        kind = NotFound if status == 404 else ApiError
        content_type = exc.response.headers.get("content-type")
        if content_type is None or not content_type.startswith("application/json"):
            # Not the API server's own answer, which is JSON: a web server, a proxy or something else is there.
            answered = f"an answer of {content_type}" if content_type else "an answer without a Content-Type"
            return kind(f"{what}: {status} {exc.response.reason_phrase}, {answered}: not a Kubernetes API server's "
                        "answer (is this the API server's address?)", status)
        return kind(f"{what}: {status} {exc.response.reason_phrase}", status)
    if isinstance(exc, httpx2.TimeoutException | TimeoutError):
        return ApiError(f"{what}: no answer within {timeout:g}s")
    if isinstance(exc, msgspec.ValidationError):
        return ApiError(f"{what}: the answer is not what was asked for ({exc})")
    return ApiError(f"{what}: {exc or type(exc).__name__}")


# What can go wrong talking to the API: a refusal, a timeout, a cut connection, an answer that is not what it says.
FAILURES = (lightkube_errors.ApiError, httpx2.HTTPError, TimeoutError, OSError, ValueError, TypeError, KeyError,
            AttributeError, lightkube_errors.LoadResourceError)


def load_config(kubeconfig: Path | None) -> KubeConfig:
    """The API server from ``kubeconfig``, or the in-cluster service account when none is given; checked whole
    here (lightkube reads the current context only when a client is made, by then inside a task group). Raises
    ConfigError, whose message is one line naming the file."""
    if kubeconfig is None:
        try:
            return KubeConfig.from_service_account()
        except (lightkube_errors.ConfigError, OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"the in-cluster service account: {_one_line(exc)}") from None
    return read_kubeconfig(kubeconfig)


def read_kubeconfig(path: Path, current: bool = True) -> KubeConfig:
    """The kubeconfig at ``path`` (the first existing one of a ``:``-separated list, as kubectl merges them only
    for contexts we do not use), with a current context that names a cluster (unless ``current`` is False: a
    command that takes --context chooses its own). Raises ConfigError."""
    import yaml

    candidates = [Path(part).expanduser() for part in str(path).split(":") if part]
    chosen = next((candidate for candidate in candidates if candidate.is_file()), candidates[0] if candidates
                  else path)
    try:
        if chosen.stat().st_size > KUBECONFIG_LIMIT:
            raise _bad(chosen, f"larger than {KUBECONFIG_LIMIT >> 20} MiB: not a kubeconfig")
        with chosen.open("rb") as file:
            document = yaml.safe_load(file.read(KUBECONFIG_LIMIT))
        if not isinstance(document, dict):
            raise _bad(chosen, "not a kubeconfig (a YAML mapping with clusters, contexts and users)")
        if current and not document.get("current-context"):
            raise _bad(chosen, "no current context: choose one with kubectl config use-context NAME")
        config = KubeConfig.from_dict(document, fname=chosen)
        if current:
            config.get()  # the current context, its cluster and user: what a client would ask for first
        return config
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not YAML"
        raise _bad(chosen, f"not valid YAML{where}: {problem}") from None
    except OSError as exc:
        raise _bad(chosen, f"cannot be read: {exc.strerror or exc}") from None
    except (lightkube_errors.ConfigError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _bad(chosen, _one_line(exc)) from None


# A kubeconfig is a few KiB; one with embedded certificates tens. Past this it is not one.
KUBECONFIG_LIMIT = 4 << 20


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"not a kubeconfig: no {exc.args[0]!r}" if exc.args else "not a kubeconfig"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _fields(node: str, driver: str) -> dict[str, str | BinaryOperator | SequenceOperator]:
    return {"spec.nodeName": node, "spec.driver": driver}


def _slice_object(body: ResourceSliceBody) -> _WrittenSlice:
    return _WrittenSlice(apiVersion=body["apiVersion"], kind=body["kind"],
                         metadata=msgspec.convert(body["metadata"], _Meta),
                         spec=msgspec.Raw(msgspec.json.encode(body["spec"])))


@dataclass(frozen=True)
class ServerFacts:
    """What the API server says of itself: its version, and its feature gates where its /metrics may be read."""

    version: str
    # (major, minor), None when the version does not say.
    release: tuple[int, int] | None
    # Each gate's state; None when /metrics cannot be read (``gates_problem`` says why).
    gates: dict[str, bool] | None
    gates_problem: str = ""


_RELEASE = re.compile(r"v?(\d+)\.(\d+)")


async def server_facts(config: KubeConfig, timeout: float = REQUEST_TIMEOUT_S) -> ServerFacts:
    """The API server's /version and the kubernetes_feature_enabled series of its /metrics (a non-resource path:
    an account needs ``get`` on it, which admins have and the daemons' accounts do not). Raises ApiError when the
    version cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    # lightkube makes no request of a non-resource path: its adapter gives an HTTP client with the kubeconfig's
    # server, credentials and trust.
    try:
        current = config.get()
        if current is None:
            raise ApiError("the kubeconfig names no current context")
        http = client_adapter.AsyncClient(current, client_adapter.ConnectionParams(timeout=httpx2.Timeout(timeout)))
    except FAILURES as exc:
        raise _error(exc, "connecting to the API server", timeout) from None
    async with http:
        try:
            answer = await http.get("/version")
            answer.raise_for_status()
            version = str(answer.json().get("gitVersion", ""))
        except FAILURES as exc:
            raise _error(exc, "reading the API server's /version", timeout) from None
        found = _RELEASE.match(version)
        release = (int(found[1]), int(found[2])) if found else None
        try:
            answer = await http.get("/metrics")
            answer.raise_for_status()
        except httpx2.HTTPStatusError as exc:
            return ServerFacts(version, release, None, f"its /metrics answered {exc.response.status_code}")
        except FAILURES as exc:
            return ServerFacts(version, release, None, str(_error(exc, "reading /metrics", timeout)))
    gates: dict[str, bool] = {}
    for family in text_string_to_metric_families(answer.text):
        if family.name == "kubernetes_feature_enabled":
            for sample in family.samples:
                gates[sample.labels.get("name", "")] = sample.value == 1
    return ServerFacts(version, release, gates)


class Kube:
    """The typed operations the daemons need, each bounded by ``timeout``; every failure raises ApiError."""

    def __init__(self, config: KubeConfig, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self._timeout = timeout
        # The proxy environment is read once here, not on every request.
        self._client = AsyncClient(config, timeout=httpx2.Timeout(timeout), field_manager=FIELD_MANAGER)

    async def _call(self, what: str, call: Awaitable[T]) -> T:
        try:
            return await call
        except FAILURES as exc:  # msgspec.ValidationError is a ValueError: an answer that is not what it says
            raise _error(exc, what, self._timeout) from None

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        return await self._call(f"reading ResourceClaim {namespace}/{name}",
                                self._client.get(_Claim, name, namespace=namespace))

    async def list_claims(self, namespace: str, names: Collection[str]) -> AsyncIterator[ResourceClaim]:
        """The ResourceClaims of ``namespace`` that are named in ``names``, as they are read: a few requests where a
        kubelet call names many. The namespace is read a page at a time and each named claim is handed on at once,
        so that neither the namespace nor the call's claims are ever held whole. Raises ApiError, possibly after
        some claims."""
        try:
            async for item in self._client.list(_Claim, namespace=namespace, chunk_size=LIST_PAGE):
                if item.metadata.name in names:
                    yield item
        except FAILURES as exc:  # msgspec.ValidationError is a ValueError: an answer that is not what it says
            raise _error(exc, f"listing the ResourceClaims of namespace {namespace}", self._timeout) from None

    async def apply_claim_status(self, namespace: str, name: str, uid: str, manager: str,
                                 devices: list[dict[str, Any]]) -> None:
        """Make ``devices`` the entries of ResourceClaim ``namespace/name``'s ``status.devices`` that ``manager``
        owns, by a server-side apply of its status: entries it applied before and leaves out now are removed, other
        managers' entries are kept. ``uid`` is a precondition: a claim replaced meanwhile fails with 409."""
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": namespace, "uid": uid}, "status": {"devices": devices}}
        await self._call(f"writing the status of ResourceClaim {namespace}/{name}", self._client.patch(
            _ClaimStatus, name, body, namespace=namespace, patch_type=PatchType.APPLY, field_manager=manager,
            force=True))

    async def node_uid(self, node: str) -> str:
        found = await self._call(f"reading Node {node}", self._client.get(_Node, node))
        if not found.metadata.uid:
            raise ApiError(f"reading Node {node}: the answer has no uid")
        return found.metadata.uid

    async def node_labels(self, node: str) -> dict[str, str]:
        found = await self._call(f"reading Node {node}", self._client.get(_Node, node))
        return dict(found.metadata.labels or {})

    async def label_node(self, node: str, labels: dict[str, str | None]) -> None:
        """Set (a value) and remove (None) labels of ``node``, by a merge patch."""
        await self._call(f"labelling Node {node}", self._client.patch(
            _Node, node, {"metadata": {"labels": labels}}, patch_type=PatchType.MERGE))

    async def list_slices(self, node: str, driver: str) -> list[ResourceSlice]:
        """The ResourceSlices of ``driver`` on ``node``."""
        async def listed() -> list[ResourceSlice]:
            return [item async for item in self._client.list(_Slice, fields=_fields(node, driver))]

        return await self._call("listing ResourceSlices", listed())

    async def create_slice(self, body: ResourceSliceBody) -> str:
        """Create a slice; returns its resourceVersion."""
        name = body["metadata"]["name"]
        return await self._version(f"creating ResourceSlice {name}", self._client.create(_slice_object(body)))

    async def replace_slice(self, name: str, body: ResourceSliceBody) -> str:
        return await self._version(f"updating ResourceSlice {name}", self._client.replace(_slice_object(body)))

    async def _version(self, what: str, call: Awaitable[Any]) -> str:
        """The resourceVersion of a written slice. Only its metadata is read: the API echoes 128 devices back."""
        written: _WrittenSlice = await self._call(what, call)
        version = written.metadata.resource_version
        if not version:
            raise ApiError(f"{what}: the answer has no resourceVersion")
        return version

    async def delete_slice(self, name: str) -> None:
        with contextlib.suppress(NotFound):
            await self._call(f"deleting ResourceSlice {name}", self._client.delete(_Slice, name))

    async def watch_slices(self, node: str, driver: str) -> AsyncIterator[tuple[str, str, str]]:
        """(event type, slice name, resourceVersion) for this node's slices, until the watch ends. Raises ApiError
        when it breaks: the caller watches again."""
        try:
            async for event, item in self._client.watch(_Slice, fields=_fields(node, driver),
                                                        server_timeout=WATCH_TIMEOUT_S):
                yield str(event), item.metadata.name, item.metadata.resource_version or ""
        except FAILURES as exc:
            raise _error(exc, "watching ResourceSlices", self._timeout) from None

    async def close(self) -> None:
        await self._client.close()
