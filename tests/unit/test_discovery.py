from __future__ import annotations

import importlib.util
import json
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest

from gpuppetti.core.config import ConfigError, VirtioSection
from gpuppetti.core.model import Health, HealthEvent, Vendor
from gpuppetti.discovery import BackendUnavailable, backends_for, discover
from gpuppetti.discovery.drm import DrmBackend
from gpuppetti.discovery.macos import parse_ioreg, parse_system_profiler
from gpuppetti.discovery.nvml import NvmlBackend, normalise_bus_id, preload_host_library
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.node.daemon import describe
from tests.fixtures import RADEON_VRAM, amd_machine, intel_machine, nvidia_machine, two_vendor_machine, virtio_vm
from tests.helpers import FAKES, config_from

MACOS = FAKES / "macos"


def test_amd(tmp_path: Path) -> None:
    amd_machine(tmp_path)
    [gpu] = DrmBackend(tmp_path, VirtioSection()).discover()
    assert gpu.vendor is Vendor.AMD
    assert gpu.id == "amd-0000-03-00.0"
    assert gpu.model == "Navi 31 [Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M]"
    assert gpu.memory_bytes == RADEON_VRAM
    assert [n.path for n in gpu.device_nodes] == ["/dev/dri/renderD128", "/dev/dri/card1", "/dev/kfd"]
    assert (gpu.numa_node, gpu.pci_address, gpu.driver) == (0, "0000:03:00.0", "amdgpu")
    assert (gpu.utilization_percent, gpu.memory_used_bytes, gpu.uuid) == (17, 2**30, "5e1d3f2a0b8c9d12")


def test_simpledrm_and_connectors_are_skipped(tmp_path: Path) -> None:
    amd_machine(tmp_path)  # card0 is simpledrm, card1-DP-1 and card1-HDMI-A-1 are connectors
    assert len(DrmBackend(tmp_path, VirtioSection()).discover()) == 1


def test_intel_i915_and_xe(tmp_path: Path) -> None:
    intel_machine(tmp_path)
    gpus = DrmBackend(tmp_path, VirtioSection()).discover()
    assert [(g.driver, g.index, g.model, g.numa_node) for g in gpus] == [
        ("i915", 0, "AlderLake-S GT1", None),
        ("xe", 1, "Battlemage G21 [Arc B580]", 0),
    ]
    assert all(g.vendor is Vendor.INTEL and g.resource_name == "gpu.intel.com/i915" for g in gpus)
    assert [n.path for n in gpus[1].device_nodes] == ["/dev/dri/renderD129", "/dev/dri/card1"]


def test_nvidia_without_nvml_uses_the_driver_proc_file(tmp_path: Path) -> None:
    nvidia_machine(tmp_path)
    [gpu] = DrmBackend(tmp_path, VirtioSection()).discover()
    assert gpu.id == gpu.uuid == "GPU-8b2e4c1a-1f3d-4e5a-9b7c-0a1b2c3d4e5f"
    assert gpu.model == "NVIDIA GeForce RTX 4090"
    assert [n.path for n in gpu.device_nodes] == ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert gpu.numa_node == 1


def test_virtio_mmio_has_no_pci_vendor_and_is_found_by_driver(tmp_path: Path) -> None:
    virtio_vm(tmp_path)
    [gpu] = DrmBackend(tmp_path, VirtioSection()).discover()
    assert (gpu.vendor, gpu.id, gpu.model, gpu.pci_address) == (Vendor.VIRTIO, "virtio-card0", "Virtio-GPU", None)
    assert gpu.resource_name == "gpuppetti.dev/gpu"
    assert [n.path for n in gpu.device_nodes] == ["/dev/dri/renderD128"]


def test_virtio_marked_apple_by_the_config(tmp_path: Path) -> None:
    virtio_vm(tmp_path)
    section = config_from("""\
        version: v1
        virtio: {vendor: apple, model: Apple M3 Max, cores: 40, memory: 48Gi, vulkanDevice: "106b:e0a"}
        """).virtio
    [gpu] = DrmBackend(tmp_path, section).discover()
    assert (gpu.vendor, gpu.model, gpu.cores, gpu.memory_bytes) == (Vendor.APPLE, "Apple M3 Max", 40, 48 * 2**30)
    assert gpu.resource_name == "apple.com/gpu"
    assert gpu.pci_ids == ("106b", "0e0a")


