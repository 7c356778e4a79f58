"""The device plugin beside its other instance, as a DaemonSet that surges runs them during a rolling update
(kit.instances): a socket per resource named for the instance, what killed instances left removed at start, the
other instance's sockets found, and a stop that waits until the next instance serves.

The kubelet's device manager keeps one plugin per resource: the newest registration takes the resource over, and
when the old instance's ListAndWatch stream ends the kubelet also drops the new one's, which registers again at once
(its stream ended). That moment, milliseconds long, is the gap the kubelet allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable
from pathlib import Path

from gpuppetti.kit.instances import hand_over, instance_socket, live_others, remove_stale, sockets_like, sockets_with

PREFIX = "gpuppetti-"
SUFFIX = ".sock"
# How often an instance the kubelet dropped for a newer one looks whether that one still serves.
NEWER_POLL_S = 1.0


def socket_name(resource: str, instance: str | None = None, directory: Path | None = None) -> str:
    """The resource's socket in the kubelet's directory: named for the instance where there is one."""
    stem = f"{PREFIX}{resource.replace('/', '_')}"
    return instance_socket(directory or Path("/"), stem, instance, SUFFIX).name


async def remove_left(directory: Path, resources: Iterable[str], instance: str) -> None:
    """Remove the sockets killed instances of the plugin left for these resources (the kubelet never does)."""
    resources = list(resources)
    own = [directory / socket_name(name, instance, directory) for name in resources]
    left = [path for name in resources
            for path in sockets_like(directory, socket_name(name).removesuffix(SUFFIX), SUFFIX)]
    await asyncio.to_thread(remove_stale, left, own)


async def newer(own: Path, resource: str) -> Path | None:
    """Another instance's socket for ``resource`` made after ``own`` that a process listens on: the instance that
    replaced this one. The kubelet dropping this one's stream for it is no reason to take the resource back."""
    def find() -> Path | None:
        try:
            made = own.lstat().st_ctime_ns
        except OSError:
            return None
        for path in live_others(sockets_like(own.parent, socket_name(resource).removesuffix(SUFFIX), SUFFIX), {own}):
            try:
                if path.lstat().st_ctime_ns > made:
                    return path
            except OSError:
                continue
        return None

    return await asyncio.to_thread(find)


async def others(directory: Path, own: Collection[Path]) -> list[Path]:
    """The sockets another instance of the plugin serves in ``directory`` now."""
    return await asyncio.to_thread(lambda: live_others(sockets_with(directory, PREFIX, SUFFIX), own))


async def wait_for_the_next(directory: Path, own: Collection[Path], registered: bool) -> None:
    """At a stop, where this instance is registered: wait for the next one to serve (kit.instances.hand_over)."""
    if registered:
        await hand_over(lambda: live_others(sockets_with(directory, PREFIX, SUFFIX), own), "device plugin")
