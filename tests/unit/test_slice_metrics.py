"""Per-slice metrics, in-process: what the layer's accounting says each container holds and waited, labelled with
who holds it, read at scrape time from files the containers can write (and so treated as hostile)."""

from __future__ import annotations

import asyncio
import os
import struct
import time
from pathlib import Path
from typing import IO

from prometheus_client import generate_latest

from gpuppetti._proto.deviceplugin.v1beta1.api_pb2 import ContainerAllocateResponse
from gpuppetti.core.model import Gpu, Vendor
from gpuppetti.deviceplugin.enforcement import Enforcer, allocation_id
from gpuppetti.kubelet.emulator import ContainerAllocation, KubeletEmulator
from gpuppetti.layer.vulkan import LayerDir, SliceUse
from gpuppetti.node.metrics import Metrics, SliceRow
from gpuppetti.node.report import slice_records
from gpuppetti.sharing.budgets import Budget
from tests.helpers import hold_slice, replicas, short_tmpdir

MIB = 2**20
GPU0 = Gpu(id="gpu-0", index=0, vendor=Vendor.APPLE, model="Apple M3 Max", backend="simulated",
           memory_bytes=2048 * MIB, simulated=True)
GPU1 = Gpu(id="gpu-1", index=1, vendor=Vendor.APPLE, model="Apple M3 Max", backend="simulated",
           memory_bytes=2048 * MIB, simulated=True)


def held(layer: LayerDir, allocation: str, index: int, used: int, waited_ns: int = 0) -> None:
    """A live process of the container holding ``used`` of the slice (its lock held until the test ends)."""
    _live.append(hold_slice(layer.allocations / allocation / f"slice-{index}.acct", used, waited_ns))


_live: list[IO[bytes]] = []


def scrape(metrics: Metrics) -> set[str]:
    return set(generate_latest(metrics.registry).decode().splitlines())


async def test_each_slice_is_reported_with_who_holds_it(tmp_path: Path) -> None:
    base = short_tmpdir()
    socket = base / "pod-resources" / "kubelet.sock"
    async with KubeletEmulator(base / "dp", pod_resources=socket) as kubelet:
        layer = LayerDir(tmp_path / "vulkan")
        layer.install()
        enforcer = Enforcer(layer, socket, grace=0)
        await enforcer.start(set())
        await enforcer.allocate([*replicas("gpu-0", 1), *replicas("gpu-1", 0)],
                                [Budget(GPU0, 512 * MIB, 250), Budget(GPU1, 256 * MIB)])
        allocation = allocation_id(["gpu-0::1", "gpu-1::0"])
        held(layer, allocation, 0, 100 * MIB, 1_500_000_000)
        held(layer, allocation, 1, 7 * MIB)
        kubelet.allocations.append(ContainerAllocation("trainer", "main", "apple.com/gpu", ["gpu-0::1", "gpu-1::0"],
                                                       ContainerAllocateResponse(), None))
        await enforcer.check()
        metrics = Metrics()
        metrics.watch_slices(enforcer)
        lines = scrape(metrics)
    first = 'container="main",gpu="gpu-0",namespace="default",pod="trainer",unit="gpu-0::1"'
    second = 'container="main",gpu="gpu-1",namespace="default",pod="trainer",unit="gpu-1::0"'
    assert f"gpuppetti_slice_memory_used_bytes{{{first}}} 1.048576e+08" in lines
    assert f"gpuppetti_slice_memory_budget_bytes{{{first}}} 5.36870912e+08" in lines
    assert f"gpuppetti_slice_compute_wait_seconds_total{{{first}}} 1.5" in lines
    assert f"gpuppetti_slice_memory_used_bytes{{{second}}} 7.340032e+06" in lines
    assert f"gpuppetti_slice_compute_wait_seconds_total{{{second}}} 0.0" in lines


async def test_a_hostile_accounting_file_never_blocks_or_breaks_a_scrape(tmp_path: Path) -> None:
    layer = LayerDir(tmp_path / "vulkan")
    layer.install()
    enforcer = Enforcer(layer, tmp_path / "no-pod-resources.sock")
    for number in range(4):
        await enforcer.allocate(replicas("gpu-0", number), [Budget(GPU0, 512 * MIB)])
    fifo, link, short, negative = (layer.allocations / allocation_id([f"gpu-0::{n}"]) / "slice-0.acct"
                                   for n in range(4))
    for path in (fifo, link, short):
        path.unlink()
    os.mkfifo(fifo)
    link.symlink_to("/etc/shadow")
    short.write_bytes(b"GPPTVK01")
    data = bytearray(negative.read_bytes())
    data[16:32] = struct.pack("<qq", -5, -(2**63))
    negative.write_bytes(bytes(data))
    metrics = Metrics()
    metrics.watch_slices(enforcer)
    started = time.monotonic()
    lines = await asyncio.wait_for(asyncio.to_thread(scrape, metrics), 5)
    assert time.monotonic() - started < 2
    used = [line for line in lines if line.startswith("gpuppetti_slice_memory_used_bytes{")]
    assert used == ['gpuppetti_slice_memory_used_bytes{container="",gpu="gpu-0",namespace="",pod="",'
                    'unit="gpu-0::3"} 0.0'], "only the file that is one is read, and no number is below 0"


async def test_a_slice_is_labelled_with_its_units_of_its_gpu_as_the_plan_says(tmp_path: Path) -> None:
    # A unit's GPU is what the plan says, never read back out of its id: this GPU's id has "::" in it.
    odd = Gpu(id="rack-1::gpu-0", index=0, vendor=Vendor.APPLE, model="Apple M3 Max", backend="simulated",
              memory_bytes=2048 * MIB, simulated=True)
    layer = LayerDir(tmp_path / "vulkan")
    layer.install()
    enforcer = Enforcer(layer, tmp_path / "no-pod-resources.sock")
    await enforcer.allocate([*replicas(odd.id, 2), *replicas("gpu-1", 0)],
                            [Budget(odd, 512 * MIB), Budget(GPU1, 256 * MIB)])
    assert [(row.gpu, row.unit) for row in enforcer.slice_uses()] == [(odd.id, "rack-1::gpu-0::2"),
                                                                      ("gpu-1", "gpu-1::0")]


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
