"""The macOS host agent (on Linux, with stand-in commands), its token, and the plugin taking its facts."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpuppetti.hostagent import API_PATH, token
from gpuppetti.hostagent.client import fetch
from gpuppetti.kubelet.emulator import KubeletEmulator, Pod
from tests.e2e.piecemeal import PiecemealServer
from tests.fixtures import virtio_vm
from tests.helpers import FAKES, TWO_M3_MAX, Daemon, DaemonProcess, run_cli
from tests.standins.apiserver import ApiStandIn

pytestmark = pytest.mark.e2e
MACOS_PATH = f"{FAKES / 'macos'}:/usr/bin:/bin"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_agent(workdir: Path, port: int, name: str = "agent") -> DaemonProcess:
    return DaemonProcess(["host-agent", "--listen", f"127.0.0.1:{port}", "--token-file", str(workdir / "token"),
                          "--interval", "0.2"], None, workdir, name, env={"PATH": MACOS_PATH})


async def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers or {}) as response:
        return response.status, await response.json(content_type=None)


async def test_the_token_protects_the_agent(tmp_path: Path) -> None:
    port = _free_port()
    agent = start_agent(tmp_path, port)
    await agent.wait_for_log("host agent serving /v1/gpus")
    secret = (tmp_path / "token").read_text().strip()
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600
    assert ("kubectl create secret generic gpuppetti-host-agent --namespace gpuppetti "
            f"--from-file=token={tmp_path / 'token'}") in agent.log()
    assert secret not in agent.log(), "the token lands in no log: the command reads the file"
    url = f"http://127.0.0.1:{port}/v1/gpus"

    status, body = await _get(url)
    assert status == 401 and "gpus" not in body
    status, body = await _get(url, {"Authorization": "Bearer not-the-token"})
    assert status == 401 and "gpus" not in body
    status, body = await _get(url, {"Authorization": secret})
    assert status == 401
    status, body = await _get(url, {"Authorization": f"Bearer {secret}"})
    assert status == 200
    [gpu] = body["gpus"]
    assert (gpu["model"], gpu["vendor"], gpu["cores"]) == ("Apple M3 Max", "apple", 40)
    assert gpu["unified_memory_bytes"] == 64 * 2**30
    assert (gpu["metal_family"], gpu["utilization_percent"], gpu["in_use_memory_bytes"]) == ("metal3", 16, 568164352)
    assert await agent.stop() == 0

    # A second start reuses the token and prints it no more.
    again = start_agent(tmp_path, port, "agent-again")
    await again.wait_for_log("host agent serving /v1/gpus")
    assert (tmp_path / "token").read_text().strip() == secret
    assert "kubectl create secret" not in again.log()
    await again.stop()


async def test_held_connections_and_requests_without_the_token_leave_the_agent_answering(tmp_path: Path) -> None:
    # At launchd's soft limit of 256 descriptors: 400 connections that say nothing, and 1,000 requests without the
    # token. Every ask with the token is answered at once, and the refusals are said in a line or two, not each.
    port = _free_port()
    agent = DaemonProcess(["host-agent", "--listen", f"127.0.0.1:{port}", "--token-file", str(tmp_path / "token"),
                           "--interval", "0.2"], None, tmp_path, "agent", env={"PATH": MACOS_PATH}, open_files=256)
    held: list[asyncio.StreamWriter] = []
    try:
        await agent.wait_for_log("host agent serving /v1/gpus")
        secret = (tmp_path / "token").read_text().strip()
        for _ in range(400):
            held.append((await asyncio.open_connection("127.0.0.1", port))[1])
        request = f"GET {API_PATH} HTTP/1.1\r\nhost: x\r\n\r\n".encode()
        for _ in range(1000):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            assert (await reader.read()).startswith(b"HTTP/1.1 401")
            writer.close()
        # The token is checked once the headers are in: a body that is announced and never sent waits for nothing.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {API_PATH} HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000\r\n\r\n".encode())
        async with asyncio.timeout(1.0):
            assert (await reader.readline()).startswith(b"HTTP/1.1 401")
        writer.close()
        for _ in range(10):
            async with asyncio.timeout(1.0):
                status, body = await _get(f"http://127.0.0.1:{port}{API_PATH}", {"Authorization": f"Bearer {secret}"})
            assert status == 200 and body["gpus"]
        assert agent.running()
        refusals = [line for line in agent.log().splitlines() if "without the right token" in line]
        assert len(refusals) == 1 and "refused 1 request without the right token" in refusals[0], refusals
        assert len(agent.log().splitlines()) < 20, agent.log()[-3000:]
    finally:
        for writer in held:
            writer.close()
        agent.kill()


def test_token_helpers(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "token"
    value, created = token.load_or_create(path)
    assert created and len(value) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token.load_or_create(path) == (value, False)
    assert token.matches(value, f"Bearer {value}")
    assert not token.matches(value, f"Bearer {value}x")
    assert not token.matches(value, None)
    assert not token.matches(value, value)

    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(token.TokenFileError, match="is empty"):
        token.load_or_create(empty)
    assert empty.read_text() == "\n", "an empty token file is never overwritten"


async def test_an_agent_with_no_gpu_answers_503_and_says_so(tmp_path: Path) -> None:
    port = _free_port()
    # No stand-in macOS commands on the PATH: nothing to find.
    agent = DaemonProcess(["host-agent", "--listen", f"127.0.0.1:{port}", "--token-file", str(tmp_path / "token")],
                          None, tmp_path, "no-gpu-agent", env={"PATH": "/usr/bin:/bin"})
    await agent.wait_for_log("host agent serving /v1/gpus")
    assert "no GPU found here" in agent.log()
    secret = (tmp_path / "token").read_text().strip()
    status, body = await _get(f"http://127.0.0.1:{port}/v1/gpus", {"Authorization": f"Bearer {secret}"})
    assert status == 503
    assert body["gpus"] == [] and body["error"]
    assert await agent.stop() == 0


async def test_the_agents_answer_is_taken_whole_when_it_arrives_in_pieces() -> None:
    # As over a real network between the VM and the Mac: the answer in pieces, with pauses.
    document = {"gpus": [{"vendor": "apple", "model": "Apple M3 Max", "cores": 40,
                          "unified_memory_bytes": 64 * 2**30, "utilization_percent": 16}]}
    async with PiecemealServer({API_PATH: json.dumps(document).encode()}, piece=16, pause=0.01) as agent:
        facts = await fetch(agent.url, "a-token")
    assert agent.pieces_sent > 5
    assert (facts.model, facts.cores, facts.memory_bytes, facts.utilization_percent, facts.source) == (
        "Apple M3 Max", 40, 64 * 2**30, 16, "host-agent")


APPLE_VM = """\
version: v1
backend: drm
health: {pollInterval: 100ms}
virtio: {vendor: apple, model: From the config, cores: 20, memory: 8Gi}
hostAgent: {pollInterval: 200ms}
sharing:
  timeSlicing:
    resources:
      - {name: apple.com/gpu, replicasPerCores: 10}
