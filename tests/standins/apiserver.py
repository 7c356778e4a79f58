"""A Kubernetes API stand-in for the sandbox and the tests, where no kube-apiserver can run.

It serves the core/v1 and resource.k8s.io/v1 paths that gpuppetti uses and behaves like the real server where
that matters to a client: resourceVersions that move on every write, optimistic-concurrency conflicts, status
subresources, label and field selectors, watches that replay from a resourceVersion (or answer 410 Gone when it
is too old), and every written object validated before it is stored. Server-side apply of a ResourceClaim's status
is served as the API serves it for ``status.devices``: each field manager's entries, keyed as the API keys them;
any other apply is taken as a merge patch.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import secrets
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

Validator = Callable[[dict[str, Any]], None]
# A fault to play for a request (method, path and query): "hang" (never answer), "drop" (cut the connection without
# an answer), "garbage" (a watch whose next event is not JSON), or None to answer as usual.
Fault = Callable[[str, str], str | None]
HISTORY = 5000


@dataclass(frozen=True)
class Kind:
    prefix: str
    plural: str
    kind: str
    namespaced: bool
    status: bool = False

    @property
    def api_version(self) -> str:
        return "v1" if self.prefix == "/api/v1" else self.prefix.removeprefix("/apis/")


KINDS = (
    Kind("/api/v1", "nodes", "Node", namespaced=False, status=True),
    Kind("/api/v1", "namespaces", "Namespace", namespaced=False, status=True),
    Kind("/api/v1", "events", "Event", namespaced=True),
    Kind("/apis/resource.k8s.io/v1", "resourceslices", "ResourceSlice", namespaced=False),
    Kind("/apis/resource.k8s.io/v1", "resourceclaims", "ResourceClaim", namespaced=True, status=True),
    Kind("/apis/resource.k8s.io/v1", "resourceclaimtemplates", "ResourceClaimTemplate", namespaced=True),
    Kind("/apis/resource.k8s.io/v1", "deviceclasses", "DeviceClass", namespaced=False),
)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def response(self) -> web.Response:
        return _json({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        }, status=self.code)


def _json(document: Any, status: int = 200) -> web.Response:
    # As the API server sends it: exactly application/json, no charset (clients compare the header whole).
    return web.Response(body=json.dumps(document).encode(), status=status, headers={"Content-Type": "application/json"})


def _path_value(obj: dict[str, Any], dotted: str) -> Any:
    value: Any = obj
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _selector_matches(obj: dict[str, Any], selector: str, labels: bool) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, operator, want = term.partition("!=" if negate else ("==" if "==" in term else "="))
        if labels:
            have = ((obj.get("metadata") or {}).get("labels") or {}).get(key)
            if not operator:
                # A bare key selects objects that have the label at all.
                if have is None:
                    return False
                continue
        else:
            have = _path_value(obj, key)
        matched = have is not None and str(have) == want
        if matched == negate:
            return False
    return True


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


@dataclass
class _Event:
    rv: int
    kind: Kind
    type: str
    obj: dict[str, Any]


@dataclass
class ApiStandIn:
    validate: Validator | None = None
    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    rejected: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    _rv: int = 0
    _history: list[_Event] = field(default_factory=list)
    # Paged lists in progress, by their continue token's first part.
    _listings: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    _listing_serials: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _runner: web.AppRunner | None = None
    _closing: bool = False
    url: str = ""
    fault: Fault | None = None
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    # The keys of the status.devices entries each field manager applied, by claim uid and manager.
    _applied: dict[tuple[str, str], set[tuple[str, ...]]] = field(default_factory=dict)

    # -- running ------------------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._closing = False
        self._stopped = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        # Open watches (and hung requests) would otherwise hold the server up until their timeouts.
        self._closing = True
        self._stopped.set()
        async with self._changed:
            self._changed.notify_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restart(self, down_for: float = 0.0) -> None:
        """As an API server restart does: every connection cut, the same address back after ``down_for``."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        await self.stop()
        await asyncio.sleep(down_for)
        await self.start(host, int(port))

    def kubeconfig(self) -> str:
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin"}}],
            "users": [{"name": "standin", "user": {}}],
        })

    # -- direct access for tests and the sandbox ----------------------------------------------------------

    def _kind(self, plural: str) -> Kind:
        for kind in KINDS:
            if kind.plural == plural:
                return kind
        raise KeyError(plural)

    def list(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (p, ns, _), o in sorted(self.objects.items())
                if p == plural and (namespace is None or ns == namespace)]

    def get(self, plural: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        obj = self.objects.get((plural, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def create(self, plural: str, obj: dict[str, Any], namespace: str = "") -> dict[str, Any]:
        return copy.deepcopy(await self._create(self._kind(plural), namespace, copy.deepcopy(obj)))

    async def update(
        self, plural: str, obj: dict[str, Any], namespace: str = "", status: bool = False
    ) -> dict[str, Any]:
        stored = await self._update(self._kind(plural), namespace, obj["metadata"]["name"], copy.deepcopy(obj), status)
        return copy.deepcopy(stored)

    async def delete(self, plural: str, name: str, namespace: str = "") -> dict[str, Any]:
        return copy.deepcopy(await self._delete(self._kind(plural), namespace, name))

    async def delete_where(self, plural: str, predicate: Callable[[dict[str, Any]], bool]) -> int:
        doomed = [(ns, name) for (p, ns, name), obj in self.objects.items() if p == plural and predicate(obj)]
        for namespace, name in doomed:
            await self.delete(plural, name, namespace)
        return len(doomed)

    # -- storage ------------------------------------------------------------------------------------------

    async def _record(self, kind: Kind, event_type: str, obj: dict[str, Any]) -> None:
        # Stored objects are never changed in place (every write stores a new one), so history can share them.
        self._history.append(_Event(self._rv, kind, event_type, obj))
        del self._history[:-HISTORY]
        async with self._changed:
            self._changed.notify_all()

    def _check(self, obj: dict[str, Any]) -> None:
        if self.validate is None:
            return
        try:
            self.validate(obj)
        except Exception as exc:
            self.rejected.append((copy.deepcopy(obj), str(exc)))
            raise ApiError(422, "Invalid", f"{obj.get('kind')} {obj.get('metadata', {}).get('name')!r} is "
                                           f"invalid: {exc}") from exc

    def _stamp(self, obj: dict[str, Any]) -> None:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)

    async def _create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Store ``body``, which the caller hands over (it must not change it afterwards)."""
        obj = body
        obj.setdefault("apiVersion", kind.api_version)
        obj.setdefault("kind", kind.kind)
        metadata = obj.setdefault("metadata", {})
        if not metadata.get("name"):
            if not metadata.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name or metadata.generateName is required")
            metadata["name"] = metadata["generateName"] + secrets.token_hex(3)[:5]
        if kind.namespaced:
            if metadata.get("namespace", namespace) != namespace:
                raise ApiError(400, "BadRequest", "the namespace of the object does not match the request")
            metadata["namespace"] = namespace
        key = (kind.plural, namespace, metadata["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{kind.plural} "{metadata["name"]}" already exists')
        if metadata.get("resourceVersion"):
            raise ApiError(422, "Invalid", "metadata.resourceVersion must not be set on create")
        metadata["uid"] = str(uuid.uuid4())
        metadata["creationTimestamp"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        metadata["generation"] = 1
        self._check(obj)
        self._stamp(obj)
        self.objects[key] = obj
        await self._record(kind, "ADDED", obj)
        return obj

    async def _update(
        self, kind: Kind, namespace: str, name: str, body: dict[str, Any], status: bool
    ) -> dict[str, Any]:
        key = (kind.plural, namespace, name)
        current = self.objects.get(key)
        if current is None:
            raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {kind.plural} "{name}": the object '
                                            "has been modified; please apply your changes to the latest version")
        obj = copy.deepcopy(current)
        if status:
            obj["status"] = copy.deepcopy(body.get("status"))
        else:
            replacement = dict(body)
            # A new metadata dict: a merge patch's result may share the stored object's.
            metadata = replacement["metadata"] = dict(replacement.get("metadata") or {})
            for kept in ("uid", "creationTimestamp", "namespace", "name", "generation"):
                if kept in current["metadata"]:
                    metadata[kept] = current["metadata"][kept]
            if kind.status and "status" in current:
                # With a status subresource, the main resource's writes never change the status.
                replacement["status"] = current["status"]
            elif kind.status:
                replacement.pop("status", None)
            if replacement.get("spec") != current.get("spec"):
                metadata["generation"] = current["metadata"].get("generation", 1) + 1
            replacement.setdefault("apiVersion", kind.api_version)
            replacement.setdefault("kind", kind.kind)
            obj = replacement
        self._check(obj)
        self._stamp(obj)
        self.objects[key] = obj
        await self._record(kind, "MODIFIED", obj)
        return obj

    async def _delete(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        key = (kind.plural, namespace, name)
        stored = self.objects.pop(key, None)
        if stored is None:
            raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
        # A new object for the DELETED event: the ADDED and MODIFIED events still hold the stored one.
        obj = {**stored, "metadata": dict(stored["metadata"])}
        self._stamp(obj)
        await self._record(kind, "DELETED", obj)
        return obj

    # -- HTTP ---------------------------------------------------------------------------------------------

    def _route(self, path: str) -> tuple[Kind, str, str | None, str | None]:
        for kind in KINDS:
            if not path.startswith(kind.prefix + "/"):
                continue
            parts = path[len(kind.prefix) + 1:].strip("/").split("/")
            namespace = ""
            if kind.namespaced and len(parts) >= 2 and parts[0] == "namespaces" and kind.plural != "namespaces":
                namespace, parts = parts[1], parts[2:]
            if not parts or parts[0] != kind.plural:
                continue
            name = parts[1] if len(parts) > 1 else None
            sub = parts[2] if len(parts) > 2 else None
            return kind, namespace, name, sub
        raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        action = self.fault(request.method, request.path_qs) if self.fault is not None else None
        if action == "hang":
            await self._stopped.wait()
            return web.Response(status=503)
        if action == "drop" and request.transport is not None:
            request.transport.abort()
            return web.Response(status=503)
        try:
            kind, namespace, name, sub = self._route(request.path)
            if sub not in (None, "status") or (sub == "status" and not kind.status):
                raise ApiError(404, "NotFound", f"no subresource {sub!r} for {kind.plural}")
            if request.method == "GET" and name is None:
                if request.query.get("watch", "").lower() in ("true", "1"):
                    return await self._watch(request, kind, namespace, garbage=action == "garbage")
                return _json(self._list(request, kind, namespace))
            if request.method == "GET":
                return _json(self._get(kind, namespace, name or ""))
            if request.method == "POST" and name is None:
                return _json(await self._create(kind, namespace, await self._body(request)), status=201)
            if request.method == "PUT" and name is not None:
                body = await self._body(request)
                return _json(await self._update(kind, namespace, name, body, sub == "status"))
            if request.method == "PATCH" and name is not None:
                return _json(await self._patch(request, kind, namespace, name, sub == "status"))
            if request.method == "DELETE" and name is not None:
                return _json(await self._delete(kind, namespace, name))
            raise ApiError(405, "MethodNotAllowed", f"{request.method} is not supported on {request.path}")
        except ApiError as exc:
            return exc.response()

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, "BadRequest", f"the request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the request body must be an object")
        return body

    def _get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        obj = self.objects.get((kind.plural, namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
        return obj

    def _matches(self, request: web.Request, kind: Kind, namespace: str, plural: str, ns: str,
                 obj: dict[str, Any]) -> bool:
        if plural != kind.plural or (kind.namespaced and namespace and ns != namespace):
            return False
        labels = request.query.get("labelSelector", "")
        fields = request.query.get("fieldSelector", "")
        return _selector_matches(obj, labels, True) and _selector_matches(obj, fields, False)

    def _list(self, request: web.Request, kind: Kind, namespace: str) -> dict[str, Any]:
        metadata: dict[str, Any] = {"resourceVersion": str(self._rv)}
        # Pages, as the API server gives them: ``limit`` items, and a ``continue`` token for the rest. The token
        # pins the list as its first page found it (the real one pins a resourceVersion), so a list of N pages
        # filters the store once, as a paged read of etcd costs by the page, not N times.
        token = request.query.get("continue") or ""
        listing, _, offset = token.partition(":")
        try:
            start = int(offset or 0)
            limit = int(request.query.get("limit") or 0)
        except ValueError:
            raise ApiError(400, "BadRequest", "invalid limit or continue") from None
        if token:
            items = self._listings.get(listing)
            if items is None:
                raise ApiError(410, "Expired", "the continue token is too old; list again")
        else:
            items = [obj for (plural, ns, _), obj in sorted(self.objects.items())
                     if self._matches(request, kind, namespace, plural, ns, obj)]
        if limit > 0:
            if start + limit < len(items):
                if not listing:
                    listing = str(next(self._listing_serials))
                    self._listings[listing] = items
                    while len(self._listings) > 16:  # the oldest expire, as the API server's do
                        del self._listings[next(iter(self._listings))]
                metadata["continue"] = f"{listing}:{start + limit}"
                metadata["remainingItemCount"] = len(items) - start - limit
            items = items[start:start + limit]
        return {"apiVersion": kind.api_version, "kind": f"{kind.kind}List", "metadata": metadata, "items": items}

    async def _patch(
        self, request: web.Request, kind: Kind, namespace: str, name: str, status: bool
    ) -> dict[str, Any]:
        if request.content_type == "application/json-patch+json":
            raise ApiError(415, "UnsupportedMediaType", "JSON patch is not supported here; use a merge patch")
        if request.content_type == "application/apply-patch+yaml" and kind.plural == "resourceclaims" and status:
            return await self._apply_claim_status(request, kind, namespace, name)
        current = self._get(kind, namespace, name)
        patched = merge_patch(current, await self._body(request))
        patched["metadata"] = {**patched.get("metadata", {}), "resourceVersion": current["metadata"]["resourceVersion"]}
        if status:
            return await self._update(kind, namespace, name, patched, status=True)
        if kind.status:
            patched["status"] = current.get("status")
        return await self._update(kind, namespace, name, patched, status=False)

    async def _apply_claim_status(self, request: web.Request, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        """Server-side apply of a claim's ``status.devices`` (a list keyed by driver, pool, device and shareID):
        the manager's entries become those it applies, entries it applied before and leaves out are removed, and
        other managers' entries stay. As the API server: the manager is required, the uid is a precondition, and
        every entry must name a device the claim is allocated."""
        manager = request.query.get("fieldManager", "")
        if not manager:
            raise ApiError(400, "BadRequest", "PATCH /status: fieldManager is required for apply requests")
        body = await self._body(request)
        current = self._get(kind, namespace, name)
        uid = current["metadata"]["uid"]
        if body.get("metadata", {}).get("uid", uid) != uid:
            raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {body['metadata']['uid']}, "
                                            f"UID in object meta: {uid}")
        applied = (body.get("status") or {}).get("devices") or []

        def key(entry: dict[str, Any]) -> tuple[str, ...]:
            return (entry.get("driver", ""), entry.get("pool", ""), entry.get("device", ""),
                    entry.get("shareID", ""))

        claim_status = copy.deepcopy(current.get("status") or {})
        results = (claim_status.get("allocation") or {}).get("devices", {}).get("results", [])
        allocated = {(r["driver"], r["pool"], r["device"], r.get("shareID", "")) for r in results}
        for entry in applied:
            if key(entry) not in allocated:
                raise ApiError(422, "Invalid", f'ResourceClaim.resource.k8s.io "{name}" is invalid: '
                                               f"status.devices: Invalid value: {key(entry)}: must be an allocated "
                                               "device in the claim")
        owned = self._applied.get((uid, manager), set())
        new = {key(entry): entry for entry in applied}
        kept = [entry for entry in claim_status.get("devices", [])
                if key(entry) not in new and key(entry) not in owned]
        devices = kept + list(new.values())
        if devices:
            claim_status["devices"] = devices
        else:
            claim_status.pop("devices", None)
        stored = await self._update(kind, namespace, name, {**current, "status": claim_status}, status=True)
        self._applied[(uid, manager)] = set(new)
        return stored

    async def _wait_past(self, position: int, timeout: float) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._closing or self._rv > position), timeout)
            except TimeoutError:
                return False
        return not self._closing

    async def _watch(self, request: web.Request, kind: Kind, namespace: str,
                     garbage: bool = False) -> web.StreamResponse:
        since_text = request.query.get("resourceVersion", "")
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        pending: list[_Event] = []
        if since_text and since_text != "0":
            since = int(since_text)
            oldest = self._history[0].rv if self._history else self._rv
            if since < oldest - 1 and since < self._rv:
                raise ApiError(410, "Expired", f"too old resource version: {since} ({oldest})")
            position = since
        else:
            position = self._rv
            pending = [_Event(self._rv, kind, "ADDED", obj)
                       for (plural, ns, _), obj in sorted(self.objects.items())
                       if self._matches(request, kind, namespace, plural, ns, obj)]
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if garbage:
            # A payload error: half an event, then the end of the stream.
            await response.write(b'{"type": "MODIFIED", "object": {"metadata": \n')
            await response.write_eof()
            return response
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                for event in pending:
                    line = json.dumps({"type": event.type, "object": event.obj}) + "\n"
                    await response.write(line.encode())
                fresh = [e for e in self._history if e.rv > position]
                if fresh:
                    position = fresh[-1].rv
                pending = [e for e in fresh if e.kind == kind and self._matches(
                    request, kind, namespace, e.kind.plural, (e.obj.get("metadata") or {}).get("namespace", ""),
                    e.obj)]
                if pending:
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                if not await self._wait_past(position, remaining):
                    break
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            # The client went away (or the server is stopping): nothing is left to tell it.
            return response
        return response
