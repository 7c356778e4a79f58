"""The Kubernetes API, as the driver and the node labeller use it: the asyncio fork of the official client,
configured from a kubeconfig or in-cluster, with every request bounded in time.

Two things differ from the client's defaults, both for speed: the connection pool is large enough for a kubelet
call that prepares hundreds of claims at once, and the proxy environment is read once, at start, instead of on
every request (aiohttp's ``trust_env`` looks up the proxy variables and ~/.netrc in a thread per request).
Responses are read raw and parsed into the typed objects of ``kubeobjects``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from gpuppetti.kubeobjects import ResourceClaim, ResourceClaimList, ResourceSlice, ResourceSliceBody

log = logging.getLogger(__name__)

RESOURCE_GROUP = "resource.k8s.io"
RESOURCE_VERSION = "v1"
SLICES = "resourceslices"
# One request, connect to last byte: a hung API server must not hold a kubelet call (45 s) or a lock.
REQUEST_TIMEOUT_S = 10.0
CONNECTIONS = 64
WATCH_TIMEOUT_S = 300


class ApiError(Exception):
    """The API server refused a request, or could not be reached. ``status`` is None when there was no answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotFound(ApiError):
    pass


def _proxy_for(host: str) -> str | None:
    """The proxy the environment names for ``host`` (HTTPS_PROXY, honouring NO_PROXY), read once."""
    from urllib.parse import urlsplit

    parts = urlsplit(host)
    if parts.hostname and urllib.request.proxy_bypass(parts.hostname):
        return None
    return urllib.request.getproxies().get(parts.scheme or "https")


class _Plain(dict[str, Any]):
    """A request body made of JSON's own types, as the driver builds its slices: nothing to sanitise."""


class _ApiClient(client.ApiClient):
    """The client, except that it sends a body it is told is plain as it is: sanitising walks every value of a
    slice of 128 devices in Python, which cost more than the request itself."""

    def sanitize_for_serialization(self, obj: Any) -> Any:
        if isinstance(obj, _Plain):
            return obj
        return super().sanitize_for_serialization(obj)


async def api_client(kubeconfig: Path | None) -> client.ApiClient:
    """A client for ``kubeconfig``, or the in-cluster service account when none is given."""
    configuration = client.Configuration()
    if kubeconfig is not None:
        await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = CONNECTIONS
    if configuration.proxy is None:
        configuration.proxy = _proxy_for(configuration.host or "")
    api = _ApiClient(configuration)
    rest = api.rest_client
    session = rest.pool_manager
    # Same connector (TLS, pool), without the per-request environment look-ups.
    rest.pool_manager = aiohttp.ClientSession(connector=session.connector, trust_env=False, read_bufsize=2**21)
    session.detach()
    return api


def _error(exc: Exception, what: str, timeout: float = REQUEST_TIMEOUT_S) -> ApiError:
    if isinstance(exc, ApiException):
        status = exc.status or None
        kind = NotFound if status == 404 else ApiError
        return kind(f"{what}: {exc.status} {exc.reason}", status)
    if isinstance(exc, TimeoutError):
        return ApiError(f"{what}: no answer within {timeout:g}s")
    return ApiError(f"{what}: {exc or type(exc).__name__}")


def _version(answer: bytes, name: str) -> str:
    """The resourceVersion of a written slice. Only its metadata is parsed: the API echoes 128 devices back."""
    try:
        version = ResourceSlice.model_validate_json(answer).metadata.resource_version
    except ValueError as exc:
        raise ApiError(f"writing ResourceSlice {name}: the answer is not a ResourceSlice ({exc})") from None
    if not version:
        raise ApiError(f"writing ResourceSlice {name}: the answer has no resourceVersion")
    return version


# What can go wrong talking to the API: a refusal, a timeout, a cut connection, a body that is not what it says.
FAILURES = (ApiException, TimeoutError, aiohttp.ClientError, OSError, ValueError)


