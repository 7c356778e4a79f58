"""The device plugin's allocation directories against their tenants: a tree no recursion survives or a file that
will not go never takes the plugin down (its removal is tried again), and after a restart the plugin learns who
holds a directory from its own record or from the kubelet, never from what the tenant wrote."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuppetti.base.fsutil import is_mount_point, mounts_propagate, remove_tree
from gpuppetti.deviceplugin.enforcement import Enforcer, allocation_id
from gpuppetti.kubelet.emulator import ContainerAllocation, KubeletEmulator
from gpuppetti.layer.vulkan import ACCT_FILE_SIZE, TMPFS_MARGIN, TMPFS_SPARE_FILES, LayerDir, install_layer
from gpuppetti.sharing.budgets import Budget
from tests.e2e.test_vulkan_layer import SIMULATED
from tests.helpers import replicas, short_tmpdir
from tests.unit.test_tenant_files import _deep, _unremovable

pytestmark = pytest.mark.e2e

MIB = 2**20
BUDGETS = [Budget(SIMULATED, 512 * MIB)]
APPLE = "apple.com/gpu"


@pytest.fixture(autouse=True)
def _no_deep_tree_left(tmp_path: Path) -> Iterator[None]:
    """A tree this deep would take pytest's own clean-up of old temporary directories down (it recurses)."""
    yield
    remove_tree(tmp_path)


def _held(pod: str, units: list[str]) -> ContainerAllocation:
    return ContainerAllocation(pod, "c", APPLE, units, None, None)  # type: ignore[arg-type]


def _layer(tmp_path: Path) -> LayerDir:
    layer = LayerDir(tmp_path / "vulkan")
    layer.allocations.mkdir(parents=True)
    return layer


async def test_a_deep_tree_or_a_stuck_file_never_takes_the_plugin_down(tmp_path: Path) -> None:
    base = short_tmpdir()
    socket = base / "pod-resources" / "kubelet.sock"
    async with KubeletEmulator(base / "dp", pod_resources=socket) as kubelet:
        layer = _layer(tmp_path)
        enforcer = Enforcer(layer, socket, grace=0)
        await enforcer.start(set())
        deep = allocation_id(["gpu-0::0"])
        stuck = allocation_id(["gpu-0::1"])
        await enforcer.allocate(replicas("gpu-0", 0), BUDGETS)
        await enforcer.allocate(replicas("gpu-0", 1), BUDGETS)
        # The tenant of gpu-0::0 nests 3,000 directories; the one of gpu-0::1 leaves a file that cannot go.
        _deep(layer.allocations / deep / "d", 3000)
        (layer.allocations / stuck / "stuck").write_text("x")
        with _unremovable(layer.allocations / stuck / "stuck"):
            # An Allocate of gpu-0::0 with another unit frees the deep one: it goes, and the Allocate is answered.
            edits = await enforcer.allocate(replicas("gpu-0", 0, 2), BUDGETS)
            assert edits.mounts
            assert deep not in layer.existing()
            kubelet.allocations.append(_held("other", ["gpu-0::0", "gpu-0::2"]))
            await enforcer.check()
            assert stuck in layer.existing(), "what cannot go is left, and the check carries on"
            await enforcer.check()
        await enforcer.check()
        assert set(layer.existing()) == {allocation_id(["gpu-0::0", "gpu-0::2"])}, "tried again, and gone"


