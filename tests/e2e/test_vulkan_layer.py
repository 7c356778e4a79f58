"""The Vulkan layer, through real containers on Mesa's lavapipe: what a slice's container sees and obtains.

Each test runs podman with exactly the mounts and env the daemons hand to a container (LayerDir.edits), its
allocation's ledger served by the test as a daemon serves it, in the sandbox's image built from this host's Vulkan
loader and lavapipe, and reads what gpuppetti-vkinfo reports inside.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import struct
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuppetti.core.model import ContainerEdits, Gpu, Mount, Vendor
from gpuppetti.kubelet.sandbox import VULKAN_IMAGE, PodmanSandbox, podman_flags, vulkan_icd
from gpuppetti.layer.ledger import SLICE_OFFSET, Ledger
from gpuppetti.layer.ledgers import Ledgers
from gpuppetti.layer.vulkan import BUILT, LIBRARY, PROBE, LayerDir, manifest, terms
from gpuppetti.sharing.budgets import Budget

pytestmark = pytest.mark.e2e

MIB = 2**20
SLICE = 512 * MIB
SIMULATED = Gpu(id="sim-apple-0", index=0, vendor=Vendor.APPLE, model="Apple M3 Max", backend="simulated",
                memory_bytes=2048 * MIB, simulated=True)


def why_not_here() -> str | None:
    if not (BUILT / LIBRARY).exists() or not (BUILT / PROBE).exists():
        return "the Vulkan layer is not built here (make native: needs a C compiler and libvulkan-dev)"
    if os.geteuid() != 0:
        return "podman runs the containers as root here"
    if vulkan_icd() is None:
        return "no Vulkan loader and lavapipe on this host (Debian: libvulkan1 mesa-vulkan-drivers)"
    return None


@pytest.fixture(scope="module")
def sandbox() -> PodmanSandbox:
    reason = why_not_here()
    if reason is not None:
        pytest.skip(f"the layer's container tests cannot run: {reason}")
    box = PodmanSandbox()
    assert box.image == VULKAN_IMAGE
    problem = asyncio.run(box.why_not())
    if problem is not None:
        pytest.skip(f"podman cannot run containers here: {problem}")
    asyncio.run(box.ensure_image())
    return box


@dataclass
class Served:
    """An installed layer directory whose allocations' ledgers this test serves, in its own event loop, as a
    daemon does."""

    layer: LayerDir
    ledgers: Ledgers

    async def allocation(self, budgets: Sequence[int], compute: int = 1000) -> tuple[ContainerEdits, Ledger]:
        name = f"t-{secrets.token_hex(4)}"
        given = [Budget(SIMULATED, budget, compute) for budget in budgets]
        ledger = await self.ledgers.open(name, terms(given))
        return self.layer.edits(name, given), ledger


@pytest.fixture
async def layer(tmp_path: Path) -> AsyncIterator[Served]:
    installed = LayerDir(tmp_path / "vulkan")
    installed.install()
    served = Served(installed, Ledgers(installed.ledgers))
    yield served
    served.ledgers.close_all()


async def allocation(layer: Served, budgets: Sequence[int]) -> ContainerEdits:
    edits, _ = await layer.allocation(budgets)
    return edits


async def vkinfo(sandbox: PodmanSandbox, edits: ContainerEdits, script: str) -> list[dict[str, Any]]:
    """Run ``script`` (which calls gpuppetti-vkinfo --json) in a container; each JSON report it printed."""
    code, out, err = await sandbox.shell(f"gpuppetti-test-{secrets.token_hex(4)}", podman_flags(edits), script)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def heap(report: dict[str, Any]) -> dict[str, Any]:
    [device] = report["devices"]
    first: dict[str, Any] = device["heaps"][0]
    return first


async def test_a_slice_is_its_containers_gpu(sandbox: PodmanSandbox, layer: Served) -> None:
    [report] = await vkinfo(sandbox, await allocation(layer, [SLICE]), "gpuppetti-vkinfo --json --allocate 16")
    assert report["layer"] is True
    [device] = report["devices"]
    assert device["memory_budget"] is True, "the layer adds VK_EXT_memory_budget, which lavapipe lacks"
    assert device["max_allocation"] <= SLICE
    assert heap(report)["size"] == SLICE
    assert heap(report)["budget"] == SLICE
    obtained = report["allocation"]["obtained"]
    assert SLICE - 16 * MIB <= obtained <= SLICE
    assert report["allocation"]["refused_with"] == "VK_ERROR_OUT_OF_DEVICE_MEMORY"
    assert report["allocation"]["heap_usage_after"] == obtained


async def test_two_slices_give_twice_the_memory(sandbox: PodmanSandbox, layer: Served) -> None:
    [report] = await vkinfo(sandbox, await allocation(layer, [2 * SLICE]), "gpuppetti-vkinfo --json --allocate 64")
    assert heap(report)["size"] == 2 * SLICE
    assert report["allocation"]["obtained"] == 2 * SLICE


async def test_many_threads_never_pass_the_budget(sandbox: PodmanSandbox, layer: Served) -> None:
    [report] = await vkinfo(sandbox, await allocation(layer, [SLICE]),
                            "gpuppetti-vkinfo --json --allocate 1 --threads 32")
    assert report["allocation"]["threads"] == 32
    assert report["allocation"]["obtained"] == SLICE, "1 MiB chunks fill the slice exactly, and never more"


async def test_the_processes_of_a_container_share_its_budget(sandbox: PodmanSandbox, layer: Served) -> None:
    script = ("gpuppetti-vkinfo --json --allocate 64 --limit 192 --hold 5 > /tmp/first & sleep 2; "
              "gpuppetti-vkinfo --json --allocate 64; wait; cat /tmp/first")
    second, first = await vkinfo(sandbox, await allocation(layer, [SLICE]), script)
    assert first["allocation"]["obtained"] == 192 * MIB
    assert second["allocation"]["obtained"] == SLICE - 192 * MIB
    assert heap(second)["usage"] == 192 * MIB, "the budget extension reports the container's use"


async def test_a_killed_process_gives_its_memory_back(sandbox: PodmanSandbox, layer: Served) -> None:
    script = ("gpuppetti-vkinfo --json --allocate 64 --hold 60 > /dev/null & holder=$!; sleep 2; kill -9 $holder; "
              "wait $holder; gpuppetti-vkinfo --json --allocate 64")
    [after] = await vkinfo(sandbox, await allocation(layer, [SLICE]), script)
    assert after["allocation"]["obtained"] == SLICE


async def test_a_killed_processs_memory_leaves_the_figures_while_its_container_runs(sandbox: PodmanSandbox,
                                                                                    layer: Served,
                                                                                    tmp_path: Path) -> None:
    """A process of the container killed with 96 MiB held is gone from the ledger at once (its connection closes),
    though no process of the slice starts after it."""
    edits, ledger = await layer.allocation([SLICE])
    # The test's own signals, in a directory of its own: the container has nothing writable from the layer.
    signals = tmp_path / "signals"
    signals.mkdir()
    edits.add_mount(Mount("/signals", str(signals), read_only=False))
    script = ("gpuppetti-vkinfo --allocate 32 --limit 96 --hold 600 > /dev/null & holder=$!; "
              "until [ -e /signals/go ]; do sleep 0.1; done; kill -9 $holder; wait $holder; "
              "touch /signals/killed; until [ -e /signals/done ]; do sleep 0.1; done")
    container = asyncio.create_task(sandbox.shell(f"gpuppetti-test-{secrets.token_hex(4)}", podman_flags(edits),
                                                  script))
    try:
        deadline = time.monotonic() + 60
        while ledger.usage()[0].used < 96 * MIB and time.monotonic() < deadline and not container.done():
            await asyncio.sleep(0.1)
        assert ledger.usage()[0].used == 96 * MIB
        (signals / "go").touch()
        while not (signals / "killed").exists() and time.monotonic() < deadline and not container.done():
            await asyncio.sleep(0.1)
        assert (signals / "killed").exists()
        assert ledger.usage()[0].used == 0
    finally:
        (signals / "done").touch()
        code, _, err = await container
    assert code == 0, err


async def test_two_containers_of_one_claim_share_its_budget(sandbox: PodmanSandbox, layer: Served) -> None:
    edits = await allocation(layer, [SLICE])
    holder = asyncio.create_task(vkinfo(sandbox, edits, "gpuppetti-vkinfo --json --allocate 64 --limit 320 --hold 8"))
    await asyncio.sleep(4)
    [second] = await vkinfo(sandbox, edits, "gpuppetti-vkinfo --json --allocate 64")
    [first] = await holder
    assert first["allocation"]["obtained"] == 320 * MIB
    assert second["allocation"]["obtained"] == SLICE - 320 * MIB


async def test_a_whole_gpu_is_not_limited(sandbox: PodmanSandbox, layer: Served) -> None:
    [report] = await vkinfo(sandbox, await allocation(layer, [0]), "gpuppetti-vkinfo --json --allocate 64 --limit 1024")
    assert heap(report)["size"] == SIMULATED.memory_bytes, "lavapipe's own 2 GiB heap"
    assert report["allocation"]["obtained"] == 1024 * MIB


@pytest.mark.parametrize(("env", "loaded"), [
    ({"GPUPPETTI_VK_SLICES": None}, True),
    ({"GPUPPETTI_VK_SLICES": "any=lots"}, True),
    ({"GPUPPETTI_VK_DISABLE": "1"}, False),
], ids=["env-absent", "env-malformed", "disabled"])
async def test_without_its_env_the_layer_changes_nothing(
    sandbox: PodmanSandbox, layer: Served, env: dict[str, str | None], loaded: bool
) -> None:
    edits = await allocation(layer, [SLICE])
    for key, value in env.items():
        if value is None:
            edits.env.pop(key)
        else:
            edits.env[key] = value
    [report] = await vkinfo(sandbox, edits, "gpuppetti-vkinfo --json --allocate 64 --limit 768")
    assert report["layer"] is loaded
    assert heap(report)["size"] == SIMULATED.memory_bytes
    assert report["allocation"]["obtained"] == 768 * MIB, "the application runs as without the layer"


def test_the_manifest_is_what_the_loader_reads(tmp_path: Path) -> None:
    written = LayerDir(tmp_path / "vulkan")
    if not (BUILT / LIBRARY).exists():
        pytest.skip("the Vulkan layer is not built here (make native: needs a C compiler and libvulkan-dev)")
    written.install()
    document = json.loads((tmp_path / "vulkan" / "VkLayer_gpuppetti.json").read_text())
    assert document == manifest()
    layer = document["layer"]
    for key in ("name", "type", "library_path", "api_version", "implementation_version", "description"):
        assert isinstance(layer[key], str) and layer[key], key
    assert layer["functions"] == {"vkNegotiateLoaderLayerInterfaceVersion": "vkNegotiateLoaderLayerInterfaceVersion"}
    # An implicit layer must name how to turn it off.
    assert layer["disable_environment"] == {"GPUPPETTI_VK_DISABLE": "1"}


async def gpu_time(sandbox: PodmanSandbox, layer: Served, compute: int, in_flight: int) -> float:
    """The part of the wall time the container's batches kept the GPU busy (from timestamps around each)."""
    edits, _ = await layer.allocation([SLICE], compute)
    assert edits.env.get("GPUPPETTI_VK_COMPUTE") == (str(compute) if compute < 1000 else None)
    [report] = await vkinfo(sandbox, edits, f"gpuppetti-vkinfo --busy 2 --fill 32 --in-flight {in_flight}")
    busy = report["busy"]
    assert busy["batches"] >= 10, "too little work to judge a share by"
    share: float = busy["gpu_seconds"] / busy["seconds"]
    return share


