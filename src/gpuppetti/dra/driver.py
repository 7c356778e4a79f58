"""The DRA driver's two callbacks for the kit's helper (kit.draplugin.DraDriver): prepare reads each claim, plans
it against the snapshot (dra.plan) and commits the plans (dra.store); unprepare has the store forget them.

No lock is held across the network: claims are read before the store's lock is taken, so an Unprepare (which
reads nothing) answers at once however slow the API is.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Collection, Iterator, Mapping, Sequence
from typing import Protocol

from gpuppetti.base.backoff import Backoff
from gpuppetti.core.kubeobjects import ResourceClaim
from gpuppetti.dra.checkpoint import COMPLETED
from gpuppetti.dra.claimstatus import ClaimStatus
from gpuppetti.dra.plan import Plan, PrepareError, layer_allocation, plan_claim
from gpuppetti.dra.store import Answer, ClaimStore
from gpuppetti.kit.draplugin import ClaimRef, named
from gpuppetti.node.inventory import Inventory, Snapshot
from gpuppetti.node.kube import ApiError, NotFound
from gpuppetti.node.metrics import SliceRow

log = logging.getLogger(__name__)


class ClaimReader(Protocol):
    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        """The ResourceClaim; raises NotFound when there is none, ApiError when the API fails."""
        ...

    def list_claims(self, namespace: str, names: Collection[str]) -> AsyncIterator[ResourceClaim]:
        """The ResourceClaims of ``namespace`` named in ``names``, as they are read; raises ApiError when the API
        fails, possibly after some."""
        ...


# From this many claims of one namespace in one kubelet call, one LIST of the namespace costs less than a GET each.
LIST_FROM = 16
# How often keep_pods looks for prepared claims whose pods this process has not read.
PODS_SWEEP_S = 5.0

_paused = 0


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while a call runs: a thousand claims make some hundred thousand
    objects that live until the answer, and collections meanwhile free nothing and scan them again and again (an
    eighth of a thousand-claim Prepare went to them). Collected once after; reference counting frees as ever."""
    global _paused
    if _paused == 0 and not gc.isenabled():
        yield  # held off by someone else
        return
    _paused += 1
    gc.disable()
    try:
        yield
    finally:
        _paused -= 1
        if _paused == 0:
            gc.enable()


