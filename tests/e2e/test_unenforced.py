"""Where slices are not enforced, users are told where they look: /healthz (ready, with the reason), /metrics,
`discover`, `doctor` (✖ with the fix) and the demo (one line). An installation without the layer is the package
copied without its built files, put first on the path of the real CLI; one with it is this checkout's."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

import gpuppetti
from gpuppetti.kubelet.emulator import KubeletEmulator
from gpuppetti.layer.vulkan import BUILT, LIBRARY
from tests.helpers import TWO_M3_MAX, Daemon, PluginProcess, run_cli, run_here

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def without_layer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The env that runs an installation of this package that has no built layer."""
    root = tmp_path_factory.mktemp("layerless")
    shutil.copytree(Path(gpuppetti.__file__).parent, root / "gpuppetti",
                    ignore=shutil.ignore_patterns("_native", "__pycache__"))
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def ready_answer(plugin_dir: Path, plugin: Daemon) -> tuple[int, str, str]:
    url = await plugin.http_url()
    async with KubeletEmulator(plugin_dir) as kubelet:
        await kubelet.wait_registered("apple.com/gpu")
        async with asyncio.timeout(10):
            while (answer := await _get(f"{url}/healthz"))[0] != 200:
                await asyncio.sleep(0.02)
        return answer[0], answer[1], (await _get(f"{url}/metrics"))[1]


async def test_the_plugin_without_a_layer_is_ready_and_says_slices_are_not_enforced(
        plugin_dir: Path, start_plugin_process: Callable[..., PluginProcess], without_layer: dict[str, str]) -> None:
    status, text, metrics = await ready_answer(plugin_dir, start_plugin_process(TWO_M3_MAX, env=without_layer))
    assert status == 200
    assert text.startswith("ok: slices are not enforced: this installation has no built Vulkan layer"), text
    assert "gpuppetti_slices_enforced 0.0" in metrics.splitlines()


@pytest.mark.skipif(not (BUILT / LIBRARY).exists(), reason="the Vulkan layer is not built here (make native)")
async def test_the_plugin_with_the_layer_says_nothing_more(
        plugin_dir: Path, start_plugin: Callable[..., Daemon]) -> None:
    status, text, metrics = await ready_answer(plugin_dir, start_plugin(TWO_M3_MAX))
    assert (status, text) == (200, "ok\n")
    assert "gpuppetti_slices_enforced 1.0" in metrics.splitlines()


async def test_the_plugin_told_not_to_enforce_says_so(
        plugin_dir: Path, start_plugin: Callable[..., Daemon]) -> None:
    status, text, metrics = await ready_answer(
        plugin_dir, start_plugin(TWO_M3_MAX, "--vulkan-layer-dir", ""))
    assert (status, text) == (200, "ok: slices are not enforced: --vulkan-layer-dir is empty\n")
    assert "gpuppetti_slices_enforced 0.0" in metrics.splitlines()


def test_discover_says_whether_this_installation_enforces(without_layer: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(TWO_M3_MAX)
    unenforced = run_cli("discover", "--config", str(config), env={**without_layer, "COLUMNS": "80"})
    assert unenforced.returncode == 0, unenforced.stderr
    assert "slices are NOT enforced: this installation has no built Vulkan layer" in unenforced.stdout
    as_json = run_cli("discover", "--config", str(config), "--json", env=without_layer)
    assert as_json.returncode == 0
    assert "warning: slices are not enforced" in as_json.stderr
    if (BUILT / LIBRARY).exists():
        enforced = run_cli("discover", "--config", str(config))
        assert "slices can be enforced: this installation has the Vulkan layer" in enforced.stdout


def test_doctor_fails_the_layer_check_with_the_fix(without_layer: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(TWO_M3_MAX)
    result = run_cli("doctor", "--config", str(config), "--vulkan-layer-dir", str(tmp_path / "vulkan"),
                     env={**without_layer, "COLUMNS": "300"})
    assert result.returncode != 0
    [line] = [line for line in result.stdout.splitlines() if "Vulkan layer" in line]
    assert "✖" in line or "FAIL" in line.upper(), line
    assert "has no built Vulkan layer" in result.stdout
    assert "a C compiler and libvulkan-dev" in result.stdout


def test_the_demo_says_in_one_line_whether_slices_are_enforced(without_layer: dict[str, str]) -> None:
    result = run_cli("demo", env={**without_layer, "COLUMNS": "80"}, timeout=120)
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if "slices are" in line and "enforced" in line]
    assert line.startswith("slices are NOT enforced: this installation has no built Vulkan layer")
    assert len(line) <= 80


def test_the_plain_demo_runs_no_container_and_says_so() -> None:
    result = run_here("demo", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("slices are")]
    assert "each container is held" not in line, "no container runs without --runtime"
    assert line == "slices are enforced by the Vulkan layer, in containers (--runtime podman)"
