"""``gpuppetti demo`` on a node's real GPUs, on this host: the demo over fixture machines' sysfs (the same kubelet
emulator and plugin as on simulated GPUs), and the image its containers get for real GPUs. These need no VM; the
guest tests (test_guest_demo.py) run the same demo, with podman, on a real virtio-gpu.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from gpuppetti.commands.demo import DemoError, run_demo
from gpuppetti.commands.demo.image import driver_manifests, library_of, node_image
from gpuppetti.core.model import DeviceNode, Gpu, Vendor
from gpuppetti.kubelet.sandbox import BUSYBOX, PODMAN_FLAGS, RUN_FLAGS, VULKAN_LOADER
from tests.fixtures import two_vendor_machine, virtio_vm

pytestmark = pytest.mark.e2e

VIRTIO_CONFIG = """\
version: v1
backend: drm
virtio: {vendor: apple, model: Apple M3 Max, cores: 40, memory: 2Gi}
sharing:
  timeSlicing:
    resources:
      - {name: apple.com/gpu, replicas: 4}
"""


def demo(config: Path, host_root: Path, backend: str | None = None) -> tuple[int, str]:
    out = io.StringIO()
    console = Console(file=out, width=200, highlight=False)
    code = asyncio.run(run_demo(config, console, host_root=host_root, backend=backend))
    return code, out.getvalue()


def test_the_demo_slices_a_vms_virtio_gpu_found_in_its_sysfs(tmp_path: Path) -> None:
    virtio_vm(tmp_path / "host")
    config = tmp_path / "config.yaml"
    config.write_text(VIRTIO_CONFIG)
    code, out = demo(config, tmp_path / "host")
    assert code == 0, out
    assert "virtio-card0" in out and "Apple M3 Max" in out and "drm" in out
    for replica in range(4):
        assert f"virtio-card0::{replica}" in out
    # Each pod's container gets the render node and the env that selects it, and its slice.
    assert "device nodes and env in the container" in out
    assert out.count("device /dev/dri/renderD128") == 3, "three pods admitted, the fourth finds nothing left"
    for text in ("GGML_VK_VISIBLE_DEVICES=0", "GPUPPETTI_VK_SLICES=any=536870912", "GPUPPETTI_VK_SLICES=any=1073741824",
                 "GPUPPETTI_SLICES=virtio-card0::2,virtio-card0::3", "not admitted", "re-registered"):
        assert text in out, text
    assert "MESA_VK_DEVICE_SELECT" not in out, "no Vulkan ids configured for the virtio-gpu"


def test_the_demo_serves_each_vendors_gpus_under_its_own_resource(tmp_path: Path) -> None:
    two_vendor_machine(tmp_path / "host")
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nbackend: drm\n")
    code, out = demo(config, tmp_path / "host")
    assert code == 0, out
    for text in ("gpu.intel.com/i915", "amd.com/gpu", "AlderLake-S GT1", "device /dev/dri/renderD128",
                 "device /dev/dri/renderD129", "device /dev/kfd", "ZE_AFFINITY_MASK=0", "ROCR_VISIBLE_DEVICES=0"):
        assert text in out, text
    assert "whole" in out, "GPUs that are not time-sliced are whole"


def test_a_backend_that_finds_nothing_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nbackend: drm\n")
    with pytest.raises(DemoError) as cannot:
        demo(config, tmp_path / "empty")
    assert not cannot.value.bad_input, "the machine, not the config"
    assert "backend drm cannot run here: drm:" in str(cannot.value)
    (tmp_path / "empty/sys/class/drm").mkdir(parents=True)
    with pytest.raises(DemoError) as none:
        demo(config, tmp_path / "empty")
    assert none.value.bad_input
    assert str(none.value) == (f"the demo config {config} has no simulated GPUs (simulated.gpus), and backend drm "
                               f"found none here (drm: no GPU with a render node in {tmp_path}/empty/sys/class/drm)")


def _manifest(directory: Path, name: str, library: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps({"file_format_version": "1.0.0", "ICD": {"library_path": library,
                                                                           "api_version": "1.3.0"}}))
    return path


def _gpu(vendor: Vendor, simulated: bool = False) -> Gpu:
    return Gpu(id=f"{vendor.value}-0", index=0, vendor=vendor, model="x", backend="simulated" if simulated else "drm",
               device_nodes=() if simulated else (DeviceNode("/dev/dri/renderD128"),), simulated=simulated)


def test_the_drivers_a_container_needs_for_each_kind_of_gpu(tmp_path: Path) -> None:
    share, etc = tmp_path / "share", tmp_path / "etc"
    virtio = _manifest(share, "virtio_icd.json", "libvulkan_virtio.so")
    lavapipe = _manifest(share, "lvp_icd.x86_64.json", "/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so")
    radeon = _manifest(share, "radeon_icd.x86_64.json", "libvulkan_radeon.so")
    intel = _manifest(share, "intel_icd.x86_64.json", "libvulkan_intel.so")
    hasvk = _manifest(share, "intel_hasvk_icd.x86_64.json", "libvulkan_intel_hasvk.so")
    nvidia = _manifest(etc, "nvidia_icd.json", "libGLX_nvidia.so.0")
    dirs = (share, etc)
    assert driver_manifests([_gpu(Vendor.APPLE)], dirs) == [virtio], "Apple's GPU in a krunkit VM: Venus"
    assert driver_manifests([_gpu(Vendor.VIRTIO)], dirs) == [virtio]
    assert driver_manifests([_gpu(Vendor.APPLE, simulated=True)], dirs) == [lavapipe]
    assert driver_manifests([_gpu(Vendor.AMD), _gpu(Vendor.INTEL)], dirs) == [radeon, intel, hasvk]
    assert driver_manifests([_gpu(Vendor.NVIDIA)], dirs) == [nvidia]
    assert driver_manifests([_gpu(Vendor.OTHER)], dirs) == []


def test_a_manifests_library_is_found_as_the_dynamic_linker_finds_it(tmp_path: Path) -> None:
    library = tmp_path / "lib" / "libvulkan_x.so"
    library.parent.mkdir()
    library.write_bytes(b"")
    assert library_of(_manifest(tmp_path / "a", "x.json", str(library))) == library
    assert library_of(_manifest(tmp_path / "lib", "y.json", "./libvulkan_x.so")) == tmp_path / "lib/./libvulkan_x.so"
    assert library_of(_manifest(tmp_path / "b", "z.json", "libvulkan_no_such_driver.so")) is None
    if VULKAN_LOADER.exists():
        assert library_of(_manifest(tmp_path / "c", "l.json", VULKAN_LOADER.name)) == VULKAN_LOADER
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert library_of(broken) is None


def _why_no_podman() -> str | None:
    if os.geteuid() != 0:
        return "podman runs the containers as root here"
    if shutil.which("podman") is None or not Path(PODMAN_FLAGS[1]).exists() or not BUSYBOX.exists():
        return "podman, runc or busybox-static is missing (Debian: apt-get install podman runc busybox-static)"
    if not VULKAN_LOADER.exists():
        return "no Vulkan loader here (Debian: libvulkan1)"
    return None


def test_the_image_for_a_real_gpu_holds_its_driver_and_the_loader() -> None:
    reason = _why_no_podman()
    if reason is not None:
        pytest.skip(reason)
    gpus = [_gpu(Vendor.AMD)]
    if not driver_manifests(gpus):
        pytest.skip("no RADV manifest on this host (Debian: mesa-vulkan-drivers)")
    tag = asyncio.run(node_image(gpus))
    assert tag.startswith("localhost/gpuppetti-sandbox:node-")
    assert asyncio.run(node_image(gpus)) == tag, "built once: the same files give the same tag"
    script = f"ls /usr/share/vulkan/icd.d {VULKAN_LOADER} /lib/*/libpthread.so.0 /usr/lib/*/libpthread.so.0 2>/dev/null"
    listed = subprocess.run(["podman", *PODMAN_FLAGS, "run", *RUN_FLAGS, tag, "/bin/sh", "-c", f"{script}; true"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert listed.returncode == 0, listed.stderr
    assert "radeon_icd" in listed.stdout and "lvp_icd" not in listed.stdout, listed.stdout
    assert str(VULKAN_LOADER) in listed.stdout
    assert "libpthread.so.0" in listed.stdout, "what the slice layer (mounted in) loads besides libc"
