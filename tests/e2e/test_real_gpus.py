"""Discovery over fixture machines, as `gpuppetti discover` and as the plugin serves them to the kubelet."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuppetti.kubelet.emulator import KubeletEmulator, Pod
from tests.fixtures import MACHINES, RADEON_VRAM, amd_machine, nvidia_machine, virtio_vm
from tests.helpers import FAKES, Daemon, PluginProcess, fake_nvml_env, run_cli, run_here

pytestmark = pytest.mark.e2e


def _discover(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # A PYTHONPATH (the fake NVML module) needs a process of its own.
    if env is not None and "PYTHONPATH" in env:
        return run_cli("discover", *args, env=env)
    return run_here("discover", *args, env=env)


def _records(*args: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    result = _discover("--json", *args, env=env)
    assert result.returncode == 0, result.stderr
    records: list[dict[str, Any]] = json.loads(result.stdout)
    return records


KEYS = {"id", "vendor", "model", "cores", "memory_bytes", "device_nodes", "numa_node", "health", "backend"}


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_discover_reports_every_fixture_machine(machine: str, tmp_path: Path) -> None:
    MACHINES[machine](tmp_path)
    records = _records("--host-root", str(tmp_path), "--backend", "drm")
    assert records
    for record in records:
        assert record.keys() >= KEYS
        assert record["backend"] == "drm" and record["health"] == "Healthy"
        assert all(node.startswith("/dev/") for node in record["device_nodes"]), "host paths, never prefixed"
        assert not any(str(tmp_path) in node for node in record["device_nodes"])
    expected = {
        "amd": [("amd", "Navi 31 [Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M]", 0, "amd.com/gpu")],
        "intel": [("intel", "AlderLake-S GT1", None, "gpu.intel.com/i915"),
                  ("intel", "Battlemage G21 [Arc B580]", 0, "gpu.intel.com/i915")],
        "nvidia": [("nvidia", "NVIDIA GeForce RTX 4090", 1, "nvidia.com/gpu")],
        "virtio": [("virtio", "Virtio-GPU", None, "gpuppetti.dev/gpu")],
        "two-vendors": [("intel", "AlderLake-S GT1", None, "gpu.intel.com/i915"),
                        ("amd", "Navi 31 [Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M]", 0, "amd.com/gpu")],
    }[machine]
    assert [(r["vendor"], r["model"], r["numa_node"], r["resource"]) for r in records] == expected


def test_discover_amd_details(tmp_path: Path) -> None:
    amd_machine(tmp_path)
    [record] = _records("--host-root", str(tmp_path))
    assert record["memory_bytes"] == RADEON_VRAM
    assert record["device_nodes"] == ["/dev/dri/renderD128", "/dev/dri/card1", "/dev/kfd"]
    assert record["pci_address"] == "0000:03:00.0"


def test_discover_table(tmp_path: Path) -> None:
    amd_machine(tmp_path)
    # Wide enough for every column (tests/e2e/test_output_width.py checks the narrow ones).
    result = _discover("--host-root", str(tmp_path), env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    for text in ("Navi 31", "24 GiB", "/dev/kfd", "Healthy", "drm", "amd.com/gpu"):
        assert text in result.stdout


def test_discover_with_nothing_found_says_what_it_looked_at(tmp_path: Path) -> None:
    result = _discover("--host-root", str(tmp_path))
    assert result.returncode == 1
    assert "no GPUs found; looked at:" in result.stderr
    assert "simulated: the config lists no simulated.gpus" in result.stderr


def test_discover_macos_with_stand_in_commands() -> None:
    [record] = _records("--backend", "macos", env={"PATH": f"{FAKES / 'macos'}:/usr/bin:/bin"})
    assert (record["vendor"], record["model"], record["cores"]) == ("apple", "Apple M3 Max", 40)
    assert record["memory_bytes"] == 64 * 2**30
    assert (record["metal_family"], record["backend"], record["resource"]) == ("metal3", "macos", "apple.com/gpu")


async def test_plugin_serves_amd_with_its_container_edits(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    amd_machine(tmp_path)
    start_plugin(None, "--backend", "drm", "--host-root", str(tmp_path))
    endpoint = await kubelet.wait_registered("amd.com/gpu")
    assert endpoint.devices == {"amd-0000-03-00.0": "Healthy"}
    assert endpoint.topology == {"amd-0000-03-00.0": [0]}
    [allocation] = await kubelet.admit(Pod.simple("rocm", "amd.com/gpu"))
    env = dict(allocation.response.envs)
    assert env["ROCR_VISIBLE_DEVICES"] == "GPU-5e1d3f2a0b8c9d12"
    assert env["MESA_VK_DEVICE_SELECT"] == "1002:744c"
    assert env["GPUPPETTI_SHARING"] == "none"
    assert [(d.container_path, d.host_path, d.permissions) for d in allocation.response.devices] == [
        ("/dev/dri/renderD128", "/dev/dri/renderD128", "rw"),
        ("/dev/dri/card1", "/dev/dri/card1", "rw"),
        ("/dev/kfd", "/dev/kfd", "rw"),
    ]


async def test_plugin_serves_an_nvidia_card_without_nvml(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    nvidia_machine(tmp_path)
    start_plugin(None, "--backend", "drm", "--host-root", str(tmp_path))
    await kubelet.wait_registered("nvidia.com/gpu")
    [allocation] = await kubelet.admit(Pod.simple("cuda", "nvidia.com/gpu"))
    env = dict(allocation.response.envs)
    uuid = "GPU-8b2e4c1a-1f3d-4e5a-9b7c-0a1b2c3d4e5f"
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == uuid
    assert [d.host_path for d in allocation.response.devices] == ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]


async def test_intel_gets_the_level_zero_mask(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    MACHINES["intel"](tmp_path)
    start_plugin(None, "--backend", "drm", "--host-root", str(tmp_path))
    await kubelet.wait_registered("gpu.intel.com/i915")
    [both] = await kubelet.admit(Pod.simple("oneapi", "gpu.intel.com/i915", 2))
    env = dict(both.response.envs)
    assert env["ZE_AFFINITY_MASK"] == "0,1"
    assert "MESA_VK_DEVICE_SELECT" not in env, "vid:did cannot pick two GPUs"
    assert sorted(d.host_path for d in both.response.devices) == [
        "/dev/dri/card0", "/dev/dri/card1", "/dev/dri/renderD128", "/dev/dri/renderD129"
    ]


APPLE_VM = """\
version: v1
backend: drm
virtio: {vendor: apple, model: Apple M3 Max, cores: 40, memory: 48Gi}
sharing:
  timeSlicing:
    resources:
      - {name: apple.com/gpu, replicas: 4}
