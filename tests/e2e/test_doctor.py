"""``gpuppetti doctor`` over fixture nodes: a host tree with GPUs and Vulkan drivers, the kubelet emulator's
sockets, a stand-in CRI runtime answering as containerd or CRI-O of a given version, and a running plugin."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuppetti.commands.doctor import vulkan, window
from gpuppetti.commands.doctor.result import Status
from gpuppetti.core.model import DeviceNode, Gpu, Vendor
from gpuppetti.kubelet.emulator import KubeletEmulator
from gpuppetti.layer.vulkan import BUILT, LIBRARY, PROBE, LayerDir
from tests.fixtures import FakeHost, amd_machine, virtio_vm
from tests.helpers import TWO_M3_MAX, Daemon, run_here, short_tmpdir
from tests.standins.cri import CriStandIn

pytestmark = pytest.mark.e2e

CDI_ON = {"enableCDI": True, "cdiSpecDirs": ["/etc/cdi", "/var/run/cdi"]}


@pytest.fixture
def node() -> Iterator[Path]:
    """A host root with an AMD GPU and Mesa's Vulkan driver, and the directories a kubelet node has."""
    import shutil

    root = short_tmpdir("gp-doc-")
    amd_machine(root / "host")
    # A kernel with the dmem controller, whose amdgpu registers the card's VRAM.
    (root / "host/sys/fs/cgroup").mkdir(parents=True)
    (root / "host/sys/fs/cgroup/dmem.capacity").write_text("drm/0000:03:00.0/vram 25753026560\n")
    python = root / "host/usr/bin/python3"  # what the dmem hook runs with
    python.parent.mkdir(parents=True)
    python.write_bytes(b"")
    python.chmod(0o755)
    icd = root / "host/usr/share/vulkan/icd.d/radeon_icd.x86_64.json"
    icd.parent.mkdir(parents=True)
    icd.write_text(json.dumps({"file_format_version": "1.0.0",
                               "ICD": {"library_path": "libvulkan_radeon.so", "api_version": "1.3.255"}}))
    loader = root / "host/usr/lib/x86_64-linux-gnu/libvulkan.so.1"
    loader.parent.mkdir(parents=True)
    loader.write_bytes(b"")
    for directory in ("registry", "cdi"):
        (root / directory).mkdir()
    if (BUILT / LIBRARY).exists():
        LayerDir(root / "vulkan").install()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _doctor(node: Path, device_plugin_dir: Path, *extra: str) -> tuple[int, list[dict[str, Any]], str]:
    args = ["doctor", "--host-root", str(node / "host"), "--device-plugin-dir", str(device_plugin_dir),
            "--registry-dir", str(node / "registry"), "--cdi-dir", str(node / "cdi"),
            "--runtime-endpoint", f"unix://{node / 'cri.sock'}", "--vulkan-layer-dir", str(node / "vulkan"), *extra]
    as_json = run_here(*args, "--json")
    text = run_here(*args, env={"COLUMNS": "120"})
    assert "Traceback" not in as_json.stderr + text.stderr
    assert as_json.returncode == text.returncode
    return as_json.returncode, json.loads(as_json.stdout), text.stdout


