"""The arm64 guest, a Mac's own architecture (VENUSNODE_ARCH=arm64): the aarch64 wheel `make dist` builds, unpacked
into an arm64 Debian whose GPU is the same virtio-gpu with Venus, goes through the x86-64 guest's node batch
(guest/node.sh) less its timed workloads: discover finds the virtio GPU, the device plugin and the DRA driver serve
it, the aarch64 layer holds a slice on Venus, and wgpu's aarch64 wheel sees the slice. The same judgements as the
x86-64 guest's (imported from test_guest_node), over this guest's batch.

Where the arm64 tree is not built yet (about 20 minutes once per machine, which make test spends in the background)
these tests are skipped, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.venus.conftest import batch
from tests.venus.test_guest_node import (  # noqa: F401 (collected here, over this module's batch)
    test_a_dra_claims_container_has_the_claims_memory_on_venus,
    test_a_slice_is_the_containers_gpu_on_venus,
    test_discover_finds_the_gpu_with_the_guides_virtio_config,
    test_dra_claims_with_share_ids_are_prepared_under_the_vulkan_layer,
    test_position_0_is_venus_whether_or_not_the_layer_hides_the_other_device,
    test_re_sliced_into_partitions_a_dra_claim_of_a_quarter_gets_a_quarter_on_venus,
    test_the_container_sees_its_render_node_and_the_env_that_selects_venus,
    test_the_dra_driver_publishes_the_virtio_gpu_as_consumable_capacity,
    test_the_plugin_serves_the_virtio_gpu_to_the_kubelet,
    test_two_processes_of_a_container_share_its_slice,
    test_two_slices_give_twice_the_memory_and_the_time,
    test_unprepared_dra_claims_leave_nothing_and_the_driver_stops_cleanly,
    test_wgpu_runs_inside_a_slice_on_venus,
)
from tests.venus.venusnode import ARM64, Batch, Guest

pytestmark = pytest.mark.arm64


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, arm64_guest: Guest) -> Iterator[Batch]:
    """The node's batch in the arm64 guest, without the timed workloads (GPUPPETTI_VENUS_QUICK)."""
    yield batch(tmp_path_factory, arm64_guest, "arm64 node", "node.sh", guest_lavapipe=True, arch=ARM64,
                env={"GPUPPETTI_VENUS_QUICK": "1"})


def test_the_guest_is_arm64_and_runs_the_aarch64_wheel(node: Batch, arm64_guest: Guest) -> None:
    assert node.text("uname").strip() == "aarch64", node.context()
    assert str(arm64_guest.venv).startswith("/opt/gpuppetti-venus-arm64/")