"""


async def test_apple_gpu_in_a_krunkit_vm(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    virtio_vm(tmp_path)
    start_plugin(APPLE_VM, "--host-root", str(tmp_path))
    endpoint = await kubelet.wait_registered("apple.com/gpu")
    assert sorted(endpoint.devices) == [f"virtio-card0::{n}" for n in range(4)]
    [allocation] = await kubelet.admit(Pod.simple("llama", "apple.com/gpu"))
    env = dict(allocation.response.envs)
    assert env["GGML_VK_VISIBLE_DEVICES"] == "0"
    assert env["GPUPPETTI_SHARING"] == "time-slicing"
    assert [d.host_path for d in allocation.response.devices] == ["/dev/dri/renderD128"]


async def test_a_vanishing_gpu_turns_unhealthy_and_recovers(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    host = amd_machine(tmp_path)
    start_plugin("version: v1\nbackend: drm\nhealth: {pollInterval: 50ms}\n", "--host-root", str(tmp_path))
    endpoint = await kubelet.wait_registered("amd.com/gpu")
    host.remove_card("card1")
    await kubelet.wait_for(lambda: endpoint.devices == {"amd-0000-03-00.0": "Unhealthy"})
    assert kubelet.capacity("amd.com/gpu") == 1 and kubelet.allocatable("amd.com/gpu") == 0
    host.restore_card("card1")
    await kubelet.wait_for(lambda: endpoint.devices == {"amd-0000-03-00.0": "Healthy"})


async def test_a_gpu_that_appears_is_added(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    host = amd_machine(tmp_path)
    start_plugin("version: v1\nbackend: drm\nhealth: {pollInterval: 50ms}\n", "--host-root", str(tmp_path))
    endpoint = await kubelet.wait_registered("amd.com/gpu")
    host.pci_gpu(card=2, render=129, bdf="0000:43:00.0", vendor=0x1002, device=0x744C, driver="amdgpu", numa=1)
    await kubelet.wait_for(lambda: len(endpoint.devices) == 2)
    assert endpoint.devices["amd-0000-43-00.0"] == "Healthy"
    assert endpoint.topology["amd-0000-43-00.0"] == [1]


NVML_UUID = "GPU-aaaaaaaa-0000-1111-2222-333333333333"
NVML_GPU = {"uuid": NVML_UUID, "name": "NVIDIA H100 80GB HBM3",
            "memory": 80 * 2**30, "minor": 0, "bus_id": "00000000:3B:00.0"}


async def test_nvml_xid_marks_unhealthy_at_once_and_recovers_after_a_quiet_period(
    kubelet: KubeletEmulator, start_plugin_process: Callable[..., PluginProcess], tmp_path: Path
) -> None:
    state = tmp_path / "nvml.json"
    events = tmp_path / "xid-events"
    state.write_text(json.dumps({"devices": [NVML_GPU], "events": str(events)}))
    # A process of its own: the fake NVML module comes through its PYTHONPATH.
    plugin = start_plugin_process(
        "version: v1\nbackend: nvml\nhealth: {recoveryPeriod: 1s, ignoredXids: [13, 43]}\n",
        "--host-root", str(tmp_path), env=fake_nvml_env(state),
    )
    endpoint = await kubelet.wait_registered("nvidia.com/gpu")
    assert endpoint.devices == {NVML_UUID: "Healthy"}
    [allocation] = await kubelet.admit(Pod.simple("cuda", "nvidia.com/gpu"))
    assert dict(allocation.response.envs)["CUDA_VISIBLE_DEVICES"] == NVML_UUID
    assert [d.host_path for d in allocation.response.devices] == ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]

    # The watcher only sees events after it registered; keep sending until it reacts.
    async def xid(number: int, until: Callable[[], bool]) -> None:
        for _ in range(100):
            with events.open("a") as f:
                f.write(f"{NVML_UUID} {number}\n")
            try:
                await kubelet.wait_for(until, timeout=0.1)
                return
            except TimeoutError:
                continue
        raise AssertionError(f"XID {number} never reached the kubelet:\n{plugin.log()}")

    await xid(79, lambda: endpoint.devices[NVML_UUID] == "Unhealthy")
    assert "XID 79" in plugin.log()
    await kubelet.wait_for(lambda: endpoint.devices[NVML_UUID] == "Healthy", timeout=10)
    assert "ignoring XID" not in plugin.log()

    with events.open("a") as f:
        f.write(f"{NVML_UUID} 43\n")
    await plugin.wait_for_log("ignoring XID 43")
    assert endpoint.devices[NVML_UUID] == "Healthy"
