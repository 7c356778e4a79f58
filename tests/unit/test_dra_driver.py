from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpuppetti.core.kubeobjects import ResourceClaim
from gpuppetti.core.model import Serves
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.dra.checkpoint import Checkpoint
from gpuppetti.dra.driver import LIST_FROM, GpuDriver, _collector_paused
from gpuppetti.dra.plan import layer_allocation
from gpuppetti.dra.store import ClaimStore, _run_to_the_end
from gpuppetti.kit.draplugin import ClaimRef
from gpuppetti.layer.ledgers import Ledgers
from gpuppetti.layer.vulkan import LayerDir
from gpuppetti.node.inventory import Inventory
from gpuppetti.node.kube import ApiError
from tests.dra_support import DRIVER, NODE
from tests.helpers import config_from
from tests.ledger_client import Process


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


def _allocated(n: int, **result: Any) -> ResourceClaim:
    """Claim ``c{n}``, allocated device ``gpu-apple-{n}``; ``result`` adds to its one result (a share's fields)."""
    return msgspec.convert({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": f"c{n}", "namespace": "default", "uid": f"3f2a1b0c-0000-4000-8000-{n:012d}"},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": [
            {"driver": DRIVER, "pool": NODE, "request": "gpu", "device": f"gpu-apple-{n}", **result}]}}}},
        ResourceClaim)


async def test_a_list_that_breaks_keeps_what_it_read_and_the_rest_are_read_one_by_one(tmp_path: Path) -> None:
    config = config_from(f"version: v1\nbackend: simulated\nsimulated:\n  gpus:\n    - {{model: Apple M3 Max, "
                         f"vendor: apple, cores: 40, memory: 48Gi, count: {LIST_FROM * 2}}}\n")
    inventory = Inventory(config, SimulatedBackend(config.simulated).discover(), Serves.POOL)
    claims = {f"c{n}": _allocated(n) for n in range(LIST_FROM * 2)}
    reader = _Claims(claims, listed=LIST_FROM)
    store = ClaimStore(tmp_path / "cdi", Checkpoint(tmp_path / "checkpoint.json"))
    driver = GpuDriver(inventory, NODE, store, reader)
    refs = [ClaimRef("default", claim.metadata.uid or "", name) for name, claim in claims.items()]
    answers = await driver.prepare(refs)
    assert all(isinstance(answer, list) for answer in answers.values()), answers
    assert reader.read == [f"c{n}" for n in range(LIST_FROM, LIST_FROM * 2)], "only the claims the list did not give"
    assert store.prepared == LIST_FROM * 2
    assert len(list((tmp_path / "cdi").iterdir())) == LIST_FROM * 2


PARTITIONS = """\
version: v1
backend: simulated
simulated:
  gpus:
    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: 2}
dra: {slicing: partitions, partitions: [4]}
"""


def _layered_driver(tmp_path: Path) -> tuple[GpuDriver, LayerDir, list[ClaimRef]]:
    config = config_from(PARTITIONS)
    inventory = Inventory(config, SimulatedBackend(config.simulated).discover(), Serves.POOL)
    claims = {f"c{n}": _allocated(n, shareID="p1", consumedCapacity={"memory": "12Gi"}) for n in range(2)}
    layer = LayerDir(tmp_path / "vulkan")
    layer.ledgers.mkdir(parents=True, exist_ok=True)
    store = ClaimStore(tmp_path / "cdi", Checkpoint(tmp_path / "checkpoint.json"), layer=layer,
                       ledgers=Ledgers(layer.ledgers))
    driver = GpuDriver(inventory, NODE, store, _Claims(claims, listed=len(claims)))
    refs = [ClaimRef("default", claim.metadata.uid or "", name) for name, claim in claims.items()]
    return driver, layer, refs


async def test_a_prepared_claim_has_a_ledger_that_goes_when_it_is_unprepared(tmp_path: Path) -> None:
    driver, layer, (first, second) = _layered_driver(tmp_path)
    assert isinstance((await driver.prepare([first, second]))[first.uid], list)
    directory = layer.ledgers / layer_allocation(first.uid, "gpu")
    assert [entry.name for entry in directory.iterdir()] == ["ledger.sock"], "the daemon's socket and nothing else"
    process = await asyncio.to_thread(Process, directory)
    assert process.terms == [(12 * 2**30, 0)]
    assert await asyncio.to_thread(process.reserve, 12 * 2**30)
    assert not await asyncio.to_thread(process.reserve, 1)
    assert sorted((row.use.budget, row.use.used) for row in driver.slice_uses()) == [(12 * 2**30, 0),
                                                                                     (12 * 2**30, 12 * 2**30)]
    assert (await driver.unprepare([first]))[first.uid] == ""
    assert not directory.exists()
    assert await asyncio.to_thread(process.sock.recv, 16) == b"", "its processes are disconnected"
    assert (layer.ledgers / layer_allocation(second.uid, "gpu") / "ledger.sock").exists()
    driver.store.ledgers.close_all()  # type: ignore[union-attr]


async def test_a_restarted_driver_serves_its_claims_ledgers_and_forgets_the_others(tmp_path: Path) -> None:
    driver, layer, (first, _) = _layered_driver(tmp_path)
    assert isinstance((await driver.prepare([first]))[first.uid], list)
    assert driver.store.ledgers is not None
    driver.store.ledgers.close_all()  # the driver stops
    stray = layer.ledgers / "dra-00000000-0000-0000-0000-000000000000-gpu"
    stray.mkdir()
    again, _, _ = _layered_driver(tmp_path)
    again.store.checkpoint.load()
    await again.store.restore()
    directory = layer.ledgers / layer_allocation(first.uid, "gpu")
    process = await asyncio.to_thread(Process, directory)
    process.declare(5 * 2**30)
    assert await asyncio.to_thread(process.reserve, 7 * 2**30)
    assert not await asyncio.to_thread(process.reserve, 1)
    assert not stray.exists()
    assert again.store.ledgers is not None
    again.store.ledgers.close_all()
