"""The slice publisher's reconcile, in-process against the API stand-in (every object it writes checked against the
official schemas): what it writes, what it leaves alone, and the pool's generation."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.dra.slices import pool_content
from gpuppetti.kit.publisher import SlicePublisher
from gpuppetti.node.inventory import Inventory, Snapshot
from gpuppetti.node.kube import Kube, load_config
from gpuppetti.node.metrics import Metrics
from tests.dra_support import DRIVER, NODE, validate
from tests.helpers import config_from
from tests.standins.apiserver import ApiStandIn


def gpus(count: int) -> str:
    return ("version: v1\nbackend: simulated\nsimulated:\n  gpus:\n"
            f"    - {{model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: {count}}}\n")


@dataclass
class Bench:
    api: ApiStandIn
    kube: Kube
    inventory: Inventory

    def publisher(self) -> SlicePublisher[Snapshot]:
        """A publisher as a driver's process starts one: nothing written yet as far as it knows."""
        return SlicePublisher(self.kube, self.inventory, pool_content, NODE, DRIVER, Metrics())

    def slices(self) -> dict[str, dict[str, Any]]:
        return {s["metadata"]["name"]: s for s in self.api.list("resourceslices")}

    def versions(self) -> dict[str, str]:
        return {name: s["metadata"]["resourceVersion"] for name, s in self.slices().items()}

    def generations(self) -> set[int]:
        return {s["spec"]["pool"]["generation"] for s in self.slices().values()}


async def _bench(tmp_path: Path, node: bool) -> AsyncIterator[Bench]:
    api = ApiStandIn(validate=validate)
    await api.start()
    if node:
        await api.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    (tmp_path / "kubeconfig").write_text(api.kubeconfig())
    config = config_from(gpus(130))
    kube = Kube(load_config(tmp_path / "kubeconfig"))
    try:
        yield Bench(api, kube, Inventory(config, SimulatedBackend(config.simulated).discover()))
    finally:
        await kube.close()
        await api.stop()
        assert api.rejected == [], f"objects failed schema validation: {api.rejected}"


@pytest.fixture
async def bench(tmp_path: Path) -> AsyncIterator[Bench]:
    async for made in _bench(tmp_path, node=True):
        yield made


@pytest.fixture
async def bench_without_node(tmp_path: Path) -> AsyncIterator[Bench]:
    async for made in _bench(tmp_path, node=False):
        yield made


async def test_a_pool_is_written_once_and_a_second_reconcile_writes_nothing(bench: Bench) -> None:
    publisher = bench.publisher()
    await publisher.reconcile()
    slices = bench.slices()
    # 130 devices, 128 to a slice.
    assert sorted(len(s["spec"]["devices"]) for s in slices.values()) == [2, 128]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices.values()} == {2}
    assert bench.generations() == {1}
    assert all(s["spec"]["driver"] == DRIVER and s["spec"]["nodeName"] == NODE for s in slices.values())
    assert publisher.published.is_set()
    before = bench.versions()
    await publisher.reconcile()
    assert bench.versions() == before, "nothing changed: nothing written"


async def test_a_slice_deleted_by_someone_else_is_written_again_alone(bench: Bench) -> None:
    publisher = bench.publisher()
    await publisher.reconcile()
    before = bench.versions()
    lost = sorted(before)[0]
    await bench.api.delete("resourceslices", lost)
    await publisher.reconcile()
    after = bench.versions()
    assert set(after) == set(before)
    assert after[lost] != before[lost]
    assert {name: v for name, v in after.items() if name != lost} == {
        name: v for name, v in before.items() if name != lost}
    assert bench.generations() == {1}, "the same pool: the same generation"


async def test_a_smaller_pool_deletes_the_surplus_slices_under_a_new_generation(bench: Bench) -> None:
    publisher = bench.publisher()
    await publisher.reconcile()
    config = config_from(gpus(100))
    bench.inventory.replace(config, SimulatedBackend(config.simulated).discover())
    await publisher.reconcile()
    slices = bench.slices()
    assert len(slices) == 1
    assert bench.generations() == {2}
    assert len(next(iter(slices.values()))["spec"]["devices"]) == 100
    assert publisher.generation == 2


async def test_a_new_process_continues_the_generation_the_api_holds(bench: Bench) -> None:
    await bench.publisher().reconcile()
    assert bench.generations() == {1}
    # Started again, it knows nothing it wrote: the pool goes out again, above every generation in the API.
    restarted = bench.publisher()
    await restarted.reconcile()
    assert bench.generations() == {2}
    assert restarted.generation == 2


async def test_without_its_node_the_pool_is_published_without_an_owner(bench_without_node: Bench) -> None:
    await bench_without_node.publisher().reconcile()
    slices = bench_without_node.slices()
    assert len(slices) == 2
    assert all("ownerReferences" not in s["metadata"] for s in slices.values())


async def test_with_its_node_the_node_owns_the_slices(bench: Bench) -> None:
    await bench.publisher().reconcile()
    node_uid = bench.api.get("nodes", NODE)["metadata"]["uid"]  # type: ignore[index]
    for published in bench.slices().values():
        [owner] = published["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", NODE, node_uid)


async def test_the_wait_for_registration_is_logged_once(bench: Bench, caplog: pytest.LogCaptureFixture) -> None:
    registered = asyncio.Event()
    publisher = SlicePublisher(bench.kube, bench.inventory, pool_content, NODE, DRIVER, Metrics(), registered)
    with caplog.at_level(logging.INFO, logger="gpuppetti.kit.publisher"):
        waiting = [asyncio.create_task(publisher.wait_registered()) for _ in range(2)]
        await asyncio.sleep(0.05)
        registered.set()
        await asyncio.gather(*waiting)
    said = [record for record in caplog.records if "waiting for the kubelet to register" in record.message]
    assert len(said) == 1
