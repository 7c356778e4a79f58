"""The device plugin's CDI spec and its device list strategies."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuppetti.kubelet.emulator import KubeletEmulator, Pod
from tests.cdi_checks import spec_problems
from tests.fixtures import amd_machine
from tests.helpers import Daemon

pytestmark = pytest.mark.e2e


def _config(strategies: str) -> str:
    return f"version: v1\nbackend: drm\nplugin: {{deviceListStrategy: {strategies}}}\n"


async def test_cdi_cri_and_envvar(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    amd_machine(tmp_path / "host")
    cdi_dir = tmp_path / "cdi"
    start_plugin(_config("[envvar, cdi-cri]"), "--host-root", str(tmp_path / "host"), "--cdi-dir", str(cdi_dir))
    await kubelet.wait_registered("amd.com/gpu")
    spec = json.loads((cdi_dir / "gpu.gpuppetti.dev-gpu.json").read_text())
    assert spec_problems(spec) == []
    assert spec["cdiVersion"] == "0.3.0", "the lowest version its fields need; podman 4.3 rejects 0.6.0"
    assert spec["kind"] == "gpu.gpuppetti.dev/gpu"
    [device] = spec["devices"]
    assert device["name"] == "amd-0000-03-00.0"
    assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == [
        "/dev/dri/renderD128", "/dev/dri/card1", "/dev/kfd"]

    [allocation] = await kubelet.admit(Pod.simple("rocm", "amd.com/gpu"))
    response = allocation.response
    assert [d.name for d in response.cdi_devices] == ["gpu.gpuppetti.dev/gpu=amd-0000-03-00.0"]
    assert len(response.devices) == 3
    assert dict(response.envs)["ROCR_VISIBLE_DEVICES"] == "GPU-5e1d3f2a0b8c9d12"


async def test_cdi_only_leaves_device_nodes_to_the_runtime(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    amd_machine(tmp_path / "host")
    start_plugin(_config("cdi"), "--host-root", str(tmp_path / "host"), "--cdi-dir", str(tmp_path / "cdi"))
    await kubelet.wait_registered("amd.com/gpu")
    [allocation] = await kubelet.admit(Pod.simple("rocm", "amd.com/gpu"))
    assert len(allocation.response.devices) == 0
    assert [d.name for d in allocation.response.cdi_devices] == ["gpu.gpuppetti.dev/gpu=amd-0000-03-00.0"]
    assert "GPUPPETTI_SLICES" in allocation.response.envs


async def test_cdi_annotations(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    amd_machine(tmp_path / "host")
    start_plugin(_config("cdi-annotations"), "--host-root", str(tmp_path / "host"), "--cdi-dir",
                 str(tmp_path / "cdi"))
    await kubelet.wait_registered("amd.com/gpu")
    [allocation] = await kubelet.admit(Pod.simple("rocm", "amd.com/gpu"))
    annotations = dict(allocation.response.annotations)
    [(key, value)] = annotations.items()
    assert key.startswith("cdi.k8s.io/gpuppetti_amd.com_gpu_") and len(key.split("/", 1)[1]) <= 63
    assert value == "gpu.gpuppetti.dev/gpu=amd-0000-03-00.0"
    assert len(allocation.response.cdi_devices) == 0


async def test_no_spec_is_written_for_envvar_alone(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    amd_machine(tmp_path / "host")
    start_plugin(_config("envvar"), "--host-root", str(tmp_path / "host"), "--cdi-dir", str(tmp_path / "cdi"))
    await kubelet.wait_registered("amd.com/gpu")
    assert not (tmp_path / "cdi").exists()


async def test_the_spec_follows_gpus_coming_but_not_health(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    host = amd_machine(tmp_path / "host")
    cdi_dir = tmp_path / "cdi"
    start_plugin("version: v1\nbackend: drm\nhealth: {pollInterval: 50ms}\nplugin: {deviceListStrategy: cdi}\n",
                 "--host-root", str(tmp_path / "host"), "--cdi-dir", str(cdi_dir))
    endpoint = await kubelet.wait_registered("amd.com/gpu")
    spec_path = cdi_dir / "gpu.gpuppetti.dev-gpu.json"
    written = spec_path.stat().st_mtime_ns
    host.remove_card("card1")
    await kubelet.wait_for(lambda: set(endpoint.devices.values()) == {"Unhealthy"})
    host.restore_card("card1")
    await kubelet.wait_for(lambda: set(endpoint.devices.values()) == {"Healthy"})
    assert spec_path.stat().st_mtime_ns == written, "a health change does not rewrite the spec"
    host.pci_gpu(card=2, render=129, bdf="0000:43:00.0", vendor=0x1002, device=0x744C, driver="amdgpu", numa=1)
    await kubelet.wait_for(lambda: len(endpoint.devices) == 2)
    async with asyncio.timeout(10):
        while len(names := [d["name"] for d in json.loads(spec_path.read_text())["devices"]]) < 2:
            await asyncio.sleep(0.02)
    assert names == ["amd-0000-03-00.0", "amd-0000-43-00.0"]