@pytest.mark.parametrize(("given", "ids"), [("10005:0", ("10005", "0000")), ("106B:E0A", ("106b", "0e0a"))])
def test_vulkan_device_ids_are_32_bits(tmp_path: Path, given: str, ids: tuple[str, str]) -> None:
    """Mesa's own drivers (lavapipe, and Venus over it) report the Khronos vendor id 0x10005."""
    virtio_vm(tmp_path)
    section = config_from(f"version: v1\nvirtio: {{vendor: apple, vulkanDevice: \"{given}\"}}\n").virtio
    [gpu] = DrmBackend(tmp_path, section).discover()
    assert gpu.pci_ids == ids
    with pytest.raises(ConfigError, match="vulkanDevice"):
        config_from("version: v1\nvirtio: {vulkanDevice: \"123456789:0\"}\n")


def test_two_vendors_are_indexed_per_vendor(tmp_path: Path) -> None:
    two_vendor_machine(tmp_path)
    gpus = DrmBackend(tmp_path, VirtioSection()).discover()
    assert [(g.vendor, g.index) for g in gpus] == [(Vendor.INTEL, 0), (Vendor.AMD, 0)]


def test_device_nodes_missing_under_the_host_root_are_left_out(tmp_path: Path) -> None:
    amd_machine(tmp_path)
    (tmp_path / "dev/kfd").unlink()
    [gpu] = DrmBackend(tmp_path, VirtioSection()).discover()
    assert "/dev/kfd" not in [n.path for n in gpu.device_nodes]


def test_no_drm_directory(tmp_path: Path) -> None:
    backend = DrmBackend(tmp_path, VirtioSection())
    assert not backend.available()
    assert backend.discover() == []
    assert str(tmp_path / "sys/class/drm") in backend.looked_at()


