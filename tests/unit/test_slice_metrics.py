"""Per-slice metrics, in-process: what each allocation's ledger says its container holds and waited, labelled with
who holds it, read at scrape time (the waiting from a page the containers can write: clamped)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import generate_latest

from gpuppetti._proto.deviceplugin.v1beta1.api_pb2 import ContainerAllocateResponse
from gpuppetti.core.model import Gpu, Vendor
from gpuppetti.deviceplugin.enforcement import Enforcer, allocation_id
from gpuppetti.kubelet.emulator import ContainerAllocation, KubeletEmulator
from gpuppetti.layer.ledger import SliceUse
from gpuppetti.layer.ledgers import Ledgers
from gpuppetti.layer.vulkan import LayerDir
from gpuppetti.node.metrics import Metrics, SliceRow
from gpuppetti.node.report import slice_records
from gpuppetti.sharing.budgets import Budget
from tests.helpers import replicas, short_tmpdir
from tests.ledger_client import Process

MIB = 2**20
GPU0 = Gpu(id="gpu-0", index=0, vendor=Vendor.APPLE, model="Apple M3 Max", backend="simulated",
           memory_bytes=2048 * MIB, simulated=True)
GPU1 = Gpu(id="gpu-1", index=1, vendor=Vendor.APPLE, model="Apple M3 Max", backend="simulated",
           memory_bytes=2048 * MIB, simulated=True)


def scrape(metrics: Metrics) -> set[str]:
    return set(generate_latest(metrics.registry).decode().splitlines())


def _enforcer(layer: LayerDir, pod_resources: Path) -> Enforcer:
    layer.install()
    return Enforcer(layer, Ledgers(layer.ledgers), pod_resources, grace=0)


async def test_each_slice_is_reported_with_who_holds_it(tmp_path: Path) -> None:
    base = short_tmpdir()
    socket = base / "pod-resources" / "kubelet.sock"
    async with KubeletEmulator(base / "dp", pod_resources=socket) as kubelet:
        layer = LayerDir(tmp_path / "vulkan")
        enforcer = _enforcer(layer, socket)
        await enforcer.start(set())
        await enforcer.allocate([*replicas("gpu-0", 1), *replicas("gpu-1", 0)],
                                [Budget(GPU0, 512 * MIB, 250), Budget(GPU1, 256 * MIB)])
        allocation = allocation_id(["gpu-0::1", "gpu-1::0"])
        process = await asyncio.to_thread(Process, layer.ledgers / allocation)
        assert await asyncio.to_thread(process.reserve, 100 * MIB, 0)
        assert await asyncio.to_thread(process.reserve, 7 * MIB, 1)
        process.set_waited(1_500_000_000, 0)
        kubelet.allocations.append(ContainerAllocation("trainer", "main", "apple.com/gpu", ["gpu-0::1", "gpu-1::0"],
                                                       ContainerAllocateResponse(), None))
        await enforcer.check()
        metrics = Metrics()
        metrics.watch_slices(enforcer)
        lines = scrape(metrics)
        process.close()
        enforcer.ledgers.close_all()
    first = 'container="main",gpu="gpu-0",namespace="default",pod="trainer",unit="gpu-0::1"'
    second = 'container="main",gpu="gpu-1",namespace="default",pod="trainer",unit="gpu-1::0"'
    assert f"gpuppetti_slice_memory_used_bytes{{{first}}} 1.048576e+08" in lines
    assert f"gpuppetti_slice_memory_budget_bytes{{{first}}} 5.36870912e+08" in lines
    assert f"gpuppetti_slice_compute_wait_seconds_total{{{first}}} 1.5" in lines
    assert f"gpuppetti_slice_memory_used_bytes{{{second}}} 7.340032e+06" in lines
    assert f"gpuppetti_slice_compute_wait_seconds_total{{{second}}} 0.0" in lines


async def test_a_tenants_waiting_figure_is_clamped_and_a_gone_process_leaves_the_figure(tmp_path: Path) -> None:
    layer = LayerDir(tmp_path / "vulkan")
    enforcer = _enforcer(layer, tmp_path / "no-pod-resources.sock")
    await enforcer.allocate(replicas("gpu-0", 0), [Budget(GPU0, 512 * MIB, 500)])
    process = await asyncio.to_thread(Process, layer.ledgers / allocation_id(["gpu-0::0"]))
    assert await asyncio.to_thread(process.reserve, 64 * MIB)
    process.set_waited(-(2**63))
    metrics = Metrics()
    metrics.watch_slices(enforcer)
    lines = await asyncio.to_thread(scrape, metrics)
    labels = 'container="",gpu="gpu-0",namespace="",pod="",unit="gpu-0::0"'
    assert f"gpuppetti_slice_memory_used_bytes{{{labels}}} 6.7108864e+07" in lines
    assert f"gpuppetti_slice_compute_wait_seconds_total{{{labels}}} 0.0" in lines
    process.close()
    for _ in range(100):
        await asyncio.sleep(0.01)
        if f"gpuppetti_slice_memory_used_bytes{{{labels}}} 0.0" in scrape(metrics):
            break
    assert f"gpuppetti_slice_memory_used_bytes{{{labels}}} 0.0" in scrape(metrics)
    enforcer.ledgers.close_all()


async def test_a_slice_is_labelled_with_its_units_of_its_gpu_as_the_plan_says(tmp_path: Path) -> None:
    # A unit's GPU is what the plan says, never read back out of its id: this GPU's id has "::" in it.
    odd = Gpu(id="rack-1::gpu-0", index=0, vendor=Vendor.APPLE, model="Apple M3 Max", backend="simulated",
              memory_bytes=2048 * MIB, simulated=True)
    layer = LayerDir(tmp_path / "vulkan")
    enforcer = _enforcer(layer, tmp_path / "no-pod-resources.sock")
    await enforcer.allocate([*replicas(odd.id, 2), *replicas("gpu-1", 0)],
                            [Budget(odd, 512 * MIB), Budget(GPU1, 256 * MIB)])
    assert [(row.gpu, row.unit) for row in enforcer.slice_uses()] == [(odd.id, "rack-1::gpu-0::2"),
                                                                      ("gpu-1", "gpu-1::0")]
    enforcer.ledgers.close_all()


class _Rows:
    def __init__(self, rows: list[SliceRow]) -> None:
        self.rows = rows

    def slice_uses(self) -> list[SliceRow]:
        return self.rows


def test_one_row_is_one_sample_per_figure_and_one_slices_record() -> None:
    row = SliceRow(namespace="ml", pod="trainer", container="main", gpu="gpu-1", unit="gpu-1::2",
                   use=SliceUse(0, 512 * MIB, 100 * MIB, 1.25))
    metrics = Metrics()
    metrics.watch_slices(_Rows([row]))
    labels = 'container="main",gpu="gpu-1",namespace="ml",pod="trainer",unit="gpu-1::2"'
    assert {f"gpuppetti_slice_memory_used_bytes{{{labels}}} 1.048576e+08",
            f"gpuppetti_slice_memory_budget_bytes{{{labels}}} 5.36870912e+08",
            f"gpuppetti_slice_compute_wait_seconds_total{{{labels}}} 1.25"} <= scrape(metrics)
    assert slice_records(_Rows([row])) == [{"namespace": "ml", "pod": "trainer", "container": "main", "gpu": "gpu-1",
                                            "unit": "gpu-1::2", "budget_bytes": 512 * MIB, "used_bytes": 100 * MIB,
                                            "compute_wait_seconds": 1.25}]
