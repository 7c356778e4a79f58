"""gpuppetti top, through the real CLI, against a running device plugin: who holds each slice and how much of it."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuppetti.deviceplugin.enforcement import allocation_id
from gpuppetti.kubelet.emulator import KubeletEmulator, Pod
from gpuppetti.layer.vulkan import BUILT, LIBRARY
from tests.helpers import TWO_M3_MAX, Daemon, DaemonProcess, run_cli
from tests.ledger_client import Process

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
        # A process of the container holding 3 GiB, alive until the figures are read.
        live = await asyncio.to_thread(Process, layer_dir)
        assert await asyncio.to_thread(live.reserve, 3 * 1024 * MIB)
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
        live.close()
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


async def test_top_shows_the_demos_slices_while_it_keeps_running(tmp_path: Path) -> None:
    # The demo and top take their address from the env var the daemons share, as top's default --from does.
    demo = DaemonProcess(["demo", "--keep-running"], None, tmp_path, "demo",
                         env={"GPUPPETTI_HTTP_ADDRESS": "127.0.0.1:0", "COLUMNS": "200"})
    try:
        await demo.wait_for_log("The demo keeps running")
        [address] = re.findall(r"serving http://(127\.0\.0\.1:\d+) ", demo.log())
        assert f"gpuppetti top --from http://{address} in another terminal" in demo.log()
        async with asyncio.timeout(30):
            while True:
                shown = await asyncio.to_thread(run_cli, "top", "--json", env={"GPUPPETTI_HTTP_ADDRESS": address})
                assert shown.returncode == 0, shown.stderr
                slices = json.loads(shown.stdout)["slices"]
                if all(record["pod"] for record in slices):
                    break
                await asyncio.sleep(0.2)
        # Seven pods admitted, the seventh with a slice of each GPU; the eighth found none left.
        assert sorted((record["pod"], record["unit"]) for record in slices) == [
            *((f"gpu-pod-{n + 1}", f"sim-apple-{n % 2}::{n // 2}") for n in range(6)),
            ("gpu-pod-7", "sim-apple-0::3"), ("gpu-pod-7", "sim-apple-1::3")]
        assert {(record["namespace"], record["container"], record["budget_bytes"]) for record in slices} == {
            ("default", "main", 12 * 1024 * MIB)}
        assert await demo.stop(signal.SIGINT) == 0, demo.log()
    finally:
        await demo.close()


def test_the_demo_says_in_one_line_when_its_address_is_taken() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("demo", "--keep-running", "--http-address", f"127.0.0.1:{port}")
    assert result.returncode == 1, result.stdout
    assert result.stderr.startswith(f"gpuppetti: --http-address: cannot listen on 127.0.0.1:{port}: ")
    assert len(result.stderr.splitlines()) == 1 and "give the demo another address" in result.stderr
