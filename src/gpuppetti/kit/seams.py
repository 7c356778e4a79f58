"""What a daemon hands the kit, as protocols: the kit knows none of the node's services, only these shapes, which
the daemon's own objects (the inventory, the API client, the metrics) have already.

- ``Changing``: something that changes by versions, and what it holds now (the inventory and its snapshot). The
  slice publisher follows it for the pool's content, the health stream for the devices' health; the driver says
  how each is read from a snapshot.
- ``SliceWriter``: the API server, as far as publishing a pool's ResourceSlices goes. Every failure of a call is an
  ``ApiError``, which the publisher retries; anything else is a bug, and is let through.
- ``PluginMetrics``: where the kit counts the kubelet's calls and the pool's publishes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, TypeVar

from prometheus_client import Counter, Histogram

from gpuppetti.core.kubeobjects import ResourceSlice, ResourceSliceBody


class Versioned(Protocol):
    @property
    def version(self) -> int: ...


S_co = TypeVar("S_co", bound=Versioned, covariant=True)


class Changing(Protocol[S_co]):
    """A snapshot at a time, each with a version of its own."""

    @property
    def snapshot(self) -> S_co: ...

    async def wait_for_change(self, seen: int) -> int:
        """Wait until the version differs from ``seen``; the new version."""
        ...


class SliceWriter(Protocol):
    """The API calls of a ResourceSlice publisher; each raises ApiError when it fails."""

    async def node_uid(self, node: str) -> str: ...

    async def list_slices(self, node: str, driver: str) -> list[ResourceSlice]: ...

    async def create_slice(self, body: ResourceSliceBody) -> str:
        """Create a slice; its resourceVersion."""
        ...

    async def replace_slice(self, name: str, body: ResourceSliceBody) -> str:
        """Replace a slice; its new resourceVersion."""
        ...

    async def delete_slice(self, name: str) -> None: ...

    def watch_slices(self, node: str, driver: str) -> AsyncIterator[tuple[str, str, str]]:
        """(event type, slice name, resourceVersion) for the node's slices, until the watch ends."""
        ...


class PluginMetrics(Protocol):
    """The counters and histograms the kit records in (the daemon's registry holds them)."""

    @property
    def prepare_requests(self) -> Counter:
        """Claims prepared, by result ("ok", "error")."""
        ...

    @property
    def prepare_seconds(self) -> Histogram: ...

    @property
    def unprepare_requests(self) -> Counter:
        """Claims unprepared, by result ("ok", "error")."""
        ...

    @property
    def unprepare_seconds(self) -> Histogram: ...

    @property
    def slice_publishes(self) -> Counter:
        """Reconciles that wrote or deleted a slice."""
        ...