def _by_check(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {result["check"]: result for result in results}


async def test_a_node_with_everything_in_place(
    node: Path, kubelet: KubeletEmulator, plugin_dir: Path, start_plugin: Callable[..., Daemon]
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    url = await plugin.http_url()
    await kubelet.wait_registered("apple.com/gpu")
    config = {"enableCDI": True, "cdiSpecDirs": ["/etc/cdi", str(node / "cdi")]}
    async with CriStandIn(node / "cri.sock", "containerd", "v2.1.4", config):
        code, results, text = await asyncio.to_thread(_doctor, node, plugin_dir, "--daemon", url)
    checks = _by_check(results)
    assert code == 0, text
    assert {name: r["status"] for name, r in checks.items()} == {
        "config": "ok", "GPUs": "ok", "host agent": "skip", "kubelet device plugins": "ok",
        "kubelet plugin registry": "ok", "container runtime": "ok", "CDI in the runtime": "ok",
        "CDI directory": "ok", "Vulkan": "ok", "daemon": "ok", "Vulkan driver": "skip",
        "Vulkan layer": "ok" if (BUILT / LIBRARY).exists() else "warn",
        "enforced by amd-0000-03-00.0": "ok" if (BUILT / LIBRARY).exists() else "warn", "cluster": "skip"}
    assert "run `gpuppetti doctor` on the node itself" in checks["Vulkan driver"]["detail"], "a host root's drivers"
    assert "1 found by drm: amd-0000-03-00.0 (Navi 31" in checks["GPUs"]["detail"]
    assert checks["container runtime"]["detail"].startswith("containerd 2.1.4 (CRI v1)")
    assert "radeon_icd.x86_64.json (libvulkan_radeon.so)" in checks["Vulkan"]["detail"]
    assert checks["daemon"]["detail"] == f"{url}/healthz: ok"
    assert "✔ GPUs" in text and "nothing failed, 0 warning(s)" in text


@pytest.mark.parametrize(("name", "version", "config", "status", "says"), [
    ("containerd", "1.6.20~ds1", {"containerd": {"snapshotter": "overlayfs"}}, "fail",
     "containerd 1.6.20~ds1 (CRI v1) cannot apply CDI devices: DRA claims"),
    ("containerd", "v1.7.24", {"enableCDI": False, "cdiSpecDirs": ["/etc/cdi", "/var/run/cdi"]}, "fail",
     "CDI is off in containerd 1.7.24"),
    ("containerd", "v2.0.0", {"enableCDI": True, "cdiSpecDirs": ["/etc/cdi"]}, "fail",
     "reads CDI specs from /etc/cdi, not from"),
    ("containerd", "v1.7.24", CDI_ON, "ok", "applies CDI devices"),
    ("cri-o", "1.30.2", None, "ok", "always on from 1.23"),
    ("cri-o", "1.22.0", None, "fail", "cannot apply CDI devices"),
    ("docker", "27.1.0", None, "warn", "cannot tell whether this runtime applies CDI devices"),
])
async def test_the_runtime_and_its_cdi(node: Path, kubelet: KubeletEmulator, plugin_dir: Path, name: str,
                                       version: str, config: dict[str, Any] | None, status: str, says: str) -> None:
    if config is not None and "cdiSpecDirs" in config and config["cdiSpecDirs"] != ["/etc/cdi"]:
        config = {**config, "cdiSpecDirs": [*config["cdiSpecDirs"], str(node / "cdi")]}
    async with CriStandIn(node / "cri.sock", name, version, config):
        code, results, text = await asyncio.to_thread(_doctor, node, plugin_dir)
    cdi = _by_check(results)["CDI in the runtime"]
    assert (cdi["status"], code) == (status, 1 if status == "fail" else 0), text
    assert says in cdi["detail"], cdi
    assert (cdi["fix"] is not None) == (status != "ok")


def test_an_empty_machine_fails_with_a_fix_for_each_failure(tmp_path: Path) -> None:
    (tmp_path / "host").mkdir()
    code, results, text = _doctor(tmp_path, tmp_path / "no-device-plugins")
    checks = _by_check(results)
    assert code == 1
    for name in ("GPUs", "kubelet device plugins", "kubelet plugin registry", "container runtime"):
        assert checks[name]["status"] == "fail", checks[name]
        assert checks[name]["fix"], checks[name]
    assert checks["Vulkan"]["status"] == "warn"
    assert "no CRI socket at" in checks["container runtime"]["detail"]
    assert "does not exist: no kubelet serves device plugins here" in checks["kubelet device plugins"]["detail"]
    assert "✖ GPUs" in text and "fix:" in text and "check(s) failed" in text


async def test_a_stale_kubelet_socket_and_a_daemon_that_is_not_ready(
    node: Path, start_plugin: Callable[..., Daemon], plugin_dir: Path
) -> None:
    # A socket file nobody listens on: what a kubelet that died leaves.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(plugin_dir / "kubelet.sock"))
    stale.close()
    plugin = start_plugin(TWO_M3_MAX)
    url = await plugin.http_url()
    code, results, _ = await asyncio.to_thread(_doctor, node, plugin_dir, "--daemon", url)
    checks = _by_check(results)
    assert code == 1
    assert "refuses connections" in checks["kubelet device plugins"]["detail"]
    assert checks["daemon"]["status"] == "fail"
    assert "not ready: not registered with the kubelet" in checks["daemon"]["detail"]
    assert "not ready: not ready" not in checks["daemon"]["detail"], "the daemon's own words are said once"


# -- which Vulkan driver serves each GPU, and how much a VM can map ---------------------------------------------

# QEMU 10's virtio-gpu-gl-pci (blob=true, hostmem=1G, venus=true) as the venus guest reads its config space: the
# virtio vendor capabilities, the first of which (at 0x40) is the host-visible shared memory region, 1 GiB in BAR 4.
QEMU_VIRTIO_GPU_CONFIG = bytes.fromhex(
    "f41a5010070510000100800300000000" "00000000 00b0bffe 0c000040 ff000000".replace(" ", "")
    + "0c000000ff000000000000 00f41a0011".replace(" ", "") + "00000000b00000000000 00000a010000".replace(" ", "")
    + "09001808040100000000000000000040" + "00000000000000000940100102000000"
    + "00000000001000000958100302000000" + "00100000001000000968100402000000"
    + "00200000001000000978140202000000" + "003000000010000004000000 09881405".replace(" ", "")
    + "00" * 16 + "119c0280010000000108000000000000" + "00" * 64)
# Its debugfs, and the kernel's line at boot.
DEBUGFS_FEATURES = ("virgl            : yes\nedid             : yes\nindirect         : yes\nresource uuid    : no\n"
                    "blob resources   : yes\ncontext init     : yes\ncap sets         : 3\nscanouts         : 1\n"
                    "host visible region : 0xff00000000 +0x40000000\n")
DEBUGFS_MAPPINGS = ("0x000000ff00000000-0x000000ff10000000: 268435456: used\n"
                    "0x000000ff10000000-0x000000ff40000000: 805306368: free\n"
                    "total: 1073741824, used 268435456 free 805306368\n")
KERNEL_LOG = ("6,512,1843210,-;[drm] pci: virtio-gpu-pci detected at 0000:00:01.0\n"
              "6,513,1843300,-;[drm] Host memory window: 0xff00000000 +0x40000000\n")
# What gpuppetti-vkinfo --json reported in the venus guest (run with --guest-lavapipe): Venus behind the render
# node, and the guest's own lavapipe beside it.
VENUS_DEVICES: list[dict[str, Any]] = [
    {"name": "Virtio-GPU Venus (llvmpipe (LLVM 19.1.7, 256 bits))", "type": "cpu",
     "uuid": "5fb5c03fc537f0fea7e69cd5866acb8d", "memory_budget": False, "max_allocation": 2147483648,
     "vendor_id": 65541, "device_id": 0, "api_version": "1.2.0",
     "driver": {"id": 22, "name": "venus", "info": "Mesa 25.0.7-2+deb13u1"}, "pci_bus": "0000:00:01.0",
     "drm": {"primary": None, "render": "226:128"},
     "heaps": [{"size": 25275990016, "device_local": True, "budget": 0, "usage": 0}]},
    {"name": "llvmpipe (LLVM 19.1.7, 256 bits)", "type": "cpu", "uuid": "6d65736132352e302e372d322b646500",
     "memory_budget": True, "max_allocation": 2147483648, "vendor_id": 65541, "device_id": 0,
     "api_version": "1.4.305", "driver": {"id": 13, "name": "llvmpipe", "info": "Mesa 25.0.7-2+deb13u1 (LLVM 19.1.7)"},
     "pci_bus": None, "drm": None, "heaps": [{"size": 2069463040, "device_local": True, "budget": 0, "usage": 0}]},
]
VENUS_REPORT = {"layer": False, "slices": None, "compute": None, "devices": VENUS_DEVICES}
VIRTIO_CONFIG = """\
version: v1
backend: drm
virtio: {{vendor: {vendor}, model: Apple M3 Max, cores: 40, memory: {memory}}}
sharing:
  timeSlicing:
    resources:
      - {{name: {resource}, replicas: {replicas}}}
"""


def qemu_vm(root: Path, config: bytes = QEMU_VIRTIO_GPU_CONFIG) -> Path:
    """A VM's host root with QEMU's virtio-gpu on PCI 0000:00:01.0 (its card0 and renderD128)."""
    host = FakeHost(root)
    device = host.pci_gpu(card=0, render=128, bdf="0000:00:01.0", vendor=0x1AF4, device=0x1050, driver="virtio-pci")
    (device / "config").write_bytes(config)
    (device / "drm" / "renderD128" / "dev").write_text("226:128\n")
    return device


def virtio_gpu(vendor: Vendor = Vendor.APPLE, pci: str | None = "0000:00:01.0") -> Gpu:
    return Gpu(id="virtio-0000-00-01.0", index=0, vendor=vendor, model="Apple M3 Max", backend="drm",
               device_nodes=(DeviceNode("/dev/dri/renderD128"),), pci_address=pci)


def test_the_window_from_the_pci_capabilities_of_qemus_virtio_gpu() -> None:
    assert len(QEMU_VIRTIO_GPU_CONFIG) == 256
    assert window.shared_memory_length(QEMU_VIRTIO_GPU_CONFIG) == 2**30
    four = bytearray(QEMU_VIRTIO_GPU_CONFIG)
    struct.pack_into("<I", four, 0x40 + 12, 0)
    struct.pack_into("<I", four, 0x40 + 20, 1)  # length_hi: hostmem=4G
    assert window.shared_memory_length(bytes(four)) == 4 * 2**30
    without = bytearray(QEMU_VIRTIO_GPU_CONFIG)
    without[0x40 + 3] = 2  # the capability becomes the notify configuration: no shared memory region
    assert window.shared_memory_length(bytes(without)) == 0
    assert window.shared_memory_length(QEMU_VIRTIO_GPU_CONFIG[:64]) is None, "what a user who is not root reads"
    loop = bytearray(QEMU_VIRTIO_GPU_CONFIG)
    loop[0x41] = 0x58  # a capability list that runs in a circle ends
    loop[0x59] = 0x40
    loop[0x43] = 2
    assert window.shared_memory_length(bytes(loop)) == 0


def test_the_window_from_debugfs_and_from_the_kernel_log(tmp_path: Path) -> None:
    qemu_vm(tmp_path)
    debugfs = tmp_path / "sys/kernel/debug/dri/128"
    debugfs.mkdir(parents=True)
    (debugfs / "virtio-gpu-features").write_text(DEBUGFS_FEATURES)
    (debugfs / "virtio-gpu-host-visible-mm").write_text(DEBUGFS_MAPPINGS)
    found = window.find_window(tmp_path, virtio_gpu(), True)
    assert found == window.Window(2**30, 2**28, "debugfs (sys/kernel/debug/dri/128)")
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(KERNEL_LOG)
    assert window.from_kernel_log(kmsg) == window.Window(2**30, None, "the kernel's log")
    kmsg.write_text("6,1,1,-;nothing of virtio_gpu here\n")
    assert "no longer holds" in str(window.from_kernel_log(kmsg))
    assert "No such file" in str(window.from_kernel_log(tmp_path / "none"))


def test_a_virtio_mmio_gpu_without_debugfs_cannot_be_told_in_a_pod(tmp_path: Path) -> None:
    virtio_vm(tmp_path)
    gpu = Gpu(id="virtio-card0", index=0, vendor=Vendor.APPLE, model="Apple M3 Max", backend="drm",
              device_nodes=(DeviceNode("/dev/dri/renderD128"),))
    [sliced] = window.window_checks([gpu], {gpu.id: [2**29] * 4}, tmp_path)
    assert sliced.status is Status.WARN
    assert "cannot tell how much GPU memory the VM can map" in sliced.detail
    assert "not on PCI" in sliced.detail and "read only on the node itself" in sliced.detail
    assert sliced.fix is not None and "mount -t debugfs" in sliced.fix
    [whole] = window.window_checks([gpu], {}, tmp_path)
    assert whole.status is Status.SKIP


@pytest.mark.parametrize(("memory", "replicas", "status", "says"), [
    ("2Gi", 4, "ok", "each slice (512 MiB) fits; 4 slices together (2 GiB) map from the same window"),
    ("1Gi", 2, "ok", "each slice (512 MiB) fits"),
    ("8Gi", 4, "warn", "less than a slice (2 GiB): a workload that maps more than 1 GiB of its slice gets "
                       "VK_ERROR_OUT_OF_DEVICE_MEMORY"),
    ("8Gi", 1, "ok", "the GPU is not sliced"),
])
def test_doctor_says_whether_a_slice_fits_the_vms_window(tmp_path: Path, memory: str, replicas: int, status: str,
                                                         says: str) -> None:
    qemu_vm(tmp_path / "host")
    config = tmp_path / "config.yaml"
    config.write_text(VIRTIO_CONFIG.format(vendor="apple", memory=memory, resource="apple.com/gpu",
                                           replicas=replicas))
    (tmp_path / "registry").mkdir()
    _, results, text = _doctor(tmp_path, tmp_path / "dp", "--config", str(config))
    checks = _by_check(results)
    assert "1 found by drm: virtio-0000-00-01.0 (Apple M3 Max)" in checks["GPUs"]["detail"]
    found = checks["virtio-gpu window"]
    assert found["status"] == status, found
    assert found["detail"].startswith("virtio-0000-00-01.0: the VM can map 1 GiB of GPU memory at once (the "
                                      "virtio-gpu's host-visible window, from PCI capabilities of 0000:00:01.0)")
    assert says in found["detail"], found
    if status == "warn":
        assert "hostmem=" in found["fix"] and "sliceMemory" in found["fix"]
        assert "! virtio-gpu window" in text


def test_the_driver_behind_each_render_node(tmp_path: Path) -> None:
    qemu_vm(tmp_path)
    devices = vulkan.parse_report(json.dumps(VENUS_REPORT))
    # The config calls it Apple's GPU, but the host behind Venus renders on its CPU: said, with the way to a Mac's.
    [apple] = vulkan.judge([virtio_gpu(Vendor.APPLE)], devices, tmp_path)
    assert apple.status is Status.WARN
    assert apple.detail.startswith("virtio-0000-00-01.0 (/dev/dri/renderD128): venus (Mesa 25.0.7-2+deb13u1, "
                                   "MESA_VENUS), device \"Virtio-GPU Venus (llvmpipe (LLVM 19.1.7, 256 bits))\" (cpu)")
    assert 'whose device is "llvmpipe (LLVM 19.1.7, 256 bits)": a CPU renderer, not the Mac\'s GPU' in apple.detail
    assert apple.fix is not None and "krunkit" in apple.fix
    # Described as a plain virtio-gpu, the same device is fine; matched by its render node, not by the other CPU one.
    [plain] = vulkan.judge([virtio_gpu(Vendor.VIRTIO, pci=None)], devices, tmp_path)
    assert plain.status is Status.OK and "venus (" in plain.detail, plain
    # By PCI address where the driver reports no DRM node.
    no_drm = [dataclasses.replace(device, render=None) for device in devices]
    [by_pci] = vulkan.judge([virtio_gpu(Vendor.VIRTIO)], no_drm, tmp_path / "elsewhere")
    assert by_pci.status is Status.OK and "MESA_VENUS" in by_pci.detail


def test_a_gpu_no_driver_serves_is_said_with_what_vulkan_would_run_on(tmp_path: Path) -> None:
    qemu_vm(tmp_path)
    lavapipe_only = vulkan.parse_report(json.dumps({**VENUS_REPORT, "devices": VENUS_DEVICES[1:]}))
    [result] = vulkan.judge([virtio_gpu()], lavapipe_only, tmp_path)
    assert result.status is Status.WARN
    assert result.detail.startswith("virtio-0000-00-01.0 (/dev/dri/renderD128): no Vulkan driver serves it")
    assert 'Vulkan workloads would run on "llvmpipe (LLVM 19.1.7, 256 bits)" (cpu)' in result.detail
    assert result.fix is not None and "Venus" in result.fix and "mesa-vulkan-drivers" in result.fix


def test_an_nvidia_gpu_is_matched_by_its_uuid(tmp_path: Path) -> None:
    gpu = Gpu(id="GPU-8a2c1f6e-51a3-4f6d-9b0e-2f1c3d4e5f60", index=0, vendor=Vendor.NVIDIA, model="H100",
              backend="nvml", uuid="GPU-8a2c1f6e-51a3-4f6d-9b0e-2f1c3d4e5f60",
              device_nodes=(DeviceNode("/dev/nvidia0"),))
    report = {"devices": [{"name": "NVIDIA H100 80GB HBM3", "type": "discrete",
                           "uuid": "8a2c1f6e51a34f6d9b0e2f1c3d4e5f60",
                           "driver": {"id": 4, "name": "NVIDIA", "info": "570.86.15"}}]}
    [result] = vulkan.judge([gpu], vulkan.parse_report(json.dumps(report)), tmp_path)
    assert result.status is Status.OK
    assert "NVIDIA (570.86.15, NVIDIA_PROPRIETARY)" in result.detail


def _fake_probe(tmp_path: Path, output: str, code: int = 0) -> Path:
    probe = tmp_path / "gpuppetti-vkinfo"
    # As the real one: the report on stdout, a failure's reason on stderr.
    to = " >&2" if code else ""
    probe.write_text(f"#!/bin/sh\n[ \"$1\" = --json ] && [ \"$GPUPPETTI_VK_DISABLE\" = 1 ] || exit 9\n"
                     f"cat <<'EOF'{to}\n{output}\nEOF\nexit {code}\n")
    probe.chmod(0o755)
    return probe


async def test_the_probe_is_run_with_the_layer_off_and_its_failures_said(tmp_path: Path) -> None:
    probe = _fake_probe(tmp_path, json.dumps(VENUS_REPORT))
    [result] = await vulkan.driver_checks([virtio_gpu(Vendor.VIRTIO)], Path("/"), probe)
    assert result.status is Status.OK, result
    failing = _fake_probe(tmp_path, "gpuppetti-vkinfo: no Vulkan here: vkCreateInstance: VK_ERROR_INCOMPATIBLE_DRIVER",
                          1)
    [result] = await vulkan.driver_checks([virtio_gpu()], Path("/"), failing)
    assert (result.status, result.check) == (Status.WARN, "Vulkan driver")
    assert result.detail == ("Vulkan cannot be used here: gpuppetti-vkinfo: no Vulkan here: vkCreateInstance: "
                             "VK_ERROR_INCOMPATIBLE_DRIVER")
    garbage = _fake_probe(tmp_path, "not json")
    [result] = await vulkan.driver_checks([virtio_gpu()], Path("/"), garbage)
    assert "the probe's report is not what it should be" in result.detail
    simulated = dataclasses.replace(virtio_gpu(), simulated=True, device_nodes=(), pci_address=None)
    [result] = await vulkan.driver_checks([simulated], Path("/"), probe)
    assert result.status is Status.SKIP


async def test_the_installed_probe_names_this_hosts_driver() -> None:
    if not (BUILT / PROBE).exists():
        pytest.skip("the probe is not built here (make native: needs a C compiler and libvulkan-dev)")
    try:
        devices = await vulkan.run_probe()
    except vulkan.ProbeFailed as exc:
        pytest.skip(f"no Vulkan on this host: {exc}")
    assert devices, "lavapipe at least"
    for device in devices:
        assert device.driver_name, device
        assert device.driver_id in vulkan.DRIVER_IDS, device
    lavapipe = [device for device in devices if device.driver_id == 13]
    if lavapipe:
        assert lavapipe[0].driver_name == "llvmpipe" and lavapipe[0].type == "cpu"
        assert lavapipe[0].pci_bus is None and lavapipe[0].render is None, "a CPU device sits on no bus"
