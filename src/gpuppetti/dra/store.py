"""What the DRA driver keeps on the node, committed and restored together: the checkpoint, the claims' CDI specs and
their ledgers (layer/ledger.py: one per request held to a slice, served on a socket in a directory of the driver's).

The promises, kept after any fault: a claim is answered as prepared only once the checkpoint says so, and
unprepared only once the checkpoint no longer holds it; what the kubelet was last told, the checkpoint, the CDI
directory and the layer's directories agree. Every change is serialised by one lock, and nothing under it waits
for the network (the driver reads claims before it commits them). Blocking writes (the checkpoint with fsync, the
CDI specs, the layer's directories) run in a thread.

Two instances share all of it during a rolling update (the old pod and the new): each change also holds the plugin
directory's lock (base.dirlock), which both take, and starts from the checkpoint as the file says it now. A ledger
the other instance serves stays its own while it lives (its processes are connected there): this one takes it over
once nobody listens on it any more, and those processes then declare what they hold to this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gpuppetti.base.backoff import Backoff
from gpuppetti.base.dirlock import DirectoryLock
from gpuppetti.base.fsutil import make_directory, remove_file
from gpuppetti.base.watch import Change, watch_directory
from gpuppetti.core import cdi
from gpuppetti.dra.checkpoint import COMPLETED, STARTED, Checkpoint, ClaimRecord, UnusableCheckpoint, spec_json
from gpuppetti.dra.plan import LAYER_PREFIX, Plan, PrepareError
from gpuppetti.kit.draplugin import ClaimRef, PreparedDevice, named
from gpuppetti.layer.ledger import Terms
from gpuppetti.layer.ledgers import Ledgers
from gpuppetti.layer.vulkan import LayerDir

log = logging.getLogger(__name__)

Answer = list[PreparedDevice] | PrepareError

T = TypeVar("T")


async def _run_to_the_end(function: Callable[..., T], *args: Any) -> T:
    """``function`` in a thread; a caller cancelled meanwhile (the kubelet gave up on its call) still waits for the
    thread to finish before it is cancelled, so that the lock it holds is released only then and no other call's
    checkpoint save runs beside this one's."""
    future = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({future})
        raise


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


Listeners = dict[str, tuple[socket.socket, list[int]]]
# How often a ledger the other instance serves is looked at again, to take it over once that one has stopped: its
# processes wait for a ledger to connect to in the meantime.
TAKE_OVER_POLL_S = 0.2


def _terms(memories: Sequence[int]) -> list[Terms]:
    # The checkpoint keeps each slice's memory; its compute share is in the container's env (0: as that says).
    return [Terms(memory, 0) for memory in memories]


