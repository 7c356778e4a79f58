"""plan_claim: everything Prepare will do for a claim, computed from the claim and the snapshot before anything is
written, and every reason it cannot be done named at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpuppetti.core import cdi
from gpuppetti.core.kubeobjects import ResourceClaim
from gpuppetti.core.model import Health
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.dra.plan import PrepareError, layer_allocation, plan_claim
from gpuppetti.kit.draplugin import ClaimRef
from gpuppetti.layer.vulkan import LayerDir
from gpuppetti.node.inventory import Inventory, Snapshot
from tests.dra_support import DRIVER, NODE
from tests.helpers import config_from

UID = "3f2a1b0c-0000-4000-8000-00000000c1a1"
CONFIG = """\
version: v1
backend: simulated
simulated:
  gpus:
    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: 2}
dra: {slicing: partitions, partitions: [4]}
"""


def _inventory(text: str = CONFIG) -> Inventory:
    config = config_from(text)
    return Inventory(config, SimulatedBackend(config.simulated).discover())


def _claim(*results: dict[str, Any], uid: str = UID, config: list[dict[str, Any]] | None = None,
           allocated: bool = True) -> ResourceClaim:
    status: dict[str, Any] = {}
    if allocated:
        status["allocation"] = {"devices": {
            "results": [{"driver": DRIVER, "pool": NODE, "request": "gpu", **r} for r in results],
            "config": config or []}}
    return msgspec.convert({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": []}}, "status": status}, ResourceClaim)


def _plan(claim: ResourceClaim, snapshot: Snapshot, layer: LayerDir | None = None) -> Any:
    return plan_claim(ClaimRef("default", UID, "c"), claim, snapshot, NODE, cdi.DEFAULT_KIND, layer)


def _env(plan: Any) -> dict[str, str]:
    [device] = plan.spec["devices"]
    return dict(line.split("=", 1) for line in device["containerEdits"]["env"])


def test_a_partition_becomes_one_cdi_device_and_a_budget_for_the_layer(tmp_path: Path) -> None:
    snapshot = _inventory().snapshot
    layer = LayerDir(tmp_path / "vulkan")
    plan = _plan(_claim({"device": "gpu-apple-1", "shareID": "p1", "consumedCapacity": {"memory": "12Gi"}}),
                 snapshot, layer)
    [device] = plan.devices
    assert (device.pool, device.device, device.request_names, device.share_id) == (NODE, "gpu-apple-1", ["gpu"], "p1")
    assert device.cdi_device_ids == [cdi.qualified_name(cdi.DEFAULT_KIND, f"claim-{UID}-gpu")]
    assert plan.filename == cdi.spec_filename(cdi.DEFAULT_KIND, UID)
    env = _env(plan)
    assert env["GPUPPETTI_VISIBLE_DEVICES"] == "sim-apple-1"
    assert env["GPUPPETTI_SHARING"] == "partition"
    assert env["GPUPPETTI_MEMORY"] == str(12 * 2**30)
    assert env["GPUPPETTI_CLAIM"] == UID
    # The plan is data: the layer's directory and its budget are in it, and nothing is written yet.
    assert plan.allocations == {layer_allocation(UID, "gpu"): [12 * 2**30]}
    assert not layer.path.exists()


def test_without_a_layer_the_plan_holds_no_budget() -> None:
    plan = _plan(_claim({"device": "gpu-apple-0", "shareID": "p1", "consumedCapacity": {"memory": "12Gi"}}),
                 _inventory().snapshot)
    assert plan.allocations == {}
    assert "GPUPPETTI_VK_SLICES" not in _env(plan)


def test_every_device_that_cannot_be_prepared_is_named_at_once() -> None:
    inventory = _inventory()
    inventory.set_health("sim-apple-1", Health.UNHEALTHY, "XID 79")
    claim = _claim({"device": "gpu-apple-9"}, {"device": "gpu-apple-1", "shareID": "p1",
                                                "consumedCapacity": {"memory": "12Gi"}},
                   {"device": "gpu-apple-0", "pool": "other-node"})
    with pytest.raises(PrepareError) as failed:
        _plan(claim, inventory.snapshot)
    message = str(failed.value)
    assert "device gpu-apple-9 is not published by this node" in message
    assert "device gpu-apple-1 (sim-apple-1) is Unhealthy" in message
    assert "device gpu-apple-0 is in pool 'other-node', not this node's 'node1'" in message


@pytest.mark.parametrize(("claim", "says"), [
    (_claim({"device": "gpu-apple-0"}, uid="00000000-0000-4000-8000-000000000000"), "was replaced: its uid is"),
    (_claim(allocated=False), "is not allocated"),
])
def test_a_claim_that_is_not_the_one_asked_for_or_not_allocated_is_refused(claim: ResourceClaim, says: str) -> None:
    with pytest.raises(PrepareError, match=says):
        _plan(claim, _inventory().snapshot)


def test_a_config_the_driver_cannot_read_fails_the_plan() -> None:
    bad = [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.gpuppetti.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "Sometimes"}}}}]
    with pytest.raises(PrepareError, match=r"config\[0\] \(FromClaim\): invalid GpuConfig: sharing.strategy"):
        _plan(_claim({"device": "gpu-apple-0", "shareID": "p1", "consumedCapacity": {"memory": "12Gi"}},
                     config=bad), _inventory().snapshot)