async def test_a_restart_clears_what_it_can_and_serves_on(tmp_path: Path) -> None:
    base = short_tmpdir()
    socket = base / "pod-resources" / "kubelet.sock"
    async with KubeletEmulator(base / "dp", pod_resources=socket) as kubelet:
        kubelet.allocations.append(_held("serving", ["gpu-0::0"]))
        layer = _layer(tmp_path)
        deep, stuck = allocation_id(["gpu-9::0"]), allocation_id(["gpu-9::1"])
        layer.create(deep, [512 * MIB], ["gpu-9::0"])
        layer.create(stuck, [512 * MIB], ["gpu-9::1"])
        _deep(layer.allocations / deep / "d", 3000)
        (layer.allocations / stuck / "stuck").write_text("x")
        with _unremovable(layer.allocations / stuck / "stuck"):
            # Units no longer advertised: their directories go at start, as far as they can.
            enforcer = Enforcer(layer, socket, grace=0)
            await enforcer.start({"gpu-0::0"})
            assert set(layer.existing()) == {stuck}
            await enforcer.allocate(replicas("gpu-0", 0), BUDGETS)
            await enforcer.check()
            assert stuck in layer.existing()
        await enforcer.check()
        assert set(layer.existing()) == {allocation_id(["gpu-0::0"])}, "tried again at the next check, and gone"


async def test_a_restart_learns_the_units_from_its_own_record_not_the_tenants_file(tmp_path: Path) -> None:
    base = short_tmpdir()
    socket = base / "pod-resources" / "kubelet.sock"
    async with KubeletEmulator(base / "dp", pod_resources=socket) as kubelet:
        layer = _layer(tmp_path)
        enforcer = Enforcer(layer, socket, grace=0)
        await enforcer.start(set())
        await enforcer.allocate(replicas("gpu-0", 0), BUDGETS)
        forger = allocation_id(["gpu-0::1"])
        await enforcer.allocate(replicas("gpu-0", 1), BUDGETS)
        kubelet.allocations += [_held("victim", ["gpu-0::0"]), _held("forger", ["gpu-0::1"])]
        # The forger names the victim's unit where earlier versions kept an allocation's units.
        (layer.allocations / forger / "units").write_text("gpu-0::0\n")

        restarted = Enforcer(layer, socket, grace=0)
        await restarted.start({"gpu-0::0", "gpu-0::1"})
        await restarted.check()
        holders = [row.labels[:2] for row in restarted.slice_uses()]
        assert sorted(holders) == [["default", "forger"], ["default", "victim"]], "one series per pod"


