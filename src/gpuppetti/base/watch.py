"""Watch a directory for files appearing and disappearing, without polling where inotify exists."""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Only where inotify is missing (a developer's Mac running the demo); the kubelet only runs on Linux.
FALLBACK_POLL_SECONDS = 0.2


class Change(enum.Enum):
    CREATED = "created"
    DELETED = "deleted"
    # The watched directory itself went away or the kernel dropped events: re-check everything.
    RESCAN = "rescan"
    # Sent once, when the watch is in place: nothing that happens after it can be missed.
    READY = "ready"


@dataclass(frozen=True)
class DirEvent:
    change: Change
    name: str


async def watch_directory(directory: Path, creations: bool = True, moves: bool = True) -> AsyncIterator[DirEvent]:
    """Yield creations and deletions of entries directly in ``directory``; renames count as both. A watcher that
    cares only about files being deleted passes ``creations=False, moves=False``, and the kernel does not even
    report the rest (a process that renames a thousand files into place makes no noise for it)."""
    if sys.platform.startswith("linux"):
        async for event in _inotify_events(directory, creations, moves):
            yield event
    else:
        log.warning("inotify is not available on %s; watching %s by polling every %.1fs",
                    sys.platform, directory, FALLBACK_POLL_SECONDS)
        async for event in _polled_events(directory):
            yield event


async def _inotify_events(directory: Path, creations: bool, moves: bool) -> AsyncIterator[DirEvent]:
    from asyncinotify import Inotify, Mask

    mask = Mask.DELETE | Mask.DELETE_SELF | Mask.MOVE_SELF
    if moves:
        mask |= Mask.MOVED_FROM | (Mask.MOVED_TO if creations else Mask(0))
    if creations:
        mask |= Mask.CREATE
    with Inotify() as inotify:
        inotify.add_watch(directory, mask)
        yield DirEvent(Change.READY, "")
        async for event in inotify:
            if event.mask & (Mask.Q_OVERFLOW | Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED):
                yield DirEvent(Change.RESCAN, "")
                if event.mask & (Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED):
                    return
                continue
            name = str(event.name) if event.name is not None else ""
            if event.mask & (Mask.CREATE | Mask.MOVED_TO):
                yield DirEvent(Change.CREATED, name)
            elif event.mask & (Mask.DELETE | Mask.MOVED_FROM):
                yield DirEvent(Change.DELETED, name)


def _snapshot(directory: Path) -> dict[str, int]:
    try:
        return {entry.name: entry.inode() for entry in os.scandir(directory)}
    except FileNotFoundError:
        return {}


async def _polled_events(directory: Path) -> AsyncIterator[DirEvent]:
    before = _snapshot(directory)
    yield DirEvent(Change.READY, "")
    while True:
        await asyncio.sleep(FALLBACK_POLL_SECONDS)
        after = _snapshot(directory)
        for name, inode in before.items():
            if after.get(name) != inode:
                yield DirEvent(Change.DELETED, name)
        for name, inode in after.items():
            if before.get(name) != inode:
                yield DirEvent(Change.CREATED, name)
        before = after
