"""Publishes the node's pool as ResourceSlices and keeps it there.

The kubelet deletes a node's slices when it starts, and again when no driver instance has been connected for
30 s; others may delete them by mistake. The publisher watches its own slices and re-creates what goes missing.
It writes only when something differs from what it last wrote (by resourceVersion), so an API server that
normalises quantities cannot set off a write loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from gpuppetti.dra.slices import PoolContent, pool_content, resource_slices
from gpuppetti.inventory import Inventory
from gpuppetti.kube import RESOURCE_GROUP, RESOURCE_VERSION
from gpuppetti.metrics import Metrics

log = logging.getLogger(__name__)

PLURAL = "resourceslices"
WATCH_TIMEOUT_S = 300
RETRY_MAX_S = 10.0


class SlicePublisher:
    def __init__(
        self, api: client.ApiClient, inventory: Inventory, node: str, owner: dict[str, Any] | None, metrics: Metrics,
        registered: asyncio.Event | None = None,
    ) -> None:
        self._registered = registered
        self._custom = client.CustomObjectsApi(api)
        self._metrics = metrics
        self._inventory = inventory
        self.node = node
        self._owner = owner
        self._dirty = asyncio.Event()
        self._content: PoolContent | None = None
        self.generation = 0
        self._written: dict[str, str] = {}
        # Slices being written now: their watch events arrive before the write returns its resourceVersion.
        self._in_flight: set[str] = set()
        self._content_for: tuple[int, object] | None = None
        self.published = asyncio.Event()

    @property
    def driver(self) -> str:
        return self._inventory.config.dra.driver_name

    def _selector(self) -> str:
        return f"spec.nodeName={self.node},spec.driver={self.driver}"

    async def run(self) -> None:
        if self._registered is not None and not self._registered.is_set():
            log.info("waiting for the kubelet to register the driver before publishing ResourceSlices")
            await self._registered.wait()
        async with asyncio.TaskGroup() as group:
            group.create_task(self._follow_inventory(), name="slices-inventory")
            group.create_task(self._watch(), name="slices-watch")
            group.create_task(self._reconcile_loop(), name="slices-reconcile")

    async def _follow_inventory(self) -> None:
        while True:
            seen = self._inventory.version
            self._dirty.set()
            await self._inventory.wait_for_change(seen)

    async def _reconcile_loop(self) -> None:
        delay = 0.2
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.reconcile()
                delay = 0.2
            except (TimeoutError, ApiException, OSError) as exc:
                log.warning("publishing ResourceSlices failed (%s); retrying in %.1fs", _reason(exc), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                self._dirty.set()

    async def reconcile(self) -> None:
        listing = await self._custom.list_cluster_custom_object(
            RESOURCE_GROUP, RESOURCE_VERSION, PLURAL, field_selector=self._selector()
        )
        existing = {item["metadata"]["name"]: item for item in listing.get("items", [])}
        content = self._pool_content()
        if content != self._content:
            known = [item["spec"]["pool"].get("generation", 0) for item in existing.values()]
            # Higher than anything published before, by this process or an earlier one.
            self.generation = max([self.generation, *known]) + 1
            self._content = content
            self._written.clear()
        changed = 0
        for body in resource_slices(content, self.node, self.driver, self.generation, self._owner):
            name = body["metadata"]["name"]
            current = existing.pop(name, None)
            if current is not None and self._written.get(name) == current["metadata"]["resourceVersion"]:
                continue
            self._in_flight.add(name)
            try:
                if current is None:
                    written = await self._custom.create_cluster_custom_object(
                        RESOURCE_GROUP, RESOURCE_VERSION, PLURAL, body)
                else:
                    body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                    written = await self._custom.replace_cluster_custom_object(
                        RESOURCE_GROUP, RESOURCE_VERSION, PLURAL, name, body)
            finally:
                self._in_flight.discard(name)
            self._written[name] = written["metadata"]["resourceVersion"]
            changed += 1
        for name in existing:
            with contextlib.suppress(ApiException):
                await self._custom.delete_cluster_custom_object(RESOURCE_GROUP, RESOURCE_VERSION, PLURAL, name)
            self._written.pop(name, None)
            changed += 1
        if changed:
            self._metrics.slice_publishes.inc()
            log.info("published pool %s generation %d: %d slice(s), %d written", self.node, self.generation,
                     len(content.specs), changed)
        self.published.set()

    def _pool_content(self) -> PoolContent:
        """The pool as the inventory has it now, computed once per inventory version."""
        version = self._inventory.version
        if self._content_for is None or self._content_for[0] != version:
            content = pool_content(self._inventory.gpus, self._inventory.config.dra, self.node)
            self._content_for = (version, content)
        cached = self._content_for[1]
        assert isinstance(cached, PoolContent)
        return cached

    async def _watch(self) -> None:
        delay = 0.2
        while True:
            try:
                async with watch.Watch() as stream:
                    async for event in stream.stream(
                        self._custom.list_cluster_custom_object, RESOURCE_GROUP, RESOURCE_VERSION, PLURAL,
                        field_selector=self._selector(), timeout_seconds=WATCH_TIMEOUT_S,
                    ):
                        delay = 0.2
                        name = event["object"].get("metadata", {}).get("name")
                        rv = event["object"].get("metadata", {}).get("resourceVersion")
                        if event["type"] != "DELETED" and name in self._in_flight:
                            continue
                        if event["type"] == "DELETED" or self._written.get(name) != rv:
                            # Only a slice the pool still needs is a loss; a surplus one this driver deleted is not.
                            if event["type"] == "DELETED" and name in self._written:
                                log.warning("ResourceSlice %s was deleted; publishing it again", name)
                            self._dirty.set()
            except (TimeoutError, ApiException, OSError) as exc:
                log.warning("watching ResourceSlices failed (%s); watching again in %.1fs", _reason(exc), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
            # A watch that ended may have missed events: compare everything once more.
            self._dirty.set()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}"
    return str(exc) or type(exc).__name__