async def test_a_directory_of_an_earlier_version_waits_for_the_kubelet_to_name_its_holder(tmp_path: Path) -> None:
    base = short_tmpdir()
    socket = base / "pod-resources" / "kubelet.sock"
    async with KubeletEmulator(base / "dp", pod_resources=socket) as kubelet:
        layer = _layer(tmp_path)
        held, freed = allocation_id(["gpu-0::1", "gpu-0::2"]), allocation_id(["gpu-0::3"])
        for allocation in (held, freed):
            # As an earlier version left them: no record, the units in the tenant's directory, here a lie.
            layer.create(allocation, [512 * MIB])
            (layer.allocations / allocation / "units").write_text("gpu-0::0\n")
        (layer.allocations / held / "junk").write_text("x")
        enforcer = Enforcer(layer, socket, grace=0)
        await enforcer.start({"gpu-0::0", "gpu-0::1", "gpu-0::2", "gpu-0::3"})
        assert set(layer.existing()) == {held, freed}, "unknown: kept until the kubelet says who holds them"
        # The kubelet may list a container's units of one resource in two entries.
        kubelet.allocations += [_held("victim", ["gpu-0::0"]), _held("old", ["gpu-0::2"]),
                                _held("old", ["gpu-0::1"])]
        await enforcer.check()
        assert set(layer.existing()) == {held}, "held by pod old; the other is held by nobody, and goes"
        [row] = enforcer.slice_uses()
        assert (row.namespace, row.pod, row.unit) == ("default", "old", "gpu-0::1,gpu-0::2")
        kubelet.allocations = [a for a in kubelet.allocations if a.pod != "old"]
        await enforcer.check()
        assert layer.existing() == {}
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def shared_layer(tmp_path: Path) -> Iterator[LayerDir]:
    """A layer directory on a shared mount of its own, as a DaemonSet's volume with mountPropagation Bidirectional
    is (or a host's / under systemd)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    directory = tmp_path / "vulkan"
    directory.mkdir()
    bind = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True, text=True)
    if bind.returncode != 0:
        pytest.skip(f"cannot bind-mount here, so no shared layer directory: {bind.stderr.strip()}")
    try:
        subprocess.run(["mount", "--make-shared", str(directory)], check=True, capture_output=True)
        yield LayerDir(directory)
    finally:
        subprocess.run(["umount", "-R", "-l", str(directory)], capture_output=True)


def test_a_layer_directory_whose_mounts_reach_no_container_is_not_bounded(tmp_path: Path) -> None:
    layer = LayerDir(tmp_path / "vulkan")
    layer.allocations.mkdir(parents=True)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
                         f"90 27 254:0 /x {layer.path} rw,relatime - ext4 /dev/vda rw\n")
    assert not mounts_propagate(layer.allocations, str(mountinfo))
    mountinfo.write_text(f"27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
                         f"90 27 254:0 /x {layer.path} rw,relatime master:1 - ext4 /dev/vda rw\n")
    assert not mounts_propagate(layer.allocations, str(mountinfo)), "HostToContainer: the host's reach it, not back"
    mountinfo.write_text(f"27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
                         f"90 27 254:0 /x {layer.path} rw,relatime shared:7 - ext4 /dev/vda rw\n")
    assert mounts_propagate(layer.allocations, str(mountinfo)), "Bidirectional"
    if not mounts_propagate(layer.allocations):
        why = layer.why_unbounded()
        assert why is not None and "not on a shared mount" in why


def _fill(directory: Path) -> tuple[int, int]:
    """What a tenant manages to write: bytes of a 256 MiB file, and files of 200,000."""
    written = 0
    chunk = bytes(1 << 20)
    with pytest.raises(OSError) as full, open(directory / "big", "wb", buffering=0) as big:
        while written < 256 * MIB:
            written += big.write(chunk)
    assert full.value.errno == errno.ENOSPC
    (directory / "big").unlink()
    made = 0
    with pytest.raises(OSError) as no_inodes:
        while made < 200_000:
            (directory / f"f{made}").touch()
            made += 1
    assert no_inodes.value.errno == errno.ENOSPC
    return written, made


async def test_an_allocation_directory_holds_its_accounting_files_and_little_more(
    shared_layer: LayerDir, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    if (why := shared_layer.why_unbounded()) is not None:
        pytest.skip(f"the daemon cannot bound directories here: {why}")
    enforcement = await install_layer(shared_layer.path)
    layer = enforcement.layer
    assert layer is not None and layer.bounded, caplog.text
    assert "each allocation directory is a tmpfs of its own" in caplog.text
    directory = layer.create("dp-tenant", [512 * MIB, 512 * MIB], ["gpu-0::0", "gpu-1::0"])
    assert is_mount_point(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["slice-0.acct", "slice-1.acct"]
    written, made = _fill(directory)
    assert written <= TMPFS_MARGIN + 2 * ACCT_FILE_SIZE and made <= TMPFS_SPARE_FILES
    # Allocated again: a fresh tmpfs, whatever the tenant left.
    again = layer.create("dp-tenant", [512 * MIB, 512 * MIB], ["gpu-0::0", "gpu-1::0"])
    assert sorted(p.name for p in again.iterdir()) == ["slice-0.acct", "slice-1.acct"]
    # A restarted driver keeps what running containers count in.
    with open(again / "slice-0.acct", "r+b") as acct:  # noqa: ASYNC230 (a small write, as a container would)
        acct.write(b"GPPTVK01-kept")
    layer.create("dp-tenant", [512 * MIB, 512 * MIB], fresh=False)
    assert (again / "slice-0.acct").read_bytes().startswith(b"GPPTVK01-kept")
    assert layer.remove("dp-tenant")
    assert not directory.exists() and layer.existing() == {}
