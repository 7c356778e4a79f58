"""The claims' status entries (dra.claimstatus) through the real client (node.kube, lightkube) against the API
stand-in, which applies them as the API server does and checks every object it stores against the API's schemas."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gpuppetti.core.model import Serves
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.dra.checkpoint import Checkpoint
from gpuppetti.dra.claimstatus import ClaimStatus
from gpuppetti.dra.driver import GpuDriver
from gpuppetti.dra.plan import DeviceStatus
from gpuppetti.dra.store import ClaimStore
from gpuppetti.kit.draplugin import ClaimRef
from gpuppetti.node.inventory import Inventory
from gpuppetti.node.kube import Kube, load_config
from tests.dra_support import DRIVER, NODE, validate
from tests.helpers import config_from
from tests.standins.apiserver import ApiStandIn

OTHER = "nic.example.com"
CONSUMABLE = """\
version: v1
backend: simulated
simulated:
  gpus:
    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: 2}
dra: {slicing: consumable, shares: 4}
"""
SHARE_ID = "5a6b7c8d-0000-4000-8000-00000000000a"


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[ApiStandIn, Kube]]:
    standin = ApiStandIn(validate=validate)
    await standin.start()
    (tmp_path / "kubeconfig").write_text(standin.kubeconfig())
    kube = Kube(load_config(tmp_path / "kubeconfig"), timeout=2)
    yield standin, kube
    await kube.close()
    await standin.stop()
    assert standin.rejected == [], f"objects failed schema validation: {standin.rejected}"


async def _claim(api: ApiStandIn, name: str) -> ClaimRef:
    """A claim allocated a consumable share of gpu-apple-1 and, beside it, another driver's device."""
    created = await api.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}},
                                          {"name": "nic", "exactly": {"deviceClassName": OTHER}}]}}}, "default")
    created["status"] = {"allocation": {"devices": {"results": [
        {"driver": DRIVER, "pool": NODE, "request": "gpu", "device": "gpu-apple-1", "shareID": SHARE_ID,
         "consumedCapacity": {"cores": "10", "memory": "12Gi"}},
        {"driver": OTHER, "pool": NODE, "request": "nic", "device": "nic-0"}]}},
        "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": "0b6c1a9e-pod"}]}
    claim = await api.update("resourceclaims", created, "default", status=True)
    return ClaimRef("default", claim["metadata"]["uid"], name)


def _devices(api: ApiStandIn, name: str) -> dict[str, dict[str, Any]]:
    claim = api.get("resourceclaims", name, "default")
    assert claim is not None
    return {entry["driver"]: entry for entry in (claim.get("status") or {}).get("devices", [])}


async def _until(predicate: Any, timeout: float = 5) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _writing(status: ClaimStatus) -> AsyncIterator[None]:
    task = asyncio.create_task(status.keep(), name="claim-status")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_prepared_claim_says_what_it_got_and_unprepare_takes_only_its_own_entries_away(
        api: tuple[ApiStandIn, Kube], tmp_path: Path) -> None:
    standin, kube = api
    claim = await _claim(standin, "shared")
    # The other driver's entry, applied by its own manager: this driver must never touch it.
    await kube.apply_claim_status("default", "shared", claim.uid, OTHER, [
        {"driver": OTHER, "pool": NODE, "device": "nic-0", "data": {"mac": "02:00:00:00:00:01"}}])
    config = config_from(CONSUMABLE)
    inventory = Inventory(config, SimulatedBackend(config.simulated).discover(), Serves.POOL)
    status = ClaimStatus(kube, DRIVER)
    driver = GpuDriver(inventory, NODE, ClaimStore(tmp_path / "cdi", Checkpoint(tmp_path / "checkpoint.json")),
                       kube, status)
    async with _writing(status):
        assert isinstance((await driver.prepare([claim]))[claim.uid], list)
        await _until(lambda: DRIVER in _devices(standin, "shared"))
        entries = _devices(standin, "shared")
        ours = entries[DRIVER]
        assert (ours["pool"], ours["device"], ours["shareID"]) == (NODE, "gpu-apple-1", SHARE_ID)
        [ready] = ours["conditions"]
        assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
        assert ready["lastTransitionTime"].endswith("Z")
        assert ours["data"] == {"request": "gpu", "gpu": "sim-apple-1", "model": "Apple M3 Max", "memory": "12Gi",
                                "cores": "10", "computeShare": "25%", "enforcedBy": "none"}
        assert "12Gi and 25% of GPU sim-apple-1" in ready["message"]
        assert entries[OTHER]["data"] == {"mac": "02:00:00:00:00:01"}

        assert (await driver.unprepare([claim]))[claim.uid] == ""
        await _until(lambda: DRIVER not in _devices(standin, "shared"))
        assert list(_devices(standin, "shared")) == [OTHER], "the other driver's entry stays"
        await _until(lambda: status.pending == 0)


async def test_writes_wait_out_an_api_outage_and_a_claim_that_is_gone_is_let_go(
        api: tuple[ApiStandIn, Kube]) -> None:
    standin, kube = api
    claim = await _claim(standin, "later")
    gone = await _claim(standin, "gone")
    await standin.delete("resourceclaims", "gone", "default")
    outage = True
    standin.fault = lambda method, path: "drop" if outage and method == "PATCH" else None
    status = ClaimStatus(kube, DRIVER)
    entry = {"driver": DRIVER, "pool": NODE, "device": "gpu-apple-1", "shareID": SHARE_ID}
    async with _writing(status):
        status.prepared(claim, [DeviceStatus(NODE, "gpu-apple-1", SHARE_ID, {"gpu": "sim-apple-1"})])
        status.prepared(gone, [DeviceStatus(NODE, "gpu-apple-1", SHARE_ID, {"gpu": "sim-apple-1"})])
        await asyncio.sleep(0.5)
        assert _devices(standin, "later") == {}
        assert status.pending == 2, "kept while the API cannot take them"
        outage = False
        await _until(lambda: DRIVER in _devices(standin, "later"), timeout=10)
        assert {k: _devices(standin, "later")[DRIVER][k] for k in entry} == entry
        await _until(lambda: status.pending == 0)


async def test_an_entry_for_a_device_the_claim_does_not_hold_is_refused_and_not_retried(
        api: tuple[ApiStandIn, Kube]) -> None:
    standin, kube = api
    claim = await _claim(standin, "moved")
    status = ClaimStatus(kube, DRIVER)
    async with _writing(status):
        status.prepared(claim, [DeviceStatus(NODE, "gpu-apple-0", None, {"gpu": "sim-apple-0"})])
        await _until(lambda: status.pending == 0)
        patches = [path for method, path in standin.requests if method == "PATCH"]
        await asyncio.sleep(0.3)
        assert [path for method, path in standin.requests if method == "PATCH"] == patches, "no retry"
    assert _devices(standin, "moved") == {}


async def test_a_written_claims_entries_are_not_kept(api: tuple[ApiStandIn, Kube]) -> None:
    # The duty waits for the next wish once a batch is written, perhaps for the driver's life: a thousand-claim
    # Prepare's entries must not wait with it.
    standin, kube = api
    claim = await _claim(standin, "written")
    status = ClaimStatus(kube, DRIVER)
    async with _writing(status):
        status.prepared(claim, [DeviceStatus(NODE, "gpu-apple-1", SHARE_ID, {"gpu": "sim-apple-1"})])
        await _until(lambda: DRIVER in _devices(standin, "written"))
        await _until(lambda: status.pending == 0)
        wish = weakref.ref(claim)
        del claim
        gc.collect()
        assert wish() is None, "the claim's entries are still held after they were written"
