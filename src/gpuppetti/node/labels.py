"""Node labels in the spirit of GPU Feature Discovery: what GPU this node has, for nodeSelectors and humans."""

from __future__ import annotations

import asyncio
import logging
import re

from gpuppetti.base.backoff import Backoff
from gpuppetti.node.inventory import Inventory, Snapshot
from gpuppetti.node.kube import ApiError, Kube
from gpuppetti.sharing.edits import sharing_mode

log = logging.getLogger(__name__)

# Only the labels under this prefix are the labeller's; gpuppetti.dev/mode, which an operator sets to choose where
# the DaemonSets run, is left alone.
PREFIX = "gpuppetti.dev/gpu."
RETRY_MAX_S = 30.0
# At stop, how long to try to remove the labels before giving up (the API may be away).
CLEAR_TIMEOUT_S = 5.0


def label_value(text: str) -> str:
    """A valid label value: at most 63 characters of [A-Za-z0-9._-], beginning and ending alphanumeric."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63]
    return value.strip("-._")


def node_labels(snapshot: Snapshot) -> dict[str, str]:
    """The labels for the node's first GPU (lowest index, then id), and how many there are. Empty without GPUs."""
    gpus = sorted(snapshot.gpus.values(), key=lambda g: (g.index, g.id))
    if not gpus:
        return {}
    first = gpus[0]
    same = [g for g in gpus if g.vendor is first.vendor and g.model == first.model]
    units = [u for plan in snapshot.plan.values() for u in plan.units if u.gpu_id == first.id]
    labels = {
        "present": "true",
        "vendor": first.vendor.value,
        "model": label_value(first.model),
        "count": str(len(same)),
        "replicas": str(len(units) or 1),
        "sharing-strategy": sharing_mode(units) if units else "none",
    }
    if first.cores is not None:
        labels["cores"] = str(first.cores)
    if first.memory_bytes is not None:
        labels["memory"] = str(first.memory_bytes // 2**20)  # MiB, as GPU Feature Discovery reports it
    return {PREFIX + key: value for key, value in labels.items() if value}


class NodeLabeler:
    """Keeps this node's gpuppetti.dev/ labels equal to the inventory, and removes them when the GPUs go."""

    def __init__(self, kube: Kube, inventory: Inventory, node: str) -> None:
        self._kube = kube
        self._inventory = inventory
        self.node = node

    async def sync(self, wanted: dict[str, str] | None = None) -> None:
        """Raises ApiError."""
        found = await self._kube.node_labels(self.node)
        current = {k: v for k, v in found.items() if k.startswith(PREFIX)}
        wanted = node_labels(self._inventory.snapshot) if wanted is None else wanted
        patch: dict[str, str | None] = {k: v for k, v in wanted.items() if current.get(k) != v}
        patch.update({k: None for k in current if k not in wanted})
        if patch:
            await self._kube.label_node(self.node, patch)
            log.info("labelled node %s: %s", self.node,
                     ", ".join(f"{k}={v}" if v is not None else f"-{k}" for k, v in sorted(patch.items())))

    async def run(self) -> None:
        """The labels duty: keep them current; at stop, remove them and close the API client."""
        backoff = Backoff(1.0, RETRY_MAX_S)
        try:
            while True:
                seen = self._inventory.version
                try:
                    await self.sync()
                    backoff.reset()
                except ApiError as exc:  # the API being away must not stop the plugin
                    delay = backoff.next()
                    log.warning("labelling node %s failed (%s); retrying in %.0fs", self.node, exc, delay)
                    await asyncio.sleep(delay)
                    continue
                await self._inventory.wait_for_change(seen)
        finally:
            await self.clear()
            await self._kube.close()

    async def clear(self) -> None:
        """Remove this node's labels when the plugin stops: a node whose plugin is gone serves no GPU."""
        try:
            async with asyncio.timeout(CLEAR_TIMEOUT_S):
                await self.sync(wanted={})
        except (ApiError, TimeoutError) as exc:  # stopping must not fail because the API is away
            log.warning("could not remove the labels of node %s (%s); they stay until the plugin runs again",
                        self.node, exc)
