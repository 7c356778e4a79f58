"""gpuppetti top, through the real CLI, against a running device plugin: who holds each slice and how much of it."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuppetti.deviceplugin.enforcement import allocation_id
from gpuppetti.kubelet.emulator import KubeletEmulator, Pod
from gpuppetti.node.vulkanlayer import BUILT, LIBRARY
from tests.helpers import TWO_M3_MAX, Daemon, run_cli

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not (BUILT / LIBRARY).exists(), reason="the Vulkan layer is not built here")]

MIB = 2**20




async def test_top_shows_who_holds_each_slice_and_how_much(
        plugin_dir: Path, start_plugin: Callable[..., Daemon]) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    url = await plugin.http_url()
    # The kubelet's PodResources API beside its device plugin directory, as on a node.
    sockets = plugin_dir.parent / "pod-resources" / "kubelet.sock"
    async with KubeletEmulator(plugin_dir, pod_resources=sockets) as kubelet:
        await kubelet.wait_registered("apple.com/gpu")
        [allocation] = await kubelet.admit(Pod.simple("trainer", "apple.com/gpu"))
        layer_dir = Path(next(m.host_path for m in allocation.response.mounts
                              if m.container_path == "/run/gpuppetti/vulkan"))
        assert layer_dir.name == allocation_id(allocation.device_ids)
        with open(layer_dir / "slice-0.acct", "r+b") as acct:  # noqa: ASYNC230 (a small write, as a container would)
            acct.seek(24)
            acct.write(struct.pack("<q", 3 * 1024 * MIB))
        # The plugin asks the kubelet whose container the units went to shortly after the Allocate.
        async with asyncio.timeout(15):
            while True:
                shown = await asyncio.to_thread(run_cli, "top", "--from", url, "--json")
                assert shown.returncode == 0, shown.stderr
                [held] = json.loads(shown.stdout)["slices"]
                if held["pod"]:
                    break
                await asyncio.sleep(0.2)
        table = await asyncio.to_thread(run_cli, "top", "--from", url, "--once", env={"COLUMNS": "80"})
    assert held == {"namespace": "default", "pod": "trainer", "container": "main", "gpu": allocation.device_ids[0]
                    .partition("::")[0], "unit": allocation.device_ids[0], "budget_bytes": 12 * 1024 * MIB,
                    "used_bytes": 3 * 1024 * MIB, "compute_wait_seconds": 0.0}
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    [row] = [line for line in lines if "default/trainer/main" in line]
    assert "3 GiB" in row and "12 GiB" in row and "██░░░░░░░░" in row, "a quarter of the budget, as a bar"
    assert any("sim-apple-0" in line and "1 of 4 slice(s) held, 3 GiB in use" in line for line in lines)


def test_top_says_in_one_line_when_the_endpoint_is_not_a_daemon() -> None:
    result = run_cli("top", "--from", "http://127.0.0.1:9", "--once")
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