class GpuDriver:
    """Prepare and unprepare for the kit's helper, over the snapshot's pool and one store."""

    def __init__(self, inventory: Inventory, node: str, store: ClaimStore, claims: ClaimReader,
                 status: ClaimStatus | None = None) -> None:
        self._inventory = inventory
        self.node = node
        self.store = store
        self._claims = claims
        # Where the claims' status entries are written from (None: they are not).
        self._status = status
        # The pods each prepared claim is reserved for (for /metrics and top): read with the claim to prepare it, or
        # for one prepared before this process started (or by the other instance of a rolling update), by
        # keep_pods.
        self._pods: dict[str, str] = {}

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Answer]:
        """Prepare every claim of one kubelet call; each gets its devices or its own error."""
        with _collector_paused():
            answers = await self.store.answer_completed(claims)
            pending = [claim for claim in claims if claim.uid not in answers]
            if not pending:
                return answers
            began = time.perf_counter()
            plans = await self._read_and_plan(pending)
            read = time.perf_counter()
            planned: dict[str, tuple[ClaimRef, Plan]] = {}
            for claim in pending:
                plan = plans[claim.uid]
                if isinstance(plan, PrepareError):
                    answers[claim.uid] = plan
                else:
                    planned[claim.uid] = (claim, plan)
            committed = await self.store.commit(planned) if planned else {}
            answers.update(committed)
            prepared = [planned[uid][0] for uid, answer in committed.items() if not isinstance(answer, PrepareError)]
            if self._status is not None:
                for claim in prepared:
                    self._status.prepared(claim, planned[claim.uid][1].statuses)
            if prepared:
                log.info("prepared %s in %.1f ms (reading and planning them %.1f ms, checkpoint and CDI specs %.1f "
                         "ms)", named(prepared), (time.perf_counter() - began) * 1000, (read - began) * 1000,
                         (time.perf_counter() - read) * 1000)
            return answers

    async def _read_and_plan(self, pending: Sequence[ClaimRef]) -> dict[str, Plan | PrepareError]:
        """Each pending claim's plan or its error. The claims of a namespace that names many are listed a page at a
        time; the rest (too few of their namespace, created or replaced since the list, or the list failed) are
        asked for by name, all at once, each planned as soon as it is read."""
        namespaces: dict[str, dict[str, ClaimRef]] = {}
        for claim in pending:
            namespaces.setdefault(claim.namespace, {})[claim.name] = claim
        plans: dict[str, Plan | PrepareError] = {}
        snapshot = self._inventory.snapshot
        await asyncio.gather(*(self._list_and_plan(ns, wanted, snapshot, plans)
                               for ns, wanted in namespaces.items() if len(wanted) >= LIST_FROM))
        unlisted = [claim for claim in pending if claim.uid not in plans]
        if unlisted:
            one_by_one = await asyncio.gather(*(self._get_and_plan(claim) for claim in unlisted))
            plans.update(zip((claim.uid for claim in unlisted), one_by_one, strict=True))
        return plans

    async def _list_and_plan(self, namespace: str, wanted: Mapping[str, ClaimRef], snapshot: Snapshot,
                             plans: dict[str, Plan | PrepareError]) -> None:
        """Plan the claims ``wanted`` (by name) of ``namespace`` as a list of it reads them: a claim's object lives
        only until it is planned, never a thousand of them beside their thousand plans."""
        try:
            async for obj in self._claims.list_claims(namespace, wanted.keys()):
                claim = wanted.get(obj.metadata.name)
                if claim is not None and obj.metadata.uid == claim.uid:
                    plans[claim.uid] = self._plan(claim, obj, snapshot)
        except ApiError as exc:
            log.warning("%s; reading the rest of its claims one by one instead", exc)

    async def _get_and_plan(self, claim: ClaimRef) -> Plan | PrepareError:
        try:
            obj = await self._claims.get_claim(claim.namespace, claim.name)
        except NotFound as exc:
            return PrepareError(f"ResourceClaim {claim.namespace}/{claim.name} not found: {exc}")
        except ApiError as exc:
            return PrepareError(str(exc))
        return self._plan(claim, obj, self._inventory.snapshot)

    async def keep_pods(self) -> None:
        """Duty: read the pods of the prepared claims this process has not read (the checkpoint keeps none), once
        after each PODS_SWEEP_S, while the API answers: only those claims are asked for, by name."""
        backoff = Backoff(PODS_SWEEP_S, 300.0)
        while True:
            await asyncio.sleep(backoff.next())
            records = dict(self.store.records)
            for gone in self._pods.keys() - records.keys():  # unprepared by the other instance
                del self._pods[gone]
            unknown = [(uid, record) for uid, record in records.items()
                       if record.state == COMPLETED and uid not in self._pods]
            try:
                for uid, record in unknown:
                    try:
                        obj = await self._claims.get_claim(record.namespace, record.name)
                    except NotFound:
                        self._pods[uid] = ""
                        continue
                    self._pods[uid] = _pods_of(obj) if obj.metadata.uid == uid else ""
            except ApiError as exc:
                log.debug("reading the pods of prepared claims: %s; trying again later", exc)
                continue
            backoff.reset()

    def _plan(self, claim: ClaimRef, obj: ResourceClaim, snapshot: Snapshot) -> Plan | PrepareError:
        self._pods[claim.uid] = _pods_of(obj)
        try:
            return plan_claim(claim, obj, snapshot, self.node, self.store.kind, self.store.layer)
        except PrepareError as exc:
            return exc

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        answers = await self.store.forget(claims)
        for claim in claims:
            if answers.get(claim.uid) == "":
                self._pods.pop(claim.uid, None)
                if self._status is not None:
                    self._status.unprepared(claim)
        return answers

    def slice_uses(self) -> list[SliceRow]:
        """Each held slice of a prepared claim, as its ledger says, labelled with the claim's namespace, the pods it
        is reserved for, its GPU and device (metrics.SliceUses)."""
        ledgers = self.store.ledgers
        if ledgers is None:
            return []
        devices = self._inventory.snapshot.pool.devices
        found = []
        for uid, record in list(self.store.records.items()):
            if record.state != COMPLETED:
                continue
            # Each request's ledger is named from the request (layer_allocation), never parsed back into it.
            requests = dict.fromkeys(name for device in record.devices for name in device.request_names)
            for request in requests:
                allocation = layer_allocation(uid, request)
                if allocation not in record.layer_allocations:
                    continue
                # A request's slices are in the order of its prepared devices (plan_claim).
                names = [device.device for device in record.devices if device.request_names == [request]]
                for use in ledgers.usage(allocation):
                    name = names[use.index] if use.index < len(names) else ""
                    gpu = devices[name].gpu_id if name in devices else ""
                    found.append(SliceRow(record.namespace, self._pods.get(uid, ""), "", gpu, name, use))
        return found


def _pods_of(claim: ResourceClaim) -> str:
    return ",".join(sorted(c.name for c in claim.status.reserved_for if c.resource == "pods"))