def _fake_nvml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, devices: list[dict[str, object]], **state: object
) -> ModuleType:
    state_file = tmp_path / "nvml.json"
    state_file.write_text(json.dumps({"devices": devices, "events": str(tmp_path / "events"), **state}))
    monkeypatch.setenv("FAKE_NVML_STATE", str(state_file))
    spec = importlib.util.spec_from_file_location(f"fake_pynvml_{tmp_path.name}", FAKES / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H100 = {"uuid": "GPU-11111111-2222-3333-4444-555555555555", "name": "NVIDIA H100 80GB HBM3",
        "memory": 80 * 2**30, "minor": 3, "bus_id": "00000000:3B:00.0", "cores": 16896}


def test_nvml_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sys/bus/pci/devices/0000:3b:00.0").mkdir(parents=True)
    (tmp_path / "sys/bus/pci/devices/0000:3b:00.0/numa_node").write_text("1\n")
    backend = NvmlBackend(tmp_path, [13], module=_fake_nvml(tmp_path, monkeypatch, [H100]))
    assert backend.available()
    [gpu] = backend.discover()
    assert gpu.id == gpu.uuid == H100["uuid"]
    assert (gpu.model, gpu.memory_bytes, gpu.cores, gpu.index) == (H100["name"], 80 * 2**30, 16896, 0)
    assert [n.path for n in gpu.device_nodes] == ["/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert (gpu.pci_address, gpu.numa_node) == ("0000:3b:00.0", 1)


def test_nvml_without_a_driver_is_unavailable_with_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = NvmlBackend(tmp_path, [], module=_fake_nvml(tmp_path, monkeypatch, [], driver_loaded=False))
    assert not backend.available()
    assert "Driver Not Loaded" in backend.looked_at()


def test_nvml_xid_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = {**H100, "uuid": "GPU-other", "minor": 4, "bus_id": "00000000:86:00.0", "xid": False}
    backend = NvmlBackend(tmp_path, [13, 31], module=_fake_nvml(tmp_path, monkeypatch, [H100, other]))
    got: list[HealthEvent] = []
    stop = threading.Event()
    watcher = threading.Thread(target=backend.watch, args=(got.append, stop))
    watcher.start()
    try:
        events = tmp_path / "events"
        # Like NVML, the event set only sees events after it was created: keep sending until the watcher is in.
        for _ in range(100):
            with events.open("a") as f:
                f.write(f"{H100['uuid']} 13\n{H100['uuid']} 79\n")
            threading.Event().wait(0.05)
            if got:
                break
    finally:
        stop.set()
        watcher.join(5)
    assert not watcher.is_alive()
    assert got
    assert {(e.gpu_id, e.health, e.reason) for e in got} == {(H100["uuid"], Health.UNHEALTHY, "XID 79")}


def test_normalise_bus_id() -> None:
    assert normalise_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalise_bus_id("0000:3b:00.0") == "0000:3b:00.0"


def test_macos_parsers() -> None:
    [profiled] = parse_system_profiler((MACOS / "system_profiler.json").read_bytes())
    assert (profiled.model, profiled.vendor, profiled.cores, profiled.metal_family) == (
        "Apple M3 Max", Vendor.APPLE, 40, "metal3")
    [accelerator] = parse_ioreg((MACOS / "ioreg.plist").read_bytes())
    assert (accelerator.model, accelerator.cores) == ("Apple M3 Max", 40)
    assert (accelerator.utilization_percent, accelerator.in_use_memory_bytes) == (16, 568164352)


def test_macos_model_comes_from_sppci_model_not_the_localisation_key() -> None:
    raw = json.dumps({"SPDisplaysDataType": [
        {"_name": "kHW_AppleM1Item", "spdisplays_vendor": "sppci_vendor_Apple", "sppci_cores": "7",
         "sppci_device_type": "spdisplays_gpu", "sppci_model": "Apple M1"},
        {"_name": "Color LCD", "sppci_device_type": "spdisplays_display"},
    ]}).encode()
    [gpu] = parse_system_profiler(raw)
    assert (gpu.model, gpu.cores, gpu.metal_family) == ("Apple M1", 7, None)


def test_macos_backend_with_stand_in_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{MACOS}:/usr/bin:/bin")
    from gpuppetti.discovery.macos import MacosBackend

    [gpu] = MacosBackend().discover()
    assert (gpu.vendor, gpu.model, gpu.cores, gpu.memory_bytes) == (Vendor.APPLE, "Apple M3 Max", 40, 64 * 2**30)
    assert (gpu.metal_family, gpu.utilization_percent, gpu.backend) == ("metal3", 16, "macos")


def test_explicit_backend_that_cannot_run_says_why(tmp_path: Path) -> None:
    config = config_from("version: v1\n")
    with pytest.raises(BackendUnavailable, match=r"backend drm cannot run here: drm: .* does not exist"):
        backends_for(config, "drm", tmp_path)


def test_auto_merges_and_nvml_wins_for_nvidia(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvidia_machine(tmp_path)
    config = config_from("version: v1\nsimulated:\n  gpus:\n    - {model: Sim}\n")
    drm = DrmBackend(tmp_path, config.virtio)
    nvml = NvmlBackend(tmp_path, [], module=_fake_nvml(tmp_path, monkeypatch, [{**H100, "uuid": "GPU-real"}]))
    backends = backends_for(config, "simulated")
    gpus = discover([nvml, drm, *backends])
    assert [(g.id, g.backend) for g in gpus] == [("GPU-real", "nvml"), ("sim-other-0", "simulated")]


def test_the_host_nvml_library_is_loaded_by_path_under_a_host_root(tmp_path: Path) -> None:
    loaded: list[str] = []
    assert preload_host_library(tmp_path, loaded.append) is None, "no library under this root"
    library = tmp_path / "run/nvidia/driver/usr/lib64/libnvidia-ml.so.1"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    assert preload_host_library(tmp_path, loaded.append) == library
    assert loaded == [str(library)]
    assert preload_host_library(Path("/"), loaded.append) is None, "on the host the loader finds it by name"
    assert len(loaded) == 1


def test_the_found_line_names_a_few_gpus_and_counts_the_rest() -> None:
    config = config_from("version: v1\nbackend: simulated\nsimulated:\n"
                         "  gpus: [{model: M, vendor: apple, count: 1000}]\n")
    gpus = SimulatedBackend(config.simulated).discover()
    line = describe(gpus)
    assert line.startswith("sim-apple-0 (M), sim-apple-1 (M)") and line.endswith(" and 992 more"), line
    assert describe(gpus[:2]) == "sim-apple-0 (M), sim-apple-1 (M)"


@pytest.mark.skipif(sys.platform != "linux", reason="on Linux, where there is no system_profiler")
def test_the_macos_backend_named_where_it_cannot_run_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # On Linux without system_profiler: refused as --backend nvml is, not a log line and then the same again.
    from tests.helpers import run_here

    monkeypatch.setenv("PATH", "/nonexistent")
    result = run_here("discover", "--backend", "macos")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "gpuppetti: backend macos cannot run here: macos: this is not macOS (linux), and system_profiler is not "
        "on PATH"], result.stderr
