"""Preparing and unpreparing claims: read the claim, look up its devices in the snapshot, build the container
edits, write the CDI spec, and checkpoint.

The promises, kept after any fault: the kubelet is told a claim is prepared only once the checkpoint says so, and
unprepared only once the checkpoint no longer holds it; what the kubelet was last told, the checkpoint and the CDI
directory agree. No lock is held across the network: claims are read from the API before the state lock is
taken, so an Unprepare (which reads nothing) answers at once however slow the API is. Blocking writes (the
checkpoint with fsync, the CDI specs) run in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gpuppetti.base.backoff import Backoff
from gpuppetti.base.fsutil import is_mount_point, make_directory, remove_file
from gpuppetti.core import cdi
from gpuppetti.core.kubeobjects import ResourceClaim
from gpuppetti.dra.checkpoint import COMPLETED, STARTED, Checkpoint, ClaimRecord
from gpuppetti.dra.plan import LAYER_PREFIX, Plan, PrepareError, layer_allocation, plan_claim
from gpuppetti.kit.draplugin import ClaimRef, PreparedDevice
from gpuppetti.node.inventory import Inventory, Snapshot
from gpuppetti.node.kube import ApiError, NotFound
from gpuppetti.node.metrics import SliceRow
from gpuppetti.node.vulkanlayer import LayerDir

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


# Beside the layer's allocations, on the same file system: a claim's directory is renamed into it under the state
# lock (one rename) and removed from there with no lock held, however many files a tenant left in it.
TRASH = "dra-trash"


def _named(claims: Sequence[ClaimRef], shown: int = 5) -> str:
    """``2 claim(s): default/a (uid), default/b (uid)``, naming at most the first few."""
    names = ", ".join(str(claim) for claim in claims[:shown])
    more = f" and {len(claims) - shown} more" if len(claims) > shown else ""
    return f"{len(claims)} claim(s): {names}{more}"


T = TypeVar("T")


async def _run_to_the_end(function: Callable[..., T], *args: Any) -> T:
    """``function`` in a thread; a caller cancelled meanwhile (the kubelet gave up on its call) still waits for the
    thread to finish before it is cancelled, so that the state lock it holds is released only then and no other
    call's checkpoint save runs beside this one's."""
    future = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({future})
        raise


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


def _write_specs(directory: Path, specs: Mapping[str, tuple[str, bytes]]) -> dict[str, str]:
    """Write each claim's spec (its file name and its canonical JSON, as its record holds them); returns the error
    of each that failed, by claim. Runs in a thread."""
    by_file = {filename: uid for uid, (filename, _) in specs.items()}
    failed = cdi.write_spec_files(directory, {filename: spec + b"\n" for filename, spec in specs.values()})
    return {by_file[filename]: f"writing the CDI spec into {directory} failed: {exc.strerror or exc}"
            for filename, exc in failed.items()}


def _remove_specs(directory: Path, filenames: Sequence[str]) -> None:
    for filename in filenames:
        try:
            remove_file(directory / filename)
        except OSError as exc:
            log.error("cannot remove CDI spec %s: %s", directory / filename, exc.strerror or exc)


class DraState:
    """Prepare and unprepare; changes to the checkpoint are serialised, API reads are not."""

    def __init__(
        self, inventory: Inventory, node: str, cdi_dir: Path, checkpoint: Checkpoint, claims: ClaimReader,
        kind: str = cdi.DEFAULT_KIND, layer: LayerDir | None = None,
    ) -> None:
        self._inventory = inventory
        # Where slices are enforced: the Vulkan layer's directory (None: they are not).
        self.layer = layer
        self.node = node
        self.cdi_dir = cdi_dir
        self.checkpoint = checkpoint
        self._claims = claims
        self.kind = kind
        self._lock = asyncio.Lock()
        # Prepared claims whose CDI spec could not be written back (a full directory), and why.
        self.missing_specs: dict[str, str] = {}
        # The pods a claim was reserved for when it was read to be prepared (for /metrics; not kept across a restart).
        self._pods: dict[str, str] = {}
        # Layer directories of claims that went, renamed here to be removed outside the lock (empty_trash).
        self.trash = None if layer is None else LayerDir(layer.path / TRASH)
        self._trashed = asyncio.Event()
        self._trashed.set()  # what an earlier instance left there goes too

    @property
    def prepared(self) -> int:
        return sum(1 for record in self.checkpoint.claims.values() if record.state == COMPLETED)

    # -- the CDI directory agrees with the checkpoint -------------------------------------------------------

    def _spec_files(self) -> set[str]:
        prefix = cdi.spec_prefix(self.kind) + "_"
        try:
            return {entry.name for entry in self.cdi_dir.iterdir() if entry.name.startswith(prefix)}
        except FileNotFoundError:
            return set()

    async def restore(self) -> int:
        """Re-create the missing CDI specs of completed claims (/var/run/cdi is tmpfs, and a reboot empties it) and
        remove specs the checkpoint does not hold as prepared. Returns how many were re-created; those that could
        not be are in ``missing_specs`` until a later call succeeds."""
        async with self._lock:
            restored = await _run_to_the_end(self._restore)
        self._trashed.set()
        return restored

    def _restore(self) -> int:
        present = self._spec_files()
        wanted: dict[str, tuple[str, bytes]] = {}
        for uid, record in self.checkpoint.claims.items():
            if record.state == COMPLETED and record.cdi_spec and record.cdi_file:
                if record.cdi_file not in present:
                    wanted[uid] = (record.cdi_file, record.cdi_spec)
                present.discard(record.cdi_file)
        # Left over from a claim unprepared (or never completed) when the driver stopped: nobody's.
        _remove_specs(self.cdi_dir, sorted(present))
        if self.layer is not None:
            self._restore_layer_dirs()
        failed = _write_specs(self.cdi_dir, wanted) if wanted else {}
        for uid, why in failed.items():
            if self.missing_specs.get(uid) != why:
                log.error("cannot re-create the CDI spec of prepared claim %s: %s", uid, why)
        for uid in self.missing_specs.keys() - failed.keys():
            log.info("re-created the CDI spec of prepared claim %s", uid)
        self.missing_specs = failed
        return len(wanted) - len(failed)

    def _restore_layer_dirs(self) -> None:
        """Each completed claim's layer directories there (kept as they are: running containers count in them),
        as its checkpointed plan names them, and no other DRA claim's."""
        assert self.layer is not None
        kept = {allocation: (uid, memories) for uid, record in self.checkpoint.claims.items()
                if record.state == COMPLETED for allocation, memories in record.layer_allocations.items()}
        for allocation in self.layer.existing():
            if allocation.startswith(LAYER_PREFIX) and allocation not in kept:
                self._discard(allocation)
        for allocation, (uid, memories) in kept.items():
            try:
                self.layer.create(allocation, memories, fresh=False)
            except (OSError, ValueError) as exc:
                log.error("cannot re-create the Vulkan layer's directory of prepared claim %s: %s", uid, exc)

    # -- prepare ----------------------------------------------------------------------------------------------

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, list[PreparedDevice] | PrepareError]:
        """Prepare every claim of one kubelet call; each gets its devices or its own error.

        The checkpoint is written twice per call, however many claims it holds: once with every new claim
        PrepareStarted (before any side effect), once with them PrepareCompleted (after their CDI specs).
        """
        with _collector_paused():
            return await self._prepare(claims)

    async def _prepare(self, claims: Sequence[ClaimRef]) -> dict[str, list[PreparedDevice] | PrepareError]:
        answers: dict[str, list[PreparedDevice] | PrepareError] = {}
        async with self._lock:
            done = {claim.uid: devices for claim in claims if (devices := self._completed(claim)) is not None}
            answers.update(done)
            pending = [claim for claim in claims if claim.uid not in done]
            if done:
                await self._ensure_specs([c for c in claims if c.uid in done], answers)
        began = time.perf_counter()
        # The network, with no lock held: an Unprepare meanwhile answers at once.
        # The pending claims of each namespace, by name.
        namespaces: dict[str, dict[str, ClaimRef]] = {}
        for claim in pending:
            namespaces.setdefault(claim.namespace, {})[claim.name] = claim
        plans: dict[str, Plan | PrepareError] = {}
        snapshot = self._inventory.snapshot
        await asyncio.gather(*(self._list_and_plan(ns, wanted, snapshot, plans)
                               for ns, wanted in namespaces.items() if len(wanted) >= LIST_FROM))
        # Not listed (too few of its namespace, created or replaced since the list, or the list failed): asked for
        # by name, all at once, each planned as soon as it is read.
        unlisted = [claim for claim in pending if claim.uid not in plans]
        if unlisted:
            read_one_by_one = await asyncio.gather(*(self._read_and_plan(claim) for claim in unlisted))
            plans.update(zip((claim.uid for claim in unlisted), read_one_by_one, strict=True))
        read = time.perf_counter()
        async with self._lock:
            planned: dict[str, tuple[ClaimRef, Plan]] = {}
            for claim in pending:
                plan = plans[claim.uid]
                if (devices := self._completed(claim)) is not None:
                    answers[claim.uid] = devices  # another call prepared it while this one read the API
                    continue
                if isinstance(plan, PrepareError):
                    answers[claim.uid] = plan
                else:
                    planned[claim.uid] = (claim, plan)
            committed: dict[str, list[PreparedDevice] | PrepareError] = {}
            if planned:
                committed = await _run_to_the_end(self._commit, planned)
            answers.update(committed)
        prepared = [uid for uid, answer in committed.items() if not isinstance(answer, PrepareError)]
        if prepared:
            # One line per call at info, naming the first few: a kubelet call can carry a thousand claims.
            log.info("prepared %s in %.1f ms (reading and planning them %.1f ms, checkpoint and CDI specs %.1f ms)",
                     _named([planned[uid][0] for uid in prepared]), (time.perf_counter() - began) * 1000,
                     (read - began) * 1000, (time.perf_counter() - read) * 1000)
        return answers

    def _completed(self, claim: ClaimRef) -> list[PreparedDevice] | None:
        """The devices of a claim the checkpoint holds as prepared; None for any other."""
        record = self.checkpoint.claims.get(claim.uid)
        return record.devices if record is not None and record.state == COMPLETED else None

    async def _ensure_specs(self, claims: Sequence[ClaimRef],
                            answers: dict[str, list[PreparedDevice] | PrepareError]) -> None:
        """Completed claims asked again: their specs must be there, or the container gets no GPU."""
        missing: dict[str, tuple[str, bytes]] = {}
        for claim in claims:
            record = self.checkpoint.claims[claim.uid]
            if record.cdi_spec and record.cdi_file and not (self.cdi_dir / record.cdi_file).exists():
                missing[claim.uid] = (record.cdi_file, record.cdi_spec)
        if missing:
            for uid, why in (await _run_to_the_end(_write_specs, self.cdi_dir, missing)).items():
                answers[uid] = PrepareError(why)

    def _commit(self, planned: Mapping[str, tuple[ClaimRef, Plan]]) -> dict[str, list[PreparedDevice] | PrepareError]:
        """Checkpoint the claims PrepareStarted, make their layer directories and CDI specs, checkpoint them
        PrepareCompleted; each claim's answer. Blocks (fsync): run in one thread, under the state lock."""
        started = {**self.checkpoint.claims, **{uid: ClaimRecord(uid, c.namespace, c.name, STARTED,
                                                                 layer_allocations=plan.allocations)
                                                for uid, (c, plan) in planned.items()}}
        try:
            self.checkpoint.save(started)
        except OSError as exc:
            why = f"saving the checkpoint {self.checkpoint.path} failed: {exc.strerror or exc}; nothing was prepared"
            return dict.fromkeys(planned, PrepareError(why))
        # Each spec is encoded once: its file and its checkpoint record hold the same bytes.
        specs = {uid: cdi.encode_spec(plan.spec).encode() for uid, (_, plan) in planned.items()}
        failed = self._write(planned, specs)
        answers: dict[str, list[PreparedDevice] | PrepareError] = {}
        completed = dict(started)
        for uid, (claim, plan) in planned.items():
            if uid in failed:
                del completed[uid]
                answers[uid] = PrepareError(failed[uid])
            else:
                completed[uid] = ClaimRecord(uid, claim.namespace, claim.name, COMPLETED, plan.devices, specs[uid],
                                             plan.filename, plan.allocations)
        written = [uid for uid in planned if uid not in failed]
        try:
            self.checkpoint.save(completed)
        except OSError as exc:
            # The file still says PrepareStarted: the kubelet is told these failed, and their specs go again, so
            # that its retry (which saves again) finds the three in agreement.
            _remove_specs(self.cdi_dir, [planned[uid][1].filename for uid in written])
            why = f"saving the checkpoint {self.checkpoint.path} failed: {exc.strerror or exc}; the kubelet will retry"
            answers.update(dict.fromkeys(written, PrepareError(why)))
            return answers
        debug = log.isEnabledFor(logging.DEBUG)
        for uid in written:
            claim, plan = planned[uid]
            answers[uid] = plan.devices
            if debug:
                log.debug("prepared claim %s/%s (%s): %s", claim.namespace, claim.name, uid,
                          ", ".join(d.device for d in plan.devices))
        return answers

    def _write(self, planned: Mapping[str, tuple[ClaimRef, Plan]], specs: Mapping[str, bytes]) -> dict[str, str]:
        """The claims' layer directories, then their CDI specs (which mount them); the errors by claim."""
        failed: dict[str, str] = {}
        for uid, (_, plan) in planned.items():
            try:
                for allocation_id, memories in plan.allocations.items():
                    if self.layer is not None:
                        self.layer.create(allocation_id, memories)
            except OSError as exc:
                failed[uid] = f"creating the Vulkan layer's directory in {self.layer} failed: {exc.strerror or exc}"
        files = {plan.filename: specs[uid] + b"\n" for uid, (_, plan) in planned.items() if uid not in failed}
        by_file = {plan.filename: uid for uid, (_, plan) in planned.items()}
        for filename, error in cdi.write_spec_files(self.cdi_dir, files).items():
            failed[by_file[filename]] = f"writing the CDI spec into {self.cdi_dir} failed: {error.strerror or error}"
        return failed

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

    async def _read_and_plan(self, claim: ClaimRef) -> Plan | PrepareError:
        try:
            obj = await self._claims.get_claim(claim.namespace, claim.name)
        except NotFound as exc:
            return PrepareError(f"ResourceClaim {claim.namespace}/{claim.name} not found: {exc}")
        except ApiError as exc:
            return PrepareError(str(exc))
        return self._plan(claim, obj, self._inventory.snapshot)

    def _plan(self, claim: ClaimRef, obj: ResourceClaim, snapshot: Snapshot) -> Plan | PrepareError:
        self._pods[claim.uid] = ",".join(sorted(c.name for c in obj.status.reserved_for if c.resource == "pods"))
        try:
            return plan_claim(claim, obj, snapshot, self.node, self.kind, self.layer)
        except PrepareError as exc:
            return exc

    # -- layer directories that went -------------------------------------------------------------------------

    def _discard(self, allocation: str) -> None:
        """Move a claim's layer directory into the trash: one rename, so that the state lock is held for no more,
        whatever the directory holds. Blocks (a system call or two): call it in a thread."""
        assert self.layer is not None and self.trash is not None
        source = self.layer.allocations / allocation
        if is_mount_point(source):
            # A tmpfs of its own, sized for its accounting files: bounded, so removed here at once (rename(2)
            # would refuse a mount point, EBUSY). What cannot go is retried by the next Unprepare or start.
            self.layer.remove(allocation)
            return
        # A name of its own in the trash: an earlier directory of the same claim may still be there.
        target = self.trash.allocations / f"{allocation[:100]}.{secrets.token_hex(4)}"
        try:
            make_directory(self.trash.allocations)
            os.rename(source, target)
        except FileNotFoundError:
            if source.exists():
                log.error("cannot move the Vulkan layer's directory %s into %s: it vanished", source, target.parent)
            return
        except OSError as exc:
            log.error("cannot move the Vulkan layer's directory %s into %s (%s); it stays until the driver starts "
                      "again", source, target.parent, exc.strerror or exc)
            return

    def _discard_all(self, allocations: Sequence[str]) -> None:
        for allocation in allocations:
            self._discard(allocation)

    def _empty_trash(self) -> list[str]:
        """Remove what the trash holds; returns what could not be removed. Blocks: call it in a thread."""
        assert self.trash is not None
        try:
            entries = list(os.scandir(self.trash.allocations))
        except FileNotFoundError:
            return []
        left = []
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                self.trash.remove(entry.name)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            if os.path.lexists(entry.path):
                left.append(entry.name)
        return left

    async def empty_trash(self) -> None:
        """Duty: remove the layer directories of claims that went, with no lock held, as they arrive and at
        start; what cannot be removed is logged and tried again after a while."""
        if self.trash is None:
            return
        backoff = Backoff(1.0, 300.0)
        while True:
            await self._trashed.wait()
            self._trashed.clear()
            left = await asyncio.to_thread(self._empty_trash)
            if not left:
                backoff.reset()
                continue
            delay = backoff.next()
            log.warning("cannot remove %d directory(ies) from %s yet (%s); trying again in %.0fs", len(left),
                        self.trash.allocations, ", ".join(left[:3]), delay)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._trashed.wait()
            self._trashed.set()

    def slice_uses(self) -> list[SliceRow]:
        """Each held slice of a prepared claim, as its accounting file says, labelled with the claim's namespace, the
        pods it is reserved for, its GPU and device (metrics.SliceUses). Blocks: it reads the files."""
        if self.layer is None:
            return []
        devices = self._inventory.snapshot.pool.devices
        found = []
        for uid, record in list(self.checkpoint.claims.items()):
            if record.state != COMPLETED:
                continue
            # Each request's directory is named from the request (layer_allocation), never parsed back into it.
            requests = dict.fromkeys(name for device in record.devices for name in device.request_names)
            for request in requests:
                allocation = layer_allocation(uid, request)
                memories = record.layer_allocations.get(allocation)
                if memories is None:
                    continue
                # A request's slices are in the order of its prepared devices (plan_claim).
                names = [device.device for device in record.devices if device.request_names == [request]]
                for use in self.layer.usage(allocation, len(memories)):
                    name = names[use.index] if use.index < len(names) else ""
                    gpu = devices[name].gpu_id if name in devices else ""
                    found.append(SliceRow(record.namespace, self._pods.get(uid, ""), "", gpu, name, use))
        return found

    # -- unprepare --------------------------------------------------------------------------------------------

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Forget every claim of one call; a claim that was never prepared is simply not there. Each answer is ""
        (done) or why not; "done" only once the checkpoint no longer holds the claim."""
        answers: dict[str, str] = {}
        async with self._lock:
            current = self.checkpoint.claims
            gone = [claim for claim in claims if claim.uid in current]
            directories = [allocation for claim in gone for allocation in current[claim.uid].layer_allocations]
            if gone:
                remaining = {uid: record for uid, record in current.items() if uid not in {c.uid for c in gone}}
                try:
                    await _run_to_the_end(self.checkpoint.save, remaining)
                except OSError as exc:
                    why = f"saving the checkpoint {self.checkpoint.path} failed: {exc.strerror or exc}"
                    for claim in claims:
                        answers[claim.uid] = why
                    return answers
                for claim in gone:
                    log.debug("unprepared claim %s/%s (%s)", claim.namespace, claim.name, claim.uid)
                log.info("unprepared %s", _named(gone))
            # After the checkpoint let them go; a spec the checkpoint never held goes too.
            await _run_to_the_end(_remove_specs, self.cdi_dir,
                                  [cdi.spec_filename(self.kind, claim.uid) for claim in claims])
            if directories:
                await _run_to_the_end(self._discard_all, directories)
                self._trashed.set()
            for claim in claims:
                self.missing_specs.pop(claim.uid, None)
                self._pods.pop(claim.uid, None)
                answers[claim.uid] = ""
        return answers