# 100 batches in flight pass the 64 the layer times: the rest are charged as long as the timed ones took.
@pytest.mark.timed
@pytest.mark.parametrize("in_flight", [1, 3, 100])
async def test_a_compute_share_holds_the_container_to_its_part_of_the_gpus_time(
        sandbox: PodmanSandbox, layer: Served, in_flight: int) -> None:
    # Batches of buffer fills on lavapipe, with the share and without it, one after the other in this run: a
    # quarter share keeps the GPU busy about a quarter of the time, however many batches the workload keeps queued.
    # (How close it comes is a figure of make bench; here, that it holds at all.)
    free = await gpu_time(sandbox, layer, 1000, in_flight)
    quarter = await gpu_time(sandbox, layer, 250, in_flight)
    assert free >= 0.6, "unthrottled, the workload keeps the GPU busy"
    assert 0.1 <= quarter <= 0.4, (free, quarter)


@pytest.mark.timed
async def test_a_compute_share_that_does_not_parse_throttles_nothing(sandbox: PodmanSandbox,
                                                                     layer: Served) -> None:
    edits = await allocation(layer, [SLICE])
    free = await vkinfo(sandbox, edits, "gpuppetti-vkinfo --busy 2 --fill 32")
    edits.env["GPUPPETTI_VK_COMPUTE"] = "250,250"  # two shares for one slice
    mismatched = await vkinfo(sandbox, edits, "gpuppetti-vkinfo --busy 2 --fill 32")
    assert mismatched[0]["busy"]["batches"] >= 0.7 * free[0]["busy"]["batches"]


