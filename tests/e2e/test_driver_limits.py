"""NVIDIA's own memory limit through the device plugin and discover (issue 30): with the stand-in NVML saying
driver r615 and a stand-in container toolkit whose hook has apply-cuda-memory-limits, a time-sliced replica's
container carries NVIDIA_GPU_MEMORY_LIMIT and says it is held by the driver too; with an older driver it is not."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuppetti.kubelet.emulator import KubeletEmulator, Pod
from gpuppetti.layer.vulkan import BUILT, LIBRARY
from tests.fakes.toolkit import fake_toolkit
from tests.helpers import PluginProcess, fake_nvml_env, run_cli

pytestmark = pytest.mark.e2e

UUID = "GPU-aaaaaaaa-0000-1111-2222-333333333333"
GPU = {"uuid": UUID, "name": "NVIDIA H100 80GB HBM3", "memory": 80 * 2**30, "minor": 0, "bus_id": "00000000:3B:00.0"}
CONFIG = ("version: v1\nbackend: nvml\nsharing:\n  timeSlicing:\n"
          "    resources: [{name: nvidia.com/gpu, replicas: 4}]\n")
LAYER = "vulkan-layer+" if (BUILT / LIBRARY).exists() else ""


def _host(tmp_path: Path, driver: str) -> Path:
    fake_toolkit(tmp_path)
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"driver_version": driver, "devices": [GPU]}))
    return state


@pytest.mark.parametrize(("driver", "limit", "held"), [
    ("615.20.01", "20480", f"{LAYER}nvml"), ("580.95.05", None, LAYER.rstrip("+") or "none")])
async def test_a_replica_of_an_nvidia_gpu_carries_the_drivers_limit_where_the_node_has_it(
    kubelet: KubeletEmulator, start_plugin_process: Callable[..., PluginProcess], tmp_path: Path,
    driver: str, limit: str | None, held: str,
) -> None:
    state = _host(tmp_path, driver)
    start_plugin_process(CONFIG, "--host-root", str(tmp_path), env=fake_nvml_env(state))
    await kubelet.wait_registered("nvidia.com/gpu")
    [allocation] = await kubelet.admit(Pod.simple("cuda", "nvidia.com/gpu"))
    env = dict(allocation.response.envs)
    assert env.get("NVIDIA_GPU_MEMORY_LIMIT") == limit
    assert env["GPUPPETTI_ENFORCED_BY"] == held


def test_discover_says_the_driver_holds_the_slices(tmp_path: Path) -> None:
    state = _host(tmp_path, "615.20.01")
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    result = run_cli("discover", "--json", "--config", str(config), "--host-root", str(tmp_path),
                     env=fake_nvml_env(state))
    assert result.returncode == 0, result.stderr
    [record] = json.loads(result.stdout)
    assert record["enforced_by"] == f"{LAYER}nvml"
