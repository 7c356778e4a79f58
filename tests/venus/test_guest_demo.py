"""In a Venus VM (guest/demo.sh): ``gpuppetti demo --runtime podman`` on the VM's own virtio-gpu, each pod run as a
podman container that obtains its slice from Venus; ``gpuppetti doctor`` in a VM whose host-visible window (256
MiB) is smaller than a slice (512 MiB); and what happens to a workload that maps more than the window.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuppetti.commands.doctor import window
from tests.venus.venusnode import Batch

MIB = 2**20
GPU = "virtio-0000-00-01.0"


def test_the_demo_slices_the_vms_virtio_gpu(demo: Batch) -> None:
    out = demo.text("demo.txt")
    assert demo.code("demo") == 0, demo.context()
    for text in ("the device plugin registered with the built-in kubelet", "Apple M3 Max", "slices are enforced",
                 "device nodes and env in the container", "device /dev/dri/renderD128", "GGML_VK_VISIBLE_DEVICES=0",
                 "GPUPPETTI_VK_SLICES=pci:0000:00:01.0=536870912", "not admitted", "re-registered"):
        assert text in out, text
    for replica in range(4):
        assert f"{GPU}::{replica}" in out


def test_each_podman_container_obtains_its_slice_from_venus(demo: Batch) -> None:
    if demo.text("no-podman"):
        pytest.skip("podman is not installed in the venusnode chroot (setup.sh with VENUSNODE_PACKAGES=podman)")
    out = demo.text("demo.txt")
    assert "Containers run by podman (localhost/gpuppetti-sandbox:node-" in out, out[-3000:]
    containers = out[out.index("Containers run by podman"):]
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:5]]
            for line in containers.splitlines() if line.startswith("│ gpu-pod-")}
    # Each container sees its slice as its GPU's heap and obtains all of it from Venus; two slices, twice that.
    assert rows == {"gpu-pod-1": ["512 MiB"] * 3, "gpu-pod-2": ["512 MiB"] * 3, "gpu-pod-3": ["1 GiB"] * 3}, rows
    # podman applied the CDI device the plugin named (its marker env) and made the render node.
    assert "GPUPPETTI_CDI_VIRTIO_0000_00_01_0=virtio-0000-00-01.0" in containers
    assert " dri " in containers


def test_doctor_warns_that_a_slice_is_larger_than_what_the_vm_can_map(demo: Batch) -> None:
    checks = {result["check"]: result for result in demo.json("doctor.json")}
    found = checks["virtio-gpu window"]
    assert found["status"] == "warn", found
    # Read from the PCI capabilities: debugfs was unmounted for this doctor.
    assert found["detail"].startswith(f"{GPU}: the VM can map 256 MiB of GPU memory at once (the virtio-gpu's "
                                      "host-visible window, from PCI capabilities of 0000:00:01.0), less than a "
                                      "slice (512 MiB)"), found
    assert "hostmem=" in found["fix"]


def test_the_kernel_logs_the_window_the_way_doctor_reads_it(demo: Batch, tmp_path: Path) -> None:
    line = demo.text("dmesg-window.txt").strip()
    assert "Host memory window" in line, demo.context()
    log = tmp_path / "kmsg"
    log.write_text(f"6,600,9893659,-;{line.split('] ', 1)[1]}\n")
    assert window.from_kernel_log(log) == window.Window(256 * MIB, None, "the kernel's log")


def test_mapping_more_than_the_window_fails_before_the_slice_is_spent(demo: Batch) -> None:
    # What doctor's warning is about: wgpu mapping 32 MiB buffers gets no further than the 256 MiB window, and on
    # Venus the failed map loses wgpu's device.
    assert demo.code("mapped") == 0, demo.context()
    report = demo.json("mapped.json")["mapped"]
    assert report["error"] is not None, report
    assert report["obtained"] < 256 * MIB, report
