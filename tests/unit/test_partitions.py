"""Partitions in both layouts: what the pool holds, what a claim is given, and the warning a costly pool earns."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from gpuppetti.core.model import Gpu, Health, Serves
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.dra.slices import pool_content
from gpuppetti.node.inventory import Inventory
from gpuppetti.sharing.pool import build_pool
from gpuppetti.sharing.remarks import MAX_DEVICES_PER_NODE, config_remarks, pool_remarks
from gpuppetti.sharing.shares import ShareError, claim_share
from tests.helpers import config_from

GIB = 2**30


def _setup(dra: str, gpus: str = "{model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: 2}") -> \
        tuple[list[Gpu], Inventory]:
    config = config_from(f"version: v1\nbackend: simulated\nsimulated:\n  gpus: [{gpus}]\ndra: {dra}\n")
    gpus_found = SimulatedBackend(config.simulated).discover()
    return gpus_found, Inventory(config, gpus_found)


def test_capacity_layout_is_one_shared_device_per_gpu_taken_in_the_partitions_sizes() -> None:
    gpus, inventory = _setup("{slicing: partitions, partitions: [8, 2]}")
    pool = inventory.snapshot.pool
    assert list(pool.devices) == ["gpu-apple-0", "gpu-apple-1"] and not pool.counter_sets
    device = pool.devices["gpu-apple-0"]
    assert device.consumable and device.part_counts == (1, 2, 8)
    [memory] = device.capacity
    assert memory.valid_values == (Fraction(6 * GIB), Fraction(24 * GIB), Fraction(48 * GIB))
    assert memory.default == 6 * GIB
    for count, text in ((1, "48Gi"), (2, "24Gi"), (8, "6Gi")):
        share = claim_share(device, gpus[0], {"memory": text}, "s")
        assert (share.parts, share.size.cores, share.size.memory) == (count, Fraction(40, count), 48 * GIB // count)
    with pytest.raises(ShareError, match=r"12Gi.*not the size of one of its partitions \(1/1, 1/2, 1/8\)"):
        claim_share(device, gpus[0], {"memory": "12Gi"}, "s")
    with pytest.raises(ShareError, match=r"no consumedCapacity\.memory"):
        claim_share(device, gpus[0], {"cores": "10"}, "s")


def test_capacity_layout_slices_are_small_and_counter_free() -> None:
    _, inventory = _setup("{slicing: partitions}", "{model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, "
                          "count: 8}")
    content = pool_content(inventory.snapshot, "node-a")
    assert len(content.specs) == 1
    spec = content.spec(0)
    assert "sharedCounters" not in spec and len(spec["devices"]) == 8
    device = spec["devices"][0]
    assert device["allowMultipleAllocations"] is True
    assert device["attributes"]["partitions"] == {"int": 8}
    assert device["capacity"]["memory"]["requestPolicy"] == {"default": "6Gi",
                                                             "validValues": ["6Gi", "12Gi", "24Gi", "48Gi"]}


def test_a_gpu_of_unknown_memory_falls_back_to_counters_and_says_so() -> None:
    inventory = _setup("{slicing: partitions, partitions: [4]}",
                       "{model: Apple M3 Max, vendor: apple, cores: 40, count: 1}")[1]
    assert set(inventory.snapshot.pool.devices) == {"gpu-apple-0", *(f"gpu-apple-0-p4-{p}" for p in range(4))}
    [remark] = pool_remarks(inventory.snapshot.pool, inventory.config.dra)
    assert remark.warning and remark.path == "dra.partitions" and "memory is unknown" in remark.why


def test_the_counters_layout_and_too_many_devices_are_warned_about() -> None:
    inventory = _setup("{slicing: partitions, partitionLayout: counters}")[1]
    [remark] = pool_remarks(inventory.snapshot.pool, inventory.config.dra)
    assert remark.path == "dra.partitionLayout" and "30 devices on this node" in remark.why
    assert "docs/scale.md" in remark.why
    for dra in ("{slicing: partitions}", "{slicing: whole}", "{slicing: consumable}"):
        inventory = _setup(dra)[1]
        assert pool_remarks(inventory.snapshot.pool, inventory.config.dra) == [], dra
    many = f"{{model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: {MAX_DEVICES_PER_NODE + 1}}}"
    inventory = _setup("{slicing: whole}", many)[1]
    [remark] = pool_remarks(inventory.snapshot.pool, inventory.config.dra)
    assert f"{MAX_DEVICES_PER_NODE + 1} devices on this node" in remark.why
    assert build_pool([], inventory.config.dra).devices == {}


def test_each_front_end_derives_and_remarks_on_only_its_own_half() -> None:
    config = config_from("version: v1\nbackend: simulated\nsimulated:\n  gpus: [{model: Apple M3 Max, vendor: apple, "
                         "cores: 40, memory: 48Gi, count: 2}]\nsharing:\n  timeSlicing:\n    resources: "
                         "[{name: nvidia.com/gpu, replicas: 4}]\n"
                         "dra: {slicing: partitions, partitionLayout: counters}\n")
    gpus = SimulatedBackend(config.simulated).discover()
    driver = Inventory(config, gpus, Serves.POOL)
    assert not driver.snapshot.plan and len(driver.snapshot.pool.devices) == 30
    plugin = Inventory(config, gpus, Serves.UNITS)
    assert set(plugin.snapshot.plan) == {"apple.com/gpu"} and not plugin.snapshot.pool.devices
    plugin.set_health(gpus[0].id, Health.UNHEALTHY)
    driver.set_health(gpus[0].id, Health.UNHEALTHY)
    assert not plugin.snapshot.pool.devices and not driver.snapshot.plan, "a new snapshot derives the same half"
    assert [r.path for r in config_remarks(gpus, config, Serves.UNITS)] == ["sharing.timeSlicing.resources[0].name"]
    assert [r.path for r in config_remarks(gpus, config, Serves.POOL, driver.snapshot.pool)] == \
        ["dra.partitionLayout"]
    assert len(config_remarks(gpus, config)) == 2, "the commands that show both remark on both"


def test_consumed_memory_past_a_64_bit_count_is_the_claims_own_error_and_budgets_never_pass_it() -> None:
    from gpuppetti.base.quantity import MAX_BYTES
    from gpuppetti.sharing.budgets import Enforce, share_budgets

    gpus, inventory = _setup("{slicing: consumable}")
    device = inventory.snapshot.pool.devices["gpu-apple-0"]
    with pytest.raises(ShareError, match=r"consumedCapacity\.memory '8Ei' is 8Ei or more"):
        claim_share(device, gpus[0], {"memory": "8Ei"}, "s")
    # Two shares of one GPU, each within the count, add up past it: the budget is the most it holds.
    shares = [claim_share(device, gpus[0], {"memory": f"{MAX_BYTES}"}, f"s{n}") for n in range(2)]
    [budget] = share_budgets(shares, Enforce(memory=True, compute=False))
    assert budget.memory == MAX_BYTES


@pytest.mark.parametrize(("dra", "memory"), [
    ("{slicing: partitions, partitions: [8, 2]}", "6Gi"),
    ("{slicing: partitions, partitions: [8, 2], defaultPartition: 2}", "24Gi"),
    ("{slicing: partitions, partitions: [8, 2], defaultPartition: 1}", "48Gi"),
])
def test_a_claim_that_names_no_partition_gets_the_default_one_in_the_capacity_layout(dra: str, memory: str) -> None:
    _, inventory = _setup(dra)
    device = pool_content(inventory.snapshot, "node-a").spec(0)["devices"][0]
    assert device["capacity"]["memory"]["requestPolicy"]["default"] == memory
    assert device["attributes"]["byDefault"] == {"bool": True}, "the vendor classes select it"


@pytest.mark.parametrize(("dra", "chosen"), [
    ("{slicing: partitions, partitions: [4, 2], partitionLayout: counters}", lambda name: "-p4-" in name),
    ("{slicing: partitions, partitions: [4, 2], partitionLayout: counters, defaultPartition: 2}",
     lambda name: "-p2-" in name),
    ("{slicing: partitions, partitions: [4, 2], partitionLayout: counters, defaultPartition: 1}",
     lambda name: "-p" not in name),
])
def test_the_counters_layout_marks_only_the_default_partitions_devices(dra: str, chosen: Any) -> None:
    _, inventory = _setup(dra)
    content = pool_content(inventory.snapshot, "node-a")
    devices = {d["name"]: d for n in range(len(content.specs)) for d in content.spec(n).get("devices", [])}
    assert len(devices) == 2 * (1 + 2 + 4)
    for name, device in devices.items():
        assert device["attributes"]["byDefault"] == {"bool": chosen(name)}, name


def test_whole_and_consumable_devices_carry_no_default_mark() -> None:
    for dra in ("{slicing: whole}", "{slicing: consumable}"):
        _, inventory = _setup(dra)
        device = pool_content(inventory.snapshot, "node-a").spec(0)["devices"][0]
        assert "byDefault" not in device["attributes"], dra


@pytest.mark.parametrize("dra", ["{slicing: partitions, partitions: [8, 2], defaultPartition: 4}",
                                 "{slicing: partitions, defaultPartition: 3}"])
def test_a_default_partition_that_is_none_of_them_is_refused(dra: str) -> None:
    with pytest.raises(Exception, match=r"dra.*defaultPartition"):
        _setup(dra)
