"""Publishes a node's pool as ResourceSlices and keeps it there, whatever the API server does (the kit's
ResourceSlice controller: the driver says what its pool holds, as slice specs, and this writes them).

It publishes only once the kubelet has confirmed the driver's registration (a slice published earlier could be
scheduled to, and the kubelet would fail that pod's Prepare). The kubelet deletes a node's slices when it starts,
and again when no driver instance has been connected for 30 s; others may delete them by mistake: the publisher
watches its own slices and re-creates what goes missing. It writes only when something differs from what it last
wrote (by resourceVersion), so an API server that normalises quantities cannot set off a write loop. Every failure
(an API server restart, a cut connection, a timeout) is retried with backoff until the pool is there.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from gpuppetti.base.backoff import Backoff
from gpuppetti.base.memory import give_back_free_memory
from gpuppetti.core.kubeobjects import RESOURCE_API, ApiError, OwnerReference, ResourceSliceBody, SliceMeta
from gpuppetti.kit.seams import Changing, PluginMetrics, SliceWriter, Versioned

log = logging.getLogger(__name__)

RETRY_MAX_S = 10.0
# Slices written at once: each is held as dicts while it is written, so more would raise the driver's memory for
# good and publish no sooner on a busy API server.
CONCURRENT_WRITES = 4
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpuppetti"}


@dataclass(frozen=True)
class PoolContent:
    """The specs of a pool's slices, without the generation, so that a change can be told from a re-publish.

    Each spec is held as compressed JSON, not as dicts: a driver holds its pool for its whole life, dicts are the
    largest way to hold it and JSON the next, and its devices differ in a few fields, so they compress well. A spec
    becomes dicts again only while it is being written."""

    specs: tuple[bytes, ...]

    @classmethod
    def of(cls, specs: Iterable[dict[str, Any]]) -> PoolContent:
        # Level 1: nearly all of the saving, for the least CPU. msgspec, the API client's own JSON, encodes and
        # decodes faster than the standard library's.
        return cls(tuple(zlib.compress(msgspec.json.encode(spec), 1) for spec in specs))

    def spec(self, number: int) -> dict[str, Any]:
        found: dict[str, Any] = msgspec.json.decode(zlib.decompress(self.specs[number]))
        return found


def slice_name(node: str, driver: str, number: int) -> str:
    return f"{node}-{driver}-{number}"


def resource_slice(
    content: PoolContent, number: int, node: str, driver: str, generation: int, owner: OwnerReference | None
) -> ResourceSliceBody:
    """The ``number``th slice to write, as an API body."""
    metadata: SliceMeta = {"name": slice_name(node, driver, number), "labels": dict(MANAGED_BY)}
    if owner is not None:
        metadata["ownerReferences"] = [owner.body()]
    pool = {"name": node, "generation": generation, "resourceSliceCount": len(content.specs)}
    return {"apiVersion": RESOURCE_API, "kind": "ResourceSlice", "metadata": metadata,
            "spec": {**content.spec(number), "pool": pool}}  # type: ignore[typeddict-item]


def resource_slices(
    content: PoolContent, node: str, driver: str, generation: int, owner: OwnerReference | None
) -> list[ResourceSliceBody]:
    """Every slice of the pool, as API bodies."""
    return [resource_slice(content, number, node, driver, generation, owner) for number in range(len(content.specs))]


S = TypeVar("S", bound=Versioned)


class SlicePublisher(Generic[S]):
    """``content_of`` says what the pool of ``driver`` holds on ``node`` in one of ``source``'s snapshots."""

    def __init__(
        self, writer: SliceWriter, source: Changing[S], content_of: Callable[[S, str], PoolContent], node: str,
        driver: str, metrics: PluginMetrics, registered: asyncio.Event | None = None,
    ) -> None:
        self._kube = writer
        self._content_of = content_of
        self._metrics = metrics
        self._source = source
        self.node = node
        self.driver = driver
        self._registered = registered
        self._said_waiting = False
        self._dirty = asyncio.Event()
        # The pool as the current snapshot has it (computed once per change), and as last published.
        self._wanted: PoolContent | None = None
        self._content: PoolContent | None = None
        self.generation = 0
        self._written: dict[str, str] = {}
        # Slices being written now: their watch events arrive before the write returns its resourceVersion.
        self._in_flight: set[str] = set()
        self._owner: OwnerReference | None = None
        self._owner_known = False
        self.published = asyncio.Event()
        self.last_error: str | None = None

    async def wait_registered(self) -> None:
        if self._registered is not None and not self._registered.is_set():
            # Two duties wait here (the reconcile loop and the watch): the log says it once.
            if not self._said_waiting:
                self._said_waiting = True
                log.info("waiting for the kubelet to register the driver before publishing ResourceSlices")
            await self._registered.wait()

    async def follow_source(self) -> None:
        """Duty: every change of the source makes the pool's content anew and asks for a reconcile."""
        while True:
            snapshot = self._source.snapshot
            self._wanted = self._content_of(snapshot, self.node)
            self._dirty.set()
            await self._source.wait_for_change(snapshot.version)

    async def reconcile_loop(self) -> None:
        """Duty: reconcile whenever asked, retrying with backoff until the pool is published."""
        await self.wait_registered()
        backoff = Backoff(0.2, RETRY_MAX_S)
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.reconcile()
            except ApiError as exc:
                delay = backoff.next()
                self.last_error = str(exc)
                log.warning("publishing ResourceSlices failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                self._dirty.set()
                continue
            self.last_error = None
            backoff.reset()

    async def _owner_reference(self) -> OwnerReference | None:
        """The Node as the slices' owner, so that they go when the node does; None if the Node cannot be read."""
        if not self._owner_known:
            try:
                uid = await self._kube.node_uid(self.node)
            except ApiError as exc:
                if exc.status is None or exc.status >= 500:
                    raise
                log.warning("cannot read Node %s (%s); publishing ResourceSlices without an owner", self.node, exc)
            else:
                self._owner = OwnerReference(api_version="v1", kind="Node", name=self.node, uid=uid, controller=True)
            self._owner_known = True
        return self._owner

    async def reconcile(self) -> None:
        owner = await self._owner_reference()
        existing = {item.metadata.name: item for item in await self._kube.list_slices(self.node, self.driver)}
        content = self._wanted or self._content_of(self._source.snapshot, self.node)
        if content != self._content:
            known = [item.spec.pool.generation for item in existing.values()]
            # Higher than anything published before, by this process or an earlier one.
            self.generation = max([self.generation, *known]) + 1
            self._content = content
            self._written.clear()
        # (slice number, name, whether to create it, the resourceVersion it replaces)
        writes: list[tuple[int, str, bool, str | None]] = []
        for number in range(len(content.specs)):
            name = slice_name(self.node, self.driver, number)
            current = existing.pop(name, None)
            version = None if current is None else current.metadata.resource_version
            if current is not None and self._written.get(name) == version:
                continue
            writes.append((number, name, current is None, version))
        limit = asyncio.Semaphore(CONCURRENT_WRITES)
        generation = self.generation

        async def write(number: int, name: str, create: bool, replaces: str | None) -> None:
            async with limit:
                # Built here, under the limit: only the slices being written are ever held as dicts.
                body = resource_slice(content, number, self.node, self.driver, generation, owner)
                self._in_flight.add(name)
                try:
                    if create:
                        version = await self._kube.create_slice(body)
                    else:
                        if replaces:
                            body["metadata"]["resourceVersion"] = replaces
                        version = await self._kube.replace_slice(name, body)
                finally:
                    self._in_flight.discard(name)
                self._written[name] = version

        results = await asyncio.gather(*(write(*w) for w in writes), return_exceptions=True)
        for name in existing:
            await self._kube.delete_slice(name)
            self._written.pop(name, None)
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, ApiError):
                raise failure
        if failures:
            raise failures[0]
        changed = len(writes) + len(existing)
        if changed:
            self._metrics.slice_publishes.inc()
            log.info("published pool %s generation %d: %d slice(s), %d written", self.node, self.generation,
                     len(content.specs), changed)
            # Each slice was dicts, JSON and the API's echo of it while it was written: none of it is kept.
            give_back_free_memory()
        self.published.set()

    async def watch(self) -> None:
        """Duty: notice slices deleted or changed by others, and ask for a reconcile."""
        await self.wait_registered()
        backoff = Backoff(0.2, RETRY_MAX_S)
        while True:
            try:
                async for kind, name, version in self._kube.watch_slices(self.node, self.driver):
                    backoff.reset()
                    if kind != "DELETED" and name in self._in_flight:
                        continue
                    if kind == "DELETED" or self._written.get(name) != version:
                        # Only a slice the pool still needs is a loss; a surplus one this driver deleted is not.
                        if kind == "DELETED" and name in self._written:
                            log.warning("ResourceSlice %s was deleted; publishing it again", name)
                        self._dirty.set()
            except ApiError as exc:
                delay = backoff.next()
                log.warning("watching ResourceSlices failed (%s); watching again in %.1fs", exc, delay)
                await asyncio.sleep(delay)
            # A watch that ended may have missed events: compare everything once more.
            self._dirty.set()