class ClaimStore:
    """The checkpoint, the CDI specs and the ledgers of the driver's claims; changes are serialised."""

    def __init__(self, cdi_dir: Path, checkpoint: Checkpoint, kind: str = cdi.DEFAULT_KIND,
                 layer: LayerDir | None = None, ledgers: Ledgers | None = None,
                 shared: DirectoryLock | None = None) -> None:
        self.cdi_dir = cdi_dir
        self.checkpoint = checkpoint
        self.kind = kind
        # The lock another instance of the driver takes too (None: this process is the only one).
        self.shared = shared
        # Ledgers of prepared claims another instance serves now, to take over once it stops.
        self.elsewhere: set[str] = set()
        self._elsewhere_changed = asyncio.Event()
        # Where slices are enforced: the Vulkan layer's directory and the claims' ledgers (None: they are not).
        self.layer = layer
        self.ledgers = ledgers if layer is not None else None
        self._lock = asyncio.Lock()
        # Prepared claims whose CDI spec could not be written back (a full directory), and why.
        self.missing_specs: dict[str, str] = {}

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """This process's lock, then the one both instances take, with the checkpoint read again where the other
        instance wrote it. Raises UnusableCheckpoint where it can no longer be read."""
        async with self._lock:
            if self.shared is None:
                yield
                return
            async with self.shared.held():
                await _run_to_the_end(self.checkpoint.refresh)
                yield

    @property
    def records(self) -> Mapping[str, ClaimRecord]:
        return self.checkpoint.claims

    @property
    def prepared(self) -> int:
        return sum(1 for record in self.checkpoint.claims.values() if record.state == COMPLETED)

    def completed(self, uid: str) -> list[PreparedDevice] | None:
        """The devices of a claim the checkpoint holds as prepared; None for any other."""
        record = self.checkpoint.claims.get(uid)
        return record.devices if record is not None and record.state == COMPLETED else None

    # -- restore: the CDI directory and the layer's directories agree with the checkpoint --------------------

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
        try:
            async with self._turn():
                restored, listeners = await _run_to_the_end(self._restore)
                await self._serve(listeners, restored=True)
        except UnusableCheckpoint as exc:
            log.error("cannot restore the prepared claims: %s", exc)
            return 0
        if self.elsewhere:
            self._elsewhere_changed.set()
        return restored

    async def take_over(self) -> None:
        """Duty: the ledgers another instance serves become this one's once it has stopped (restore binds those
        nobody listens on any more)."""
        while True:
            await self._elsewhere_changed.wait()
            self._elsewhere_changed.clear()
            while self.elsewhere:
                await asyncio.sleep(TAKE_OVER_POLL_S)
                before = set(self.elsewhere)
                await self.restore()
                if taken := before - self.elsewhere:
                    log.info("took over the ledger(s) of %d allocation(s) from the driver's other instance",
                             len(taken))

    async def _serve(self, listeners: Listeners, restored: bool = False) -> None:
        assert self.ledgers is not None or not listeners
        for allocation, (listener, memories) in listeners.items():
            assert self.ledgers is not None
            await self.ledgers.serve(allocation, listener, _terms(memories), restored)

    def _restore(self) -> tuple[int, Listeners]:
        present = self._spec_files()
        wanted: dict[str, tuple[str, bytes]] = {}
        for uid, record in self.checkpoint.claims.items():
            if record.state == COMPLETED and record.cdi_spec and record.cdi_file:
                if record.cdi_file not in present:
                    wanted[uid] = (record.cdi_file, record.cdi_spec)
                present.discard(record.cdi_file)
        # Left over from a claim unprepared (or never completed) when the driver stopped: nobody's.
        _remove_specs(self.cdi_dir, sorted(present))
        listeners = self._restore_ledgers() if self.ledgers is not None else {}
        failed = _write_specs(self.cdi_dir, wanted) if wanted else {}
        for uid, why in failed.items():
            if self.missing_specs.get(uid) != why:
                log.error("cannot re-create the CDI spec of prepared claim %s: %s", uid, why)
        for uid in self.missing_specs.keys() - failed.keys():
            log.info("re-created the CDI spec of prepared claim %s", uid)
        self.missing_specs = failed
        return len(wanted) - len(failed), listeners

    def _restore_ledgers(self) -> Listeners:
        """The sockets of each completed claim's ledgers not served yet (their containers' processes reconnect to
        them and declare what they hold), as its checkpointed plan names them, but for those another instance
        serves (``elsewhere``); no other DRA claim's directory stays. Blocks: call it in a thread."""
        ledgers = self.ledgers
        assert ledgers is not None
        kept = {allocation: (uid, memories) for uid, record in self.checkpoint.claims.items()
                if record.state == COMPLETED for allocation, memories in record.layer_allocations.items()}
        for allocation in ledgers.on_disk():
            if allocation.startswith(LAYER_PREFIX) and allocation not in kept:
                ledgers.remove(allocation)
        listeners: Listeners = {}
        self.elsewhere = set()
        for allocation, (uid, memories) in kept.items():
            if allocation in ledgers:
                continue
            if ledgers.served_elsewhere(allocation):
                self.elsewhere.add(allocation)
                continue
            try:
                listeners[allocation] = (ledgers.bind(allocation), memories)
            except OSError as exc:
                log.error("cannot serve the ledger of prepared claim %s again: %s", uid, exc.strerror or exc)
        return listeners

    async def keep_specs(self) -> None:
        """Duty: re-create the specs of prepared claims when something deletes them (or the whole directory), and
        keep trying while some cannot be written (a full directory)."""
        backoff = Backoff(0.5, 30.0)
        while True:
            try:
                make_directory(self.cdi_dir)
            except OSError as exc:
                log.error("cannot create the CDI directory %s: %s", self.cdi_dir, exc.strerror or exc)
                await backoff.wait()
                continue
            # Deletions only (a spec removed, the directory emptied by a reboot): the driver's own writes, each a
            # rename from a temporary file, make no noise for it, even a thousand of them in one Prepare.
            async for event in watch_directory(self.cdi_dir, creations=False, moves=False):
                lost = event.change is Change.DELETED and event.name.startswith(cdi.spec_prefix(self.kind))
                if lost or event.change in (Change.RESCAN, Change.READY) or self.missing_specs:
                    # Only specs of claims still prepared come back; the driver's own removals are not losses.
                    restored = await self.restore()
                    if restored and event.change is Change.READY:
                        log.info("re-created the CDI specs of %d prepared claim(s) from %s", restored,
                                 self.checkpoint.path)
                    elif restored:
                        log.warning("CDI specs of prepared claims were removed from %s; re-created %d",
                                    self.cdi_dir, restored)
                if self.missing_specs:
                    # The directory refuses them (ENOSPC): try again after a while, not only on the next event.
                    break
            else:
                log.warning("CDI directory %s was removed; re-creating it and its specs", self.cdi_dir)
            if self.missing_specs:
                await backoff.wait()
            else:
                backoff.reset()

    # -- prepare ----------------------------------------------------------------------------------------------

    async def answer_completed(self, claims: Sequence[ClaimRef]) -> dict[str, Answer]:
        """The answers of the claims already prepared, their CDI specs written back where they went (without
        them the container gets no GPU); the rest are not answered."""
        answers: dict[str, Answer] = {}
        try:
            async with self._turn():
                missing: dict[str, tuple[str, bytes]] = {}
                for claim in claims:
                    if (devices := self.completed(claim.uid)) is None:
                        continue
                    answers[claim.uid] = devices
                    record = self.checkpoint.claims[claim.uid]
                    if record.cdi_spec and record.cdi_file and not (self.cdi_dir / record.cdi_file).exists():
                        missing[claim.uid] = (record.cdi_file, record.cdi_spec)
                if missing:
                    for uid, why in (await _run_to_the_end(_write_specs, self.cdi_dir, missing)).items():
                        answers[uid] = PrepareError(why)
        except UnusableCheckpoint as exc:
            return dict.fromkeys((claim.uid for claim in claims), PrepareError(str(exc)))
        return answers

    async def commit(self, planned: Mapping[str, tuple[ClaimRef, Plan]]) -> dict[str, Answer]:
        """Commit the planned claims; each claim's answer. A claim another call prepared meanwhile keeps what it
        was given.

        The checkpoint is written twice, however many claims there are: once with every new claim PrepareStarted
        (before any side effect), once with them PrepareCompleted (after their layer directories and CDI specs).
        """
        answers: dict[str, Answer] = {}
        try:
            async with self._turn():
                fresh: dict[str, tuple[ClaimRef, Plan]] = {}
                for uid, entry in planned.items():
                    if (devices := self.completed(uid)) is not None:
                        answers[uid] = devices
                    else:
                        fresh[uid] = entry
                if fresh:
                    committed, listeners = await _run_to_the_end(self._commit, fresh)
                    answers.update(committed)
                    await self._serve(listeners)
        except UnusableCheckpoint as exc:
            return dict.fromkeys(planned, PrepareError(str(exc)))
        return answers

    def _commit(self, planned: Mapping[str, tuple[ClaimRef, Plan]]) -> tuple[dict[str, Answer], Listeners]:
        """Blocks (fsync): run in one thread, under the lock."""
        started = {**self.checkpoint.claims, **{uid: ClaimRecord(uid, c.namespace, c.name, STARTED,
                                                                 layer_allocations=plan.allocations)
                                                for uid, (c, plan) in planned.items()}}
        try:
            self.checkpoint.save(started)
        except OSError as exc:
            why = f"saving the checkpoint {self.checkpoint.path} failed: {exc.strerror or exc}; nothing was prepared"
            return dict.fromkeys(planned, PrepareError(why)), {}
        # Each spec is encoded once: its file and its checkpoint record hold the same bytes.
        specs = {uid: spec_json(cdi.encode_spec(plan.spec)) for uid, (_, plan) in planned.items()}
        listeners: Listeners = {}
        failed = self._write(planned, specs, listeners)
        answers: dict[str, Answer] = {}
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
            self._unbind(listeners)
            why = f"saving the checkpoint {self.checkpoint.path} failed: {exc.strerror or exc}; the kubelet will retry"
            answers.update(dict.fromkeys(written, PrepareError(why)))
            return answers, {}
        debug = log.isEnabledFor(logging.DEBUG)
        for uid in written:
            claim, plan = planned[uid]
            answers[uid] = plan.devices
            if debug:
                log.debug("prepared claim %s: %s", claim, ", ".join(d.device for d in plan.devices))
        return answers, listeners

    def _unbind(self, listeners: Listeners) -> None:
        assert self.ledgers is not None or not listeners
        for allocation, (listener, _) in listeners.items():
            listener.close()
            if self.ledgers is not None:
                self.ledgers.remove(allocation)
        listeners.clear()

    def _write(self, planned: Mapping[str, tuple[ClaimRef, Plan]], specs: Mapping[str, bytes],
               listeners: Listeners) -> dict[str, str]:
        """The claims' ledgers' sockets (into ``listeners``, to be served once committed), then their CDI specs
        (which mount their directories); the errors by claim."""
        failed: dict[str, str] = {}
        ledgers = self.ledgers
        for uid, (_, plan) in planned.items():
            if ledgers is None:
                break
            bound: Listeners = {}
            try:
                for allocation_id, memories in plan.allocations.items():
                    if allocation_id not in ledgers:
                        bound[allocation_id] = (ledgers.bind(allocation_id), memories)
            except OSError as exc:
                self._unbind(bound)
                failed[uid] = f"making the ledger's socket in {ledgers.root} failed: {exc.strerror or exc}"
            listeners.update(bound)
        files = {plan.filename: specs[uid] + b"\n" for uid, (_, plan) in planned.items() if uid not in failed}
        by_file = {plan.filename: uid for uid, (_, plan) in planned.items()}
        for filename, error in cdi.write_spec_files(self.cdi_dir, files).items():
            uid = by_file[filename]
            failed[uid] = f"writing the CDI spec into {self.cdi_dir} failed: {error.strerror or error}"
            self._unbind({a: listeners.pop(a) for a in planned[uid][1].allocations if a in listeners})
        return failed

    # -- unprepare --------------------------------------------------------------------------------------------

    async def forget(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Forget every claim of one call; a claim that was never prepared is simply not there. Each answer is ""
        (done) or why not; "done" only once the checkpoint no longer holds the claim."""
        try:
            async with self._turn():
                return await self._forget(claims)
        except UnusableCheckpoint as exc:
            return dict.fromkeys((claim.uid for claim in claims), str(exc))

    async def _forget(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        current = self.checkpoint.claims
        gone = [claim for claim in claims if claim.uid in current]
        directories = [allocation for claim in gone for allocation in current[claim.uid].layer_allocations]
        if gone:
            leaving = {claim.uid for claim in gone}
            remaining = {uid: record for uid, record in current.items() if uid not in leaving}
            try:
                await _run_to_the_end(self.checkpoint.save, remaining)
            except OSError as exc:
                why = f"saving the checkpoint {self.checkpoint.path} failed: {exc.strerror or exc}"
                return {claim.uid: why for claim in claims}
            if log.isEnabledFor(logging.DEBUG):
                for claim in gone:
                    log.debug("unprepared claim %s", claim)
            log.info("unprepared %s", named(gone))
        # After the checkpoint let them go; a spec the checkpoint never held goes too.
        await _run_to_the_end(_remove_specs, self.cdi_dir,
                              [cdi.spec_filename(self.kind, claim.uid) for claim in claims])
        if directories and self.ledgers is not None:
            self.elsewhere.difference_update(directories)
            for allocation in directories:
                self.ledgers.close(allocation)
            await _run_to_the_end(self._remove_ledgers, directories)
        for claim in claims:
            self.missing_specs.pop(claim.uid, None)
        return {claim.uid: "" for claim in claims}

    def _remove_ledgers(self, allocations: Sequence[str]) -> None:
        assert self.ledgers is not None
        for allocation in allocations:
            self.ledgers.remove(allocation)