"""


async def test_the_plugin_takes_the_agents_facts_and_keeps_them_when_it_goes(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    virtio_vm(tmp_path / "host")
    port = _free_port()
    token_file = tmp_path / "token"
    token.load_or_create(token_file)
    url = f"http://127.0.0.1:{port}"
    # The agent is not there yet: the config's facts are served (20 cores, so 2 slices), and the log says why.
    plugin = start_plugin(APPLE_VM, "--host-root", str(tmp_path / "host"), "--host-agent", url,
                          "--host-agent-token-file", str(token_file))
    endpoint = await kubelet.wait_registered("apple.com/gpu")
    assert sorted(endpoint.devices) == ["virtio-card0::0", "virtio-card0::1"]
    await plugin.wait_for_log("serving the config's virtio facts")

    agent = start_agent(tmp_path, port)
    await kubelet.wait_for(lambda: len(endpoint.devices) == 4, timeout=15)
    assert sorted(endpoint.devices) == [f"virtio-card0::{n}" for n in range(4)]
    [allocation] = await kubelet.admit(Pod.simple("llama", "apple.com/gpu"))
    assert dict(allocation.response.envs)["GPUPPETTI_REPLICAS"] == "4"

    record = _discover(tmp_path, url, token_file)
    assert (record["vendor"], record["model"], record["cores"], record["facts"]) == (
        "apple", "Apple M3 Max", 40, "host-agent")
    assert record["memory_bytes"] == 64 * 2**30

    metrics_url = await plugin.http_url()
    async with aiohttp.ClientSession() as session, session.get(f"{metrics_url}/metrics") as response:
        metrics = await response.text()
    assert 'gpuppetti_gpu_utilization_percent{gpu="virtio-card0",model="Apple M3 Max"} 16.0' in metrics

    # The agent goes away: the GPU stays, with the facts the agent last gave, marked stale.
    await agent.stop()
    await plugin.wait_for_log("marked stale")
    await asyncio.sleep(0.5)
    assert len(endpoint.devices) == 4 and set(endpoint.devices.values()) == {"Healthy"}
    one_shot = _discover(tmp_path, url, token_file)
    assert one_shot["facts"] == "config", "a one-shot discover has only the config when the agent is gone"
    # What the running plugin serves: the agent's last facts, marked stale.
    async with asyncio.timeout(10):
        while (served := await _discover_from(metrics_url))["facts"] != "host-agent (stale)":
            await asyncio.sleep(0.1)
    assert (served["model"], served["cores"], served["health"]) == ("Apple M3 Max", 40, "Healthy")

    # And comes back.
    back = start_agent(tmp_path, port, "agent-back")
    await back.wait_for_log("host agent serving")
    await plugin.wait_for_log("Apple M3 Max, 40 cores", timeout=15)
    assert len(endpoint.devices) == 4
    await back.stop()


async def _discover_from(url: str) -> dict[str, Any]:
    # In a thread: the plugin that answers runs in this event loop.
    result = await asyncio.to_thread(run_cli, "discover", "--json", "--from", url)
    assert result.returncode == 0, result.stderr
    [record] = json.loads(result.stdout)
    return dict(record)


def _discover(tmp_path: Path, url: str, token_file: Path) -> dict[str, Any]:
    config = tmp_path / "discover.yaml"
    config.write_text(APPLE_VM)
    result = run_cli("discover", "--json", "--config", str(config), "--host-root", str(tmp_path / "host"),
                     "--host-agent", url, "--host-agent-token-file", str(token_file))
    assert result.returncode == 0, result.stderr
    [record] = json.loads(result.stdout)
    return dict(record)


async def test_node_labels(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], tmp_path: Path
) -> None:
    api = ApiStandIn()
    await api.start()
    try:
        await api.create("nodes", {"apiVersion": "v1", "kind": "Node",
                                   "metadata": {"name": "node1", "labels": {"kubernetes.io/os": "linux"}}})
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(api.kubeconfig())
        plugin = start_plugin(TWO_M3_MAX, "--label-node", "--node-name", "node1", "--kubeconfig", str(kubeconfig))
        await kubelet.wait_registered("apple.com/gpu")

        def labels() -> dict[str, str]:
            node = api.get("nodes", "node1")
            assert node is not None
            return dict(node["metadata"].get("labels") or {})

        async def wait_labels(predicate: Callable[[dict[str, str]], bool]) -> dict[str, str]:
            async with asyncio.timeout(10):
                while not predicate(current := labels()):
                    await asyncio.sleep(0.02)
            return current

        current = await wait_labels(lambda found: "gpuppetti.dev/gpu.model" in found)
        assert current == {
            "kubernetes.io/os": "linux",
            "gpuppetti.dev/gpu.present": "true",
            "gpuppetti.dev/gpu.vendor": "apple",
            "gpuppetti.dev/gpu.model": "Apple-M3-Max",
            "gpuppetti.dev/gpu.cores": "40",
            "gpuppetti.dev/gpu.memory": "49152",
            "gpuppetti.dev/gpu.count": "2",
            "gpuppetti.dev/gpu.replicas": "4",
            "gpuppetti.dev/gpu.sharing-strategy": "time-slicing",
        }
        plugin.write_config(TWO_M3_MAX.replace("replicas: 4", "replicas: 8"))
        plugin.send(signal.SIGHUP)
        await wait_labels(lambda found: found.get("gpuppetti.dev/gpu.replicas") == "8")
        # The GPUs go away: the plugin removes its own labels and leaves the others.
        plugin.write_config("version: v1\n")
        plugin.send(signal.SIGHUP)
        await wait_labels(lambda found: not any(k.startswith("gpuppetti.dev/") for k in found))
        assert labels() == {"kubernetes.io/os": "linux"}
    finally:
        await api.stop()
