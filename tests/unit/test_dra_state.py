from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path

import pytest

from gpuppetti.core.kubeobjects import ResourceClaim
from gpuppetti.core.model import Serves
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.dra.checkpoint import Checkpoint
from gpuppetti.dra.state import LIST_FROM, ClaimRef, DraState, _collector_paused, _run_to_the_end
from gpuppetti.node.inventory import Inventory
from gpuppetti.node.kube import ApiError
from tests.dra_support import DRIVER, NODE
from tests.helpers import config_from


def test_the_collector_is_held_off_while_any_call_runs_and_only_then() -> None:
    assert gc.isenabled()
    with _collector_paused():
        assert not gc.isenabled()
        with _collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "the outer call still runs"
    assert gc.isenabled()
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled(), "held off by someone else: left so"
    finally:
        gc.enable()


async def test_a_cancelled_caller_waits_for_its_thread_to_finish() -> None:
    finished = threading.Event()

    def commit() -> None:
        time.sleep(0.3)
        finished.set()

    task = asyncio.ensure_future(_run_to_the_end(commit))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set(), "the lock it holds would otherwise be released while the thread still saves"


class _Claims:
    """A claim reader whose list of the namespace breaks after ``listed`` claims: as an API server that goes away
    between two pages does."""

    def __init__(self, claims: dict[str, ResourceClaim], listed: int) -> None:
        self.claims = claims
        self.listed = listed
        self.read: list[str] = []

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        self.read.append(name)
        return self.claims[name]

    async def list_claims(self, namespace: str, names: Collection[str]) -> AsyncIterator[ResourceClaim]:
        for number, claim in enumerate(self.claims.values()):
            if number == self.listed:
                raise ApiError("listing the ResourceClaims of namespace default: 503 the API server is going away")
            yield claim


def _allocated(n: int) -> ResourceClaim:
    return ResourceClaim.model_validate({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": f"c{n}", "namespace": "default", "uid": f"3f2a1b0c-0000-4000-8000-{n:012d}"},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": [
            {"driver": DRIVER, "pool": NODE, "request": "gpu", "device": f"gpu-apple-{n}"}]}}}})


async def test_a_list_that_breaks_keeps_what_it_read_and_the_rest_are_read_one_by_one(tmp_path: Path) -> None:
    config = config_from(f"version: v1\nbackend: simulated\nsimulated:\n  gpus:\n    - {{model: Apple M3 Max, "
                         f"vendor: apple, cores: 40, memory: 48Gi, count: {LIST_FROM * 2}}}\n")
    inventory = Inventory(config, SimulatedBackend(config.simulated).discover(), Serves.POOL)
    claims = {f"c{n}": _allocated(n) for n in range(LIST_FROM * 2)}
    reader = _Claims(claims, listed=LIST_FROM)
    state = DraState(inventory, NODE, tmp_path / "cdi", Checkpoint(tmp_path / "checkpoint.json"), reader)
    refs = [ClaimRef("default", claim.metadata.uid or "", name) for name, claim in claims.items()]
    answers = await state.prepare(refs)
    assert all(isinstance(answer, list) for answer in answers.values()), answers
    assert reader.read == [f"c{n}" for n in range(LIST_FROM, LIST_FROM * 2)], "only the claims the list did not give"
    assert state.prepared == LIST_FROM * 2
    assert len(list((tmp_path / "cdi").iterdir())) == LIST_FROM * 2
