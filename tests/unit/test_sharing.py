from __future__ import annotations

import pytest

from gpuppetti.core.config import ConfigError
from gpuppetti.core.model import Gpu
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.sharing.policy import preferred_allocation
from gpuppetti.sharing.replicas import ResourcePlan, build_plan
from tests.helpers import TWO_M3_MAX, config_from


def _gpus(text: str) -> tuple[list[Gpu], dict[str, ResourcePlan]]:
    config = config_from(text)
    gpus = SimulatedBackend(config.simulated).discover()
    return gpus, build_plan(gpus, config.sharing.time_slicing, config.source)


def test_replicas_are_named_gpu_double_colon_n() -> None:
    _, plan = _gpus(TWO_M3_MAX)
    units = plan["apple.com/gpu"].units
    assert [u.id for u in units] == [f"sim-apple-{g}::{n}" for g in range(2) for n in range(4)]
    assert all(u.replicas == 4 and u.shared for u in units)


def test_without_sharing_each_gpu_is_one_unit_under_its_vendor_name() -> None:
    _, plan = _gpus("""\
        version: v1
        simulated:
          gpus:
            - {model: A, vendor: nvidia}
            - {model: B, vendor: amd}
            - {model: C, vendor: intel}
            - {model: D, vendor: apple}
            - {model: E, vendor: virtio}
        """)
    assert {name: [u.id for u in p.units] for name, p in plan.items()} == {
        "nvidia.com/gpu": ["sim-nvidia-0"],
        "amd.com/gpu": ["sim-amd-0"],
        "gpu.intel.com/i915": ["sim-intel-0"],
        "apple.com/gpu": ["sim-apple-0"],
        "gpuppetti.dev/gpu": ["sim-virtio-0"],
    }
    assert not any(u.shared for p in plan.values() for u in p.units)


def test_rename_by_default_applies_to_shared_resources_only() -> None:
    _, plan = _gpus("""\
        version: v1
        simulated:
          gpus:
            - {model: M, vendor: apple, count: 2}
            - {model: X, vendor: amd}
        sharing:
          timeSlicing:
            renameByDefault: true
            resources:
              - {name: apple.com/gpu, replicas: 4}
        """)
    assert set(plan) == {"apple.com/gpu.shared", "amd.com/gpu"}


def test_per_gpu_replica_counts() -> None:
    _, plan = _gpus("""\
        version: v1
        simulated:
          gpus:
            - {model: M, vendor: apple, count: 3}
        sharing:
          timeSlicing:
            resources:
              - {name: apple.com/gpu, replicas: 2, devices: [0]}
              - {name: apple.com/gpu, replicas: 3, devices: ["2"]}
        """)
    counts: dict[str, int] = {}
    for unit in plan["apple.com/gpu"].units:
        counts[unit.gpu_id] = counts.get(unit.gpu_id, 0) + 1
    assert counts == {"sim-apple-0": 2, "sim-apple-1": 1, "sim-apple-2": 3}


def test_devices_with_a_catch_all_entry() -> None:
    _, plan = _gpus("""\
        version: v1
        simulated:
          gpus:
            - {model: M, vendor: apple, count: 2}
        sharing:
          timeSlicing:
            resources:
              - {name: apple.com/gpu, replicas: 8, devices: [sim-apple-1], rename: apple.com/gpu-big}
              - {name: apple.com/gpu, replicas: 2}
        """)
    assert len(plan["apple.com/gpu-big"].units) == 8
    assert [u.id for u in plan["apple.com/gpu"].units] == ["sim-apple-0::0", "sim-apple-0::1"]


def test_devices_naming_no_gpu_is_an_error_with_its_key_path() -> None:
    with pytest.raises(ConfigError) as caught:
        _gpus(TWO_M3_MAX.replace("replicas: 4", "replicas: 4\n        devices: [0, 7]"))
    assert str(caught.value) == (
        "test.yaml: sharing.timeSlicing.resources[0].devices[1]: no apple.com/gpu GPU has index or id 7"
    )


def test_a_gpu_claimed_twice_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"GPU 0 \(sim-apple-0\) is claimed by more than one entry"):
        _gpus(TWO_M3_MAX.replace(
            "        replicas: 4",
            "        replicas: 4\n        devices: [0]\n"
            "      - {name: apple.com/gpu, replicas: 2, devices: [sim-apple-0]}",
        ))


def _plan() -> ResourcePlan:
    return _gpus(TWO_M3_MAX)[1]["apple.com/gpu"]


ALL = [f"sim-apple-{g}::{n}" for g in range(2) for n in range(4)]


def test_distributed_spreads_over_gpus() -> None:
    assert preferred_allocation(_plan(), ALL, [], 2, "distributed") == ["sim-apple-0::0", "sim-apple-1::0"]


def test_distributed_prefers_the_least_used_gpu() -> None:
    available = [u for u in ALL if u not in ("sim-apple-0::0", "sim-apple-0::1")]
    assert preferred_allocation(_plan(), available, [], 2, "distributed") == ["sim-apple-1::0", "sim-apple-1::1"]


def test_packed_fills_the_most_used_gpu_first() -> None:
    available = [u for u in ALL if u != "sim-apple-1::0"]
    assert preferred_allocation(_plan(), available, [], 3, "packed") == [
        "sim-apple-1::1", "sim-apple-1::2", "sim-apple-1::3"
    ]
    assert preferred_allocation(_plan(), ALL, [], 5, "packed") == ALL[:5]


def test_must_include_is_kept_and_counts_as_use() -> None:
    chosen = preferred_allocation(_plan(), ALL, ["sim-apple-1::2"], 2, "packed")
    assert chosen == ["sim-apple-1::2", "sim-apple-1::0"]
    chosen = preferred_allocation(_plan(), ALL, ["sim-apple-1::2"], 2, "distributed")
    assert chosen == ["sim-apple-1::2", "sim-apple-0::0"]


def test_allocation_size_is_honoured_and_bounded_by_what_is_available() -> None:
    assert len(preferred_allocation(_plan(), ALL, [], 3, "distributed")) == 3
    assert preferred_allocation(_plan(), ALL[:2], [], 5, "distributed") == ALL[:2]
    assert preferred_allocation(_plan(), ALL, ALL[:3], 2, "distributed") == ALL[:2]


def test_unknown_ids_are_ignored() -> None:
    assert preferred_allocation(_plan(), ["bogus", "sim-apple-0::3"], ["ghost"], 2, "distributed") == [
        "sim-apple-0::3"
    ]
