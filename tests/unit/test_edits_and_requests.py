from __future__ import annotations

import asyncio

import pytest

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.core.model import ContainerEdits, DeviceNode, Health, Mount
from gpuppetti.deviceplugin.devicelists import DeviceLists
from gpuppetti.deviceplugin.server import RequestError, edits_to_response, resolve_request
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.node.inventory import Inventory, Snapshot
from gpuppetti.sharing.edits import container_edits
from tests.helpers import TWO_M3_MAX, config_from


def _inventory(text: str = TWO_M3_MAX) -> Inventory:
    config = config_from(text)
    return Inventory(config, SimulatedBackend(config.simulated).discover())


def test_env_lists_each_gpu_once_in_request_order() -> None:
    inventory = _inventory()
    plan = inventory.plan["apple.com/gpu"]
    units = [plan.by_id[i] for i in ("sim-apple-1::2", "sim-apple-0::0", "sim-apple-1::3")]
    edits = container_edits(units, inventory.gpus)
    assert edits.env == {
        "GPUPPETTI_VISIBLE_DEVICES": "sim-apple-1,sim-apple-0",
        "GPUPPETTI_SLICES": "sim-apple-1::2,sim-apple-0::0,sim-apple-1::3",
        "GPUPPETTI_SHARING": "time-slicing",
        "GPUPPETTI_REPLICAS": "4,4",
    }
    assert edits.device_nodes == []


def test_device_nodes_render_into_the_allocate_response() -> None:
    inventory = _inventory()
    edits = container_edits([inventory.plan["apple.com/gpu"].units[0]], inventory.gpus)
    edits.add_device_node(DeviceNode("/dev/dri/renderD128"))
    edits.add_device_node(DeviceNode("/dev/dri/renderD128"))
    response = edits_to_response(edits)
    assert [(d.container_path, d.host_path, d.permissions) for d in response.devices] == [
        ("/dev/dri/renderD128", "/dev/dri/renderD128", "rw")
    ]


def test_the_env_and_the_mounts_go_in_whatever_the_strategy() -> None:
    # The device plugin merges the Vulkan layer's edits into its own, as the DRA driver does.
    inventory = _inventory()
    edits = container_edits([inventory.plan["apple.com/gpu"].units[0]], inventory.gpus)
    edits.add_device_node(DeviceNode("/dev/dri/renderD128"))
    edits.merge(ContainerEdits(env={"GPUPPETTI_LIMITS": "vulkan"},
                               mounts=[Mount("/run/gpuppetti/vulkan", "/var/lib/gpuppetti/vulkan/a", False)]))
    for strategies in (("envvar",), ("cdi-cri",), ("cdi-annotations",)):
        response = edits_to_response(edits, strategies, ["gpu.gpuppetti.dev/gpu=sim-apple-0"], "cdi.k8s.io/x")
        assert response.envs["GPUPPETTI_LIMITS"] == "vulkan"
        assert [(m.container_path, m.host_path, m.read_only) for m in response.mounts] == [
            ("/run/gpuppetti/vulkan", "/var/lib/gpuppetti/vulkan/a", False)], strategies
        assert len(response.devices) == (1 if strategies == ("envvar",) else 0), "the CDI spec carries the nodes"


def test_resolve_request_names_every_offending_id() -> None:
    inventory = _inventory()
    with pytest.raises(RequestError, match="unknown device ids 'a', 'b'"):
        resolve_request(inventory.snapshot, "apple.com/gpu", ["a", "sim-apple-0::0", "b"])
    with pytest.raises(RequestError, match="names no device ids"):
        resolve_request(inventory.snapshot, "apple.com/gpu", [])
    with pytest.raises(RequestError, match="no longer advertises"):
        resolve_request(inventory.snapshot, "nvidia.com/gpu", ["x"])


def _listed(snapshot: Snapshot, resource: str = "apple.com/gpu") -> list[pb.Device]:
    return list(pb.ListAndWatchResponse.FromString(DeviceLists().of(snapshot, resource)).devices)


async def test_health_changes_bump_the_version_and_the_list() -> None:
    inventory = _inventory()
    plan = inventory.plan["apple.com/gpu"]
    assert [d.ID for d in _listed(inventory.snapshot)] == [u.id for u in plan.units]
    assert {d.health for d in _listed(inventory.snapshot)} == {"Healthy"}
    waiter = asyncio.create_task(inventory.wait_for_change(inventory.version))
    assert inventory.set_health("sim-apple-1", Health.UNHEALTHY, "test")
    assert await asyncio.wait_for(waiter, 1) == 1
    assert not inventory.set_health("sim-apple-1", Health.UNHEALTHY)
    listed = {d.ID: d.health for d in _listed(inventory.snapshot)}
    assert inventory.snapshot.plan is not None and inventory.plan["apple.com/gpu"] is plan, "health keeps the plan"
    assert listed["sim-apple-0::0"] == "Healthy" and listed["sim-apple-1::0"] == "Unhealthy"
    with pytest.raises(RequestError, match="unhealthy device ids 'sim-apple-1::1'"):
        resolve_request(inventory.snapshot, "apple.com/gpu", ["sim-apple-0::1", "sim-apple-1::1"])


def test_topology_only_when_numa_is_known() -> None:
    without = _inventory(TWO_M3_MAX.replace(", numaNode: 0", ""))
    assert not any(d.HasField("topology") for d in _listed(without.snapshot))
    with_numa = _inventory()
    assert all([n.ID for n in d.topology.nodes] == [0] for d in _listed(with_numa.snapshot))