@pytest.mark.timed
async def test_a_wait_from_before_a_reboot_is_forgotten(sandbox: PodmanSandbox, layer: Served) -> None:
    edits, ledger = await layer.allocation([SLICE], 500)
    # A next allowed submit written on a clock that has since started again: days away on this one.
    struct.pack_into("<q", ledger.page, SLICE_OFFSET, time.clock_gettime_ns(time.CLOCK_MONOTONIC) + 86400 * 10**9)
    [report] = await vkinfo(sandbox, edits, "gpuppetti-vkinfo --busy 4 --fill 32")
    busy = report["busy"]
    assert busy["seconds"] < 8
    assert busy["gpu_seconds"] >= 0.8, "a time further ahead than any debt is forgotten: the slice works at its share"


@pytest.mark.timed
async def test_a_slices_waiting_is_kept_for_metrics(sandbox: PodmanSandbox, layer: Served) -> None:
    edits, ledger = await layer.allocation([SLICE], 250)
    [report] = await vkinfo(sandbox, edits, "gpuppetti-vkinfo --busy 2 --fill 32")
    [use] = ledger.usage()
    # A quarter share waits about three quarters of the time it runs: what /metrics reports as compute wait.
    assert 0.5 * report["busy"]["seconds"] <= use.waited_seconds <= report["busy"]["seconds"]
    assert use.budget == SLICE and use.used == 0
