"""``gpuppetti doctor`` over fixture nodes: a host tree with GPUs and Vulkan drivers, the kubelet emulator's
sockets, a stand-in CRI runtime answering as containerd or CRI-O of a given version, and a running plugin."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuppetti.kubelet.emulator import KubeletEmulator
from gpuppetti.vulkanlayer import BUILT, LIBRARY, LayerDir
from tests.fixtures import amd_machine
from tests.helpers import TWO_M3_MAX, PluginProcess, run_cli, short_tmpdir
from tests.standins.cri import CriStandIn

pytestmark = pytest.mark.e2e

CDI_ON = {"enableCDI": True, "cdiSpecDirs": ["/etc/cdi", "/var/run/cdi"]}


@pytest.fixture
def node() -> Iterator[Path]:
    """A host root with an AMD GPU and Mesa's Vulkan driver, and the directories a kubelet node has."""
    import shutil

    root = short_tmpdir("gp-doc-")
    amd_machine(root / "host")
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
    as_json = run_cli(*args, "--json")
    text = run_cli(*args, env={"COLUMNS": "120"})
    assert "Traceback" not in as_json.stderr + text.stderr
    assert as_json.returncode == text.returncode
    return as_json.returncode, json.loads(as_json.stdout), text.stdout


def _by_check(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {result["check"]: result for result in results}


async def test_a_node_with_everything_in_place(
    node: Path, kubelet: KubeletEmulator, plugin_dir: Path, start_plugin: Callable[..., PluginProcess]
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
        "CDI directory": "ok", "Vulkan": "ok", "daemon": "ok",
        "Vulkan layer": "ok" if (BUILT / LIBRARY).exists() else "warn"}
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
    node: Path, start_plugin: Callable[..., PluginProcess], plugin_dir: Path
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
