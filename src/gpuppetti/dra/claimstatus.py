"""What a claim's owner reads of the driver's work: each prepared device's entry in ``ResourceClaim.status.devices``
(the API's DRAResourceClaimDeviceStatus), with a Ready condition and the share the container was given.

The entries are written by a duty of their own, after the kubelet has its answer: a Prepare never waits on the API
to tell a user what it did, and an Unprepare (which reads nothing) stays as quick when the API is down. Each claim's
latest wish wins (entries after a Prepare, none after an Unprepare) and is retried with backoff until the API takes
it, or says the claim is gone or replaced. The driver applies its entries by server-side apply, as its own field
manager: a claim that holds devices of other drivers keeps their entries, and the entries the driver applied at
Prepare are removed by the empty set it applies at Unprepare. (The API server drops them itself once the claim is
deallocated; clearing them at Unprepare keeps Ready from outliving the preparation while the claim is still
allocated, e.g. between one pod and the next that shares it.)
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpuppetti.base.backoff import Backoff
from gpuppetti.base.memory import give_back_free_memory
from gpuppetti.core.kubeobjects import ApiError
from gpuppetti.dra.plan import DeviceStatus
from gpuppetti.kit.draplugin import ClaimRef

log = logging.getLogger(__name__)

# Writes in flight at once: a kubelet call of a thousand claims is told in a few seconds, not one write at a time.
CONCURRENT_WRITES = 16
RETRY_MAX_S = 30.0
# The API's answers that no retry can change: the claim is gone (404), replaced (409 on its uid) or no longer holds
# the device (422: an entry must name an allocated device).
FINAL = frozenset({404, 409, 422})


class StatusWriter(Protocol):
    async def apply_claim_status(self, namespace: str, name: str, uid: str, manager: str,
                                 devices: list[dict[str, Any]]) -> None:
        """Make ``devices`` the entries of the claim's ``status.devices`` that ``manager`` owns; raises ApiError."""
        ...


@dataclass(frozen=True)
class _Wish:
    claim: ClaimRef
    devices: list[dict[str, Any]]


def device_entries(driver: str, statuses: Sequence[DeviceStatus], now: datetime.datetime) -> list[dict[str, Any]]:
    """The ``status.devices`` entries of one prepared claim, Ready since ``now``."""
    since = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    entries = []
    for status in statuses:
        entry: dict[str, Any] = {
            "driver": driver, "pool": status.pool, "device": status.device,
            "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared", "lastTransitionTime": since,
                            "message": f"prepared on node {status.pool}: {_summary(status.data)}"}],
            "data": status.data,
        }
        if status.share_id is not None:
            entry["shareID"] = status.share_id
        entries.append(entry)
    return entries


def _summary(data: dict[str, str]) -> str:
    held = data.get("enforcedBy", "none")
    memory = data.get("memory", "unknown memory")
    return (f"{memory} and {data.get('computeShare', '?')} of GPU {data.get('gpu', '?')}, "
            f"{'held by ' + held if held != 'none' else 'not held to a slice'}")


class ClaimStatus:
    """The claims' status entries the driver still has to write, and the duty that writes them."""

    def __init__(self, writer: StatusWriter, driver: str) -> None:
        self._writer = writer
        self._driver = driver
        self._pending: dict[str, _Wish] = {}
        self._writing: dict[str, _Wish] = {}
        self._wake = asyncio.Event()

    def prepared(self, claim: ClaimRef, statuses: Sequence[DeviceStatus]) -> None:
        self._want(_Wish(claim, device_entries(self._driver, statuses, datetime.datetime.now(datetime.UTC))))

    def unprepared(self, claim: ClaimRef) -> None:
        self._want(_Wish(claim, []))

    def _want(self, wish: _Wish) -> None:
        self._pending[wish.claim.uid] = wish
        self._wake.set()

    @property
    def pending(self) -> int:
        """Claims whose entries are not yet written: waiting, or being written."""
        return len(self._pending.keys() | self._writing.keys())

    async def keep(self) -> None:
        """Duty: write what is pending, a batch at a time, until stopped; what failed is retried with backoff
        (unless a newer wish for its claim came meanwhile)."""
        backoff = Backoff(0.5, RETRY_MAX_S)
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not await self._write_batch():
                await backoff.wait(self._wake)
                self._wake.set()
            else:
                backoff.reset()
                # A batch can be a thousand claims' entries, requests and answers: what writing them took is not
                # kept for the driver's life.
                give_back_free_memory()

    async def _write_batch(self) -> bool:
        """Write what is pending now, CONCURRENT_WRITES at a time; whether every wish is settled. A wish is let go
        as soon as it is settled: nothing of a batch outlives its writing, since the duty then waits for the next
        one (perhaps for the driver's life) and a thousand claims' entries would wait with it."""
        batch = self._writing = self._pending
        self._pending = {}
        queue = deque(batch.values())
        failed: list[_Wish] = []

        async def writer() -> None:
            while queue:
                wish = queue.popleft()
                if await self._write(wish):
                    del batch[wish.claim.uid]
                else:
                    failed.append(wish)

        await asyncio.gather(*(writer() for _ in range(min(CONCURRENT_WRITES, len(queue)))))
        self._writing = {}
        for wish in failed:
            self._pending.setdefault(wish.claim.uid, wish)
        return not failed

    async def _write(self, wish: _Wish) -> bool:
        """Whether the wish is settled: written, or the API says it never can be."""
        claim = wish.claim
        try:
            await self._writer.apply_claim_status(claim.namespace, claim.name, claim.uid, self._driver, wish.devices)
        except ApiError as exc:
            if exc.status == 422:
                # Refused whole: a device the claim no longer holds, or (as 1.36 reports it) a driver whose RBAC
                # lacks resourceclaims/driver: the operator's to see.
                log.warning("%s; not retried", exc)
                return True
            if exc.status in FINAL:
                log.info("%s: the claim is gone or replaced; not retried", exc)
                return True
            log.warning("%s; retrying", exc)
            return False
        return True
