"""Two instances of one plugin on a node, side by side during a rolling update.

A DaemonSet that surges starts the new pod while the old one still serves. Each instance then needs sockets of its
own: had the new one taken over the old one's names, the kubelet would see the old socket removed, unregister the
driver, and fail what it was preparing meanwhile. Named for the instance (the pod's UID, as the Go helper's
RollingUpdate option names them), both serve at once; the kubelet prefers the one registered last.

An instance that is killed (SIGKILL, an OOM kill) leaves its sockets behind, and the kubelet would try them for
ever: a socket named for an instance that no process listens on any more is removed when the next one starts. A
socket whose listener answers is never touched: it belongs to a live instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from gpuppetti.base.sockets import SOCKET_PATH_MAX, listening

log = logging.getLogger(__name__)

# At a stop, how long an instance serves on while no other instance of it serves (a rolling update's next one is
# starting: without one, the kubelet fails what it asks for meanwhile), how often it looks, and the kubelet's time
# to take the next one's registration once its socket is there.
HANDOVER_WAIT_S = 5.0
HANDOVER_POLL_S = 0.1
HANDOVER_GRACE_S = 0.5
# What names an instance in a socket another one may remove: a pod's UID, or the digest that stands for a long one.
# Another plugin's socket that merely starts with our stem is never taken for one of ours.
_INSTANCE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{16}")


def instance_socket(directory: Path, stem: str, instance: str | None, suffix: str) -> Path:
    """``<stem>-<instance><suffix>`` in ``directory`` (``<stem><suffix>`` without an instance); where that path
    would be too long for a socket, the instance is replaced by a digest of it, which keeps it unique."""
    if instance is None:
        return directory / f"{stem}{suffix}"
    path = directory / f"{stem}-{instance}{suffix}"
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        path = directory / f"{stem}-{hashlib.sha256(instance.encode()).hexdigest()[:16]}{suffix}"
    return path


def remove_stale(candidates: Iterable[Path], own: Iterable[Path]) -> list[Path]:
    """Remove each candidate socket, other than ``own``, that nobody listens on; returns those removed. Blocks:
    call it in a thread."""
    mine = set(own)
    removed: list[Path] = []
    for path in candidates:
        if path in mine or not path.is_socket() or listening(path):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    if removed:
        log.info("removed %d socket(s) that no instance serves any more: %s", len(removed),
                 ", ".join(str(path) for path in removed))
    return removed


def sockets_like(directory: Path, stem: str, suffix: str) -> list[Path]:
    """The sockets in ``directory`` an instance of this plugin may have left: ``<stem><suffix>``, and
    ``<stem>-<instance><suffix>`` where the instance is a pod's UID or a digest."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found: list[Path] = []
    for name in names:
        if name == f"{stem}{suffix}" or (name.startswith(f"{stem}-") and name.endswith(suffix)
                                          and _INSTANCE.fullmatch(name[len(stem) + 1:len(name) - len(suffix)])):
            found.append(directory / name)
    return found


def live_others(candidates: Iterable[Path], own: Collection[Path]) -> list[Path]:
    """The candidate sockets, other than ``own``, that a process listens on. Blocks: call it in a thread."""
    return [path for path in candidates if path not in own and listening(path)]


def sockets_with(directory: Path, prefix: str, suffix: str) -> list[Path]:
    """Every entry of ``directory`` named ``<prefix>*<suffix>``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [directory / name for name in names if name.startswith(prefix) and name.endswith(suffix)]


async def hand_over(others: Callable[[], list[Path]], what: str) -> None:
    """Before an instance stops serving: wait (HANDOVER_WAIT_S at most) until ``others`` (blocking, run in a
    thread) finds the next instance's socket, so that the kubelet is never left without one. Where the probes
    cannot tell two instances apart (on the node's network both answer on one port), the DaemonSet may stop the old
    one before the new one serves."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANDOVER_WAIT_S
    said = False
    while not (found := await asyncio.to_thread(others)):
        if loop.time() >= deadline:
            log.info("no other instance of the %s serves after %.0f s; stopping", what, HANDOVER_WAIT_S)
            return
        if not said:
            log.info("waiting up to %.0f s for the %s's next instance to serve before stopping", HANDOVER_WAIT_S,
                     what)
            said = True
        await asyncio.sleep(HANDOVER_POLL_S)
    log.info("the %s's next instance serves %s; stopping", what, found[0])
    await asyncio.sleep(HANDOVER_GRACE_S)
