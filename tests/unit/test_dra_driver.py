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

from gpuppetti.base.backoff import Backoff
from gpuppetti.core.kubeobjects import ResourceClaim
from gpuppetti.core.model import Serves
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.dra.checkpoint import Checkpoint
from gpuppetti.dra.driver import LIST_FROM, GpuDriver, _collector_paused
from gpuppetti.dra.plan import layer_allocation
from gpuppetti.dra.store import ClaimStore, _run_to_the_end
from gpuppetti.kit.draplugin import ClaimRef
from gpuppetti.layer.vulkan import LayerDir
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
    layer.allocations.mkdir(parents=True)
    store = ClaimStore(tmp_path / "cdi", Checkpoint(tmp_path / "checkpoint.json"), layer=layer)
    driver = GpuDriver(inventory, NODE, store, _Claims(claims, listed=len(claims)))
    refs = [ClaimRef("default", claim.metadata.uid or "", name) for name, claim in claims.items()]
    return driver, layer, refs


async def test_a_claim_whose_layer_directory_holds_many_files_goes_while_another_is_prepared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, layer, (first, second) = _layered_driver(tmp_path)
    assert isinstance((await driver.prepare([first]))[first.uid], list)
    directory = layer.allocations / layer_allocation(first.uid, "gpu")
    for n in range(2000):
        (directory / f"left-by-the-tenant-{n}").write_bytes(b"")
    order: list[str] = []
    removing, release, removed = threading.Event(), threading.Event(), threading.Event()
    remove = LayerDir.remove

    def held_remove(self: LayerDir, allocation: str) -> None:
        # The tenant's files take as long to remove as the other claim's Prepare takes to be answered.
        removing.set()
        release.wait(10)
        remove(self, allocation)
        order.append("removed")
        removed.set()

    monkeypatch.setattr(LayerDir, "remove", held_remove)
    async with asyncio.TaskGroup() as group:
        emptier = group.create_task(driver.store.empty_trash())
        assert (await driver.unprepare([first]))[first.uid] == ""
        assert not directory.exists(), "gone from the layer's directory when the kubelet is told"
        await asyncio.to_thread(removing.wait, 10)
        assert isinstance((await driver.prepare([second]))[second.uid], list)
        order.append("prepared")
        release.set()
        await asyncio.to_thread(removed.wait, 10)
        emptier.cancel()
    assert driver.store.trash is not None and not any(driver.store.trash.allocations.iterdir()), "the trash is emptied"
    assert order == ["prepared", "removed"], "the other claim's Prepare waited for the tenant's files"
    assert (layer.allocations / layer_allocation(second.uid, "gpu")).is_dir()


async def test_the_trash_is_emptied_at_start_and_what_cannot_be_removed_is_tried_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    driver, _, _ = _layered_driver(tmp_path)
    assert driver.store.trash is not None
    left = driver.store.trash.allocations / "dra-x.0000"
    left.mkdir(parents=True)
    (left / "file").write_bytes(b"")
    attempts: list[str] = []
    remove = LayerDir.remove

    def failing_once(self: LayerDir, allocation: str) -> None:
        attempts.append(allocation)
        if len(attempts) > 1:
            remove(self, allocation)

    monkeypatch.setattr(LayerDir, "remove", failing_once)
    monkeypatch.setattr("gpuppetti.dra.store.Backoff", lambda initial, maximum: Backoff(0.01, 0.01))
    async with asyncio.TaskGroup() as group:
        emptier = group.create_task(driver.store.empty_trash())
        while left.exists():
            await asyncio.sleep(0.01)
        emptier.cancel()
    assert attempts == ["dra-x.0000", "dra-x.0000"]
    assert "cannot remove 1 directory(ies)" in caplog.text