class Kube:
    """The typed operations the driver needs, each bounded by ``timeout``; failures raise ApiError."""

    def __init__(self, api: client.ApiClient, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.api = api
        self._timeout = timeout
        self._custom = client.CustomObjectsApi(api)
        self._resource = client.ResourceV1Api(api)
        self._core = client.CoreV1Api(api)

    async def _raw(self, call: Any, *args: Any, what: str, **kwargs: Any) -> bytes:
        try:
            response = await call(*args, _preload_content=False, _request_timeout=self._timeout, **kwargs)
            try:
                body: bytes = await response.read()
            finally:
                response.release()
        except FAILURES as exc:
            raise _error(exc, what, self._timeout) from None
        if not 200 <= response.status <= 299:
            kind = NotFound if response.status == 404 else ApiError
            message = body[:300].decode(errors="replace")
            with_reason = message
            with contextlib.suppress(ValueError):
                with_reason = str(json.loads(body).get("message", message))
            raise kind(f"{what}: {response.status} {with_reason}", response.status)
        return body

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        what = f"reading ResourceClaim {namespace}/{name}"
        body = await self._raw(self._resource.read_namespaced_resource_claim, name, namespace, what=what)
        try:
            return ResourceClaim.model_validate_json(body)
        except ValueError as exc:
            raise ApiError(f"{what}: the answer is not a ResourceClaim ({exc})") from None

    async def list_claims(self, namespace: str) -> dict[str, ResourceClaim]:
        """Every ResourceClaim of ``namespace``, by name: one request where a kubelet call names many."""
        what = f"listing the ResourceClaims of namespace {namespace}"
        body = await self._raw(self._resource.list_namespaced_resource_claim, namespace, what=what)
        try:
            listed = ResourceClaimList.model_validate_json(body)
        except ValueError as exc:
            raise ApiError(f"{what}: the answer is not a ResourceClaimList ({exc})") from None
        return {claim.metadata.name: claim for claim in listed.items}

    async def node_uid(self, node: str) -> str:
        body = await self._raw(self._core.read_node, node, what=f"reading Node {node}")
        uid = json.loads(body).get("metadata", {}).get("uid")
        if not isinstance(uid, str):
            raise ApiError(f"reading Node {node}: the answer has no uid")
        return uid

    async def list_slices(self, selector: str) -> list[ResourceSlice]:
        body = await self._raw(self._custom.list_cluster_custom_object, RESOURCE_GROUP, RESOURCE_VERSION, SLICES,
                               field_selector=selector, what="listing ResourceSlices")
        items = json.loads(body).get("items") or []
        return [ResourceSlice.model_validate(item) for item in items]

    async def create_slice(self, body: ResourceSliceBody) -> str:
        """Create a slice; returns its resourceVersion."""
        answer = await self._raw(self._custom.create_cluster_custom_object, RESOURCE_GROUP, RESOURCE_VERSION,
                                 SLICES, _Plain(body), what=f"creating ResourceSlice {body['metadata']['name']}")
        return _version(answer, body["metadata"]["name"])

    async def replace_slice(self, name: str, body: ResourceSliceBody) -> str:
        answer = await self._raw(self._custom.replace_cluster_custom_object, RESOURCE_GROUP, RESOURCE_VERSION,
                                 SLICES, name, _Plain(body), what=f"updating ResourceSlice {name}")
        return _version(answer, name)

    async def delete_slice(self, name: str) -> None:
        with contextlib.suppress(NotFound):
            await self._raw(self._custom.delete_cluster_custom_object, RESOURCE_GROUP, RESOURCE_VERSION, SLICES, name,
                            what=f"deleting ResourceSlice {name}")

    async def watch_slices(self, selector: str) -> AsyncIterator[tuple[str, str, str]]:
        """(event type, slice name, resourceVersion) for this node's slices, until the watch ends. Raises ApiError
        when it breaks: the caller watches again."""
        try:
            async with watch.Watch() as stream:
                async for event in stream.stream(
                    self._custom.list_cluster_custom_object, RESOURCE_GROUP, RESOURCE_VERSION, SLICES,
                    field_selector=selector, timeout_seconds=WATCH_TIMEOUT_S,
                ):
                    meta = (event.get("object") or {}).get("metadata") or {}
                    yield str(event.get("type")), str(meta.get("name")), str(meta.get("resourceVersion"))
        except FAILURES as exc:
            raise _error(exc, "watching ResourceSlices") from None

    async def close(self) -> None:
        await self.api.close()
