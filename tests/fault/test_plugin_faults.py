"""The device plugin, the HTTP endpoint and the commands under faults: a directory that misbehaves, clients that
never read, storms of kubelet restarts, huge requests, idle connections, early signals, a hostile host agent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from gpuppetti.deviceplugin.enforcement import allocation_id
from gpuppetti.kubelet.emulator import KubeletEmulator, Pod
from gpuppetti.layer.vulkan import BUILT, LIBRARY
from tests.helpers import TWO_M3_MAX, Daemon, PluginProcess, flood_endpoint

pytestmark = pytest.mark.fault
APPLE = "apple.com/gpu"
SOCKET = "gpuppetti-apple.com_gpu.sock"


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1)) / 1024  # type: ignore[union-attr]


# -- 10. every condition of the directory is a state to wait out ---------------------------------------------------


async def test_a_missing_directory_a_squatting_directory_and_a_link_loop_are_waited_out(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], plugin_dir: Path
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)
    # The directory goes away for two seconds (the kubelet's with it), then comes back.
    await kubelet.stop()
    shutil.rmtree(plugin_dir)
    await asyncio.sleep(2.0)
    plugin_dir.mkdir(exist_ok=True)
    await kubelet.start()
    await kubelet.wait_registered(APPLE, count=2, timeout=15)
    assert plugin.running()

    # A directory squats on the socket's name.
    await kubelet.stop(remove_socket=False)
    (plugin_dir / SOCKET).unlink()
    (plugin_dir / SOCKET).mkdir()
    await plugin.wait_for_log("is a directory; the socket cannot be created there")
    assert plugin.running()
    (plugin_dir / SOCKET).rmdir()

    # kubelet.sock is a symlink loop.
    (plugin_dir / "kubelet.sock").unlink(missing_ok=True)
    (plugin_dir / "loop-a").symlink_to(plugin_dir / "loop-b")
    (plugin_dir / "loop-b").symlink_to(plugin_dir / "loop-a")
    (plugin_dir / "kubelet.sock").symlink_to(plugin_dir / "loop-a")
    await plugin.wait_for_log("cannot be reached")
    assert plugin.running()
    (plugin_dir / "kubelet.sock").unlink()
    await kubelet.start()
    await kubelet.wait_registered(APPLE, count=3, timeout=15)
    assert plugin.running()


def test_a_socket_deleted_as_soon_as_it_appears_never_kills_the_plugin(plugin_dir: Path) -> None:
    # Deleting the socket between bind and chmod: a thread removes it the moment it exists, for a while.
    stop = threading.Event()
    deleted = 0

    def remover() -> None:
        nonlocal deleted
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(plugin_dir / SOCKET)
                deleted += 1

    thread = threading.Thread(target=remover, daemon=True)
    thread.start()
    plugin = PluginProcess(TWO_M3_MAX, plugin_dir)
    try:
        # For a while once the plugin has begun making its socket (on a busy machine, its start takes a while).
        deadline = time.monotonic() + 30
        while deleted == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)
        stop.set()
        thread.join()
        assert deleted > 0
        assert plugin.running(), plugin.log()[-3000:]

        async def registers() -> None:
            async with KubeletEmulator(plugin_dir) as kubelet:
                await kubelet.wait_registered(APPLE, timeout=15)

        asyncio.run(registers())
    finally:
        plugin.kill()


# -- 11. clients that never read ---------------------------------------------------------------------------------


async def test_listandwatch_clients_that_never_read_cost_bounded_memory(
    kubelet: KubeletEmulator, start_plugin_process: Callable[..., PluginProcess], plugin_dir: Path
) -> None:
    many = TWO_M3_MAX.replace("count: 2", "count: 100").replace("replicas: 4", "replicas: 100")
    plugin = start_plugin_process(many)
    await kubelet.wait_registered(APPLE, timeout=30)
    before = _rss_mib(plugin.pid)
    channels = []
    calls = []
    for _ in range(40):
        channel = grpc.aio.insecure_channel(f"unix:{plugin_dir / SOCKET}")
        channels.append(channel)
        stub = pb_grpc.DevicePluginStub(channel)
        for _ in range(25):
            calls.append(stub.ListAndWatch(pb.Empty()))  # opened, never read
    await asyncio.sleep(2.0)
    # Every health flip sends a list of 10,000 devices to every stream that is still open.
    for n in range(6):
        health = "Unhealthy" if n % 2 == 0 else "Healthy"
        plugin.write_config(many.replace("numaNode: 0", f"numaNode: 0, health: {health}"))
        plugin.send(signal.SIGHUP)
        await asyncio.sleep(0.5)
    grown = _rss_mib(plugin.pid) - before
    for call in calls:
        call.cancel()
    for channel in channels:
        await channel.close()
    assert grown < 60, f"memory grew by {grown:.0f} MiB"
    assert "ending the oldest" in plugin.log()
    assert plugin.running()
    # The kubelet's own stream was ended by the newer ones; it registers again and gets its list.
    endpoint = await kubelet.wait_registered(APPLE, timeout=30)
    assert endpoint.connected


# -- 12. storms of kubelet restarts ------------------------------------------------------------------------------


@pytest.mark.timeout(600)
async def test_after_any_storm_of_restarts_the_plugin_registers_within_a_second(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    start_plugin(TWO_M3_MAX)
    endpoint = await kubelet.wait_registered(APPLE)
    for storm in range(20):
        async def allocate_forever() -> None:
            while True:
                with contextlib.suppress(grpc.aio.AioRpcError, AttributeError):
                    current = kubelet.endpoints.get(APPLE)
                    if current is not None:
                        request = pb.AllocateRequest()
                        request.container_requests.add(devices_ids=["sim-apple-0::0"])
                        await current.stub.Allocate(request, timeout=1)
                await asyncio.sleep(0)

        allocating = asyncio.ensure_future(allocate_forever())
        try:
            for _ in range(50):
                await kubelet.restart()
                await asyncio.sleep(0.01)
        finally:
            allocating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await allocating
        settled = time.monotonic()
        count = kubelet.registrations(APPLE)

        def fresh() -> bool:
            endpoint = kubelet.endpoints.get(APPLE)
            last = [e for e in kubelet.events if e.kind == "kubelet-started"][-1]
            return (endpoint is not None and endpoint.connected and endpoint.updates > 0
                    and any(e.kind == "registered" and e.at >= last.at for e in kubelet.events))

        await kubelet.wait_for(fresh, timeout=5)
        took = time.monotonic() - settled
        assert took < 1.0, f"storm {storm}: registered again only after {took:.2f}s"
        assert kubelet.registrations(APPLE) >= count
        assert len(kubelet.endpoints[APPLE].devices) == 8
    assert endpoint is not None


# -- 13. huge requests -------------------------------------------------------------------------------------------


async def test_huge_allocate_requests_get_invalid_argument_naming_a_few_ids(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    endpoint = await kubelet.wait_registered(APPLE)
    for ids in ([f"unknown-{n}" for n in range(100_000)], ["x" * 3_000_000]):
        request = pb.AllocateRequest()
        request.container_requests.add(devices_ids=ids)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await endpoint.stub.Allocate(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.code()
        assert len(caught.value.details() or "") < 1000
    assert "and 99995 more (100000 in all)" in plugin.log()
    assert max(len(line) for line in plugin.log().splitlines()) < 2000, "no log line of megabytes"


# -- 14. idle connections to the HTTP endpoint --------------------------------------------------------------------


async def test_twenty_idle_connections_leave_the_probes_answering(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon]
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE)
    url = await plugin.http_url()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    idle = [await asyncio.open_connection(host, int(port)) for _ in range(20)]
    dripping = await asyncio.open_connection(host, int(port))
    dripping[1].write(b"GET /healthz HTTP/1.1\r\n")
    try:
        for path in ("/healthz", "/livez", "/metrics"):
            began = time.monotonic()
            status, _ = await asyncio.wait_for(asyncio.to_thread(_get, url + path), 3)
            assert status == 200 and time.monotonic() - began < 1.0
    finally:
        for _, writer in [*idle, dripping]:
            writer.close()


async def test_held_connections_and_abandoned_scrapes_leave_allocate_fast(plugin_dir: Path) -> None:
    # At a container runtime's soft limit of 1,024 descriptors: 1,500 connections that say nothing, then 3,000
    # scrapes whose clients give up at once. Every Allocate still succeeds at once, and the log stays small.
    plugin = PluginProcess(TWO_M3_MAX, plugin_dir, open_files=1024)
    held: list[asyncio.StreamWriter] = []
    try:
        async with KubeletEmulator(plugin_dir) as kubelet:
            # A process of its own, started beside other tests on two cores: its start is not what is judged.
            await kubelet.wait_registered(APPLE, timeout=60)
            host, port = (await plugin.http_url()).removeprefix("http://").rsplit(":", 1)
            await flood_endpoint(host, int(port), held)
            for n in range(7):
                began = time.monotonic()
                await kubelet.admit(Pod.simple(f"p{n}", APPLE, 1))
                assert time.monotonic() - began < 1.0, f"Allocate {n} took {time.monotonic() - began:.1f}s"
                kubelet.release(f"p{n}")
            _, page = await asyncio.to_thread(_get, f"http://{host}:{port}/metrics")
            assert 'gpuppetti_allocate_requests_total{resource="apple.com/gpu",result="ok"} 7.0' in page
        assert plugin.running()
        assert len(plugin.log()) < 20_000, plugin.log()[-3000:]
    finally:
        for writer in held:
            writer.close()
        plugin.kill()


def _get(url: str) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as answer:
        return answer.status, answer.read().decode()


# -- 15. a signal during start-up --------------------------------------------------------------------------------


def test_a_sighup_during_start_up_is_deferred_not_fatal(plugin_dir: Path) -> None:
    plugin = PluginProcess(TWO_M3_MAX, plugin_dir)
    try:
        # While it imports (most of a second), well before the event loop's handlers exist; once the command line's
        # first lines have run (before that, Python itself is starting, and no program can catch a signal).
        deadline = time.monotonic() + 20
        while not _catches(plugin.pid, signal.SIGHUP) and time.monotonic() < deadline:
            time.sleep(0.005)
        plugin.send(signal.SIGHUP)
        time.sleep(0.1)
        plugin.send(signal.SIGHUP)

        async def registers() -> None:
            async with KubeletEmulator(plugin_dir) as kubelet:
                await kubelet.wait_registered(APPLE, timeout=15)
            await plugin.wait_for_log("received SIGHUP during start-up; reloading once started")
            await plugin.wait_for_log("config reloaded")

        asyncio.run(registers())
        assert plugin.running()
    finally:
        plugin.kill()


# -- 16. a slow, or huge, host agent -----------------------------------------------------------------------------


class _HostileAgent:
    """An HTTP server that answers /v1/gpus one byte every two seconds, or with a body of 300 MB."""

    def __init__(self, huge: bool) -> None:
        self.huge = huge
        self.server: asyncio.Server | None = None
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await reader.readuntil(b"\r\n\r\n")
            if self.huge:
                size = 300 * 2**20
                writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {size}\r\n\r\n".encode())
                chunk = b" " * 2**20
                for _ in range(300):
                    writer.write(chunk)
                    await writer.drain()
            else:
                for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n{\"gpus\": []}        ":
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(2.0)
        writer.close()

    async def __aenter__(self) -> _HostileAgent:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


VIRTIO = "version: v1\nbackend: simulated\nsimulated:\n  gpus:\n    - {model: X, vendor: virtio}\n"


@pytest.mark.parametrize("huge", [False, True], ids=["dripping", "huge"])
async def test_a_slow_or_huge_host_agent_costs_neither_registration_nor_memory(
    kubelet: KubeletEmulator, start_plugin_process: Callable[..., PluginProcess], tmp_path: Path, huge: bool
) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    async with _HostileAgent(huge) as agent:
        began = time.monotonic()
        plugin = start_plugin_process(VIRTIO, "--host-agent", f"http://127.0.0.1:{agent.port}",
                              "--host-agent-token-file", str(token))
        await kubelet.wait_registered("gpuppetti.dev/gpu", timeout=10)
        assert time.monotonic() - began < 5.0, "registration does not wait for the agent"
        await plugin.wait_for_log("serving the config's virtio facts until it does", timeout=20)
        assert _rss_mib(plugin.pid) < 150, "the answer is not read whole"
        assert plugin.running()


# -- 17. what a container can plant ------------------------------------------------------------------------------


@pytest.mark.skipif(not (BUILT / LIBRARY).exists(), reason="the Vulkan layer is not built here (make native: needs "
                    "a C compiler and libvulkan-dev)")
async def test_what_containers_of_an_earlier_version_planted_goes_and_is_never_followed(
    kubelet: KubeletEmulator, start_plugin: Callable[..., Daemon], plugin_dir: Path, tmp_path: Path
) -> None:
    # Earlier versions gave each container its allocation's directory read-write: it could leave a FIFO, or a link
    # to one, to an endless file or to a file of the node's, anywhere in it.
    allocations = plugin_dir.parent / "vulkan" / "allocations"
    allocations.mkdir(parents=True)
    for name in ("dp-fifo", "dp-link-to-fifo", "dp-endless", "dp-planted"):
        (allocations / name).mkdir()
    os.mkfifo(allocations / "dp-fifo" / "units")
    os.mkfifo(tmp_path / "fifo")
    (allocations / "dp-link-to-fifo" / "units").symlink_to(tmp_path / "fifo")
    (allocations / "dp-endless" / "units").symlink_to("/dev/zero")
    victim = tmp_path / "victim"
    victim.write_text("not the plugin's\n")
    (allocations / "dp-planted" / "slice-0.acct").symlink_to(victim)
    (allocations / "dp-planted" / "victim-dir").symlink_to(tmp_path)
    plugin = start_plugin(TWO_M3_MAX)
    await kubelet.wait_registered(APPLE, timeout=15)
    await plugin.wait_for_log("slices are enforced through the Vulkan layer")
    assert not allocations.exists(), "removed at start"
    assert victim.read_text() == "not the plugin's\n" and (tmp_path / "fifo").exists()
    # What a container gets now is the daemon's alone: a directory holding its ledger's socket, mounted read-only.
    [first] = await kubelet.admit(Pod.simple("first", APPLE, 1))
    directory = plugin_dir.parent / "vulkan" / "ledgers" / allocation_id(first.device_ids)
    assert [entry.name for entry in directory.iterdir()] == ["ledger.sock"]
    assert all(mount.read_only for mount in first.response.mounts)
    assert plugin.running()


# -- 18. Ctrl-C --------------------------------------------------------------------------------------------------


def test_an_interrupted_demo_exits_130_with_one_line(tmp_path: Path) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GPUPPETTI_")}
    # Enough pods that the demo is still admitting them when it is interrupted.
    config = tmp_path / "big.yaml"
    config.write_text(TWO_M3_MAX.replace("count: 2", "count: 200").replace("replicas: 4", "replicas: 8"))
    for moment in ("importing", "running"):
        output, errors = tmp_path / f"{moment}.out", tmp_path / f"{moment}.err"
        with output.open("w") as out, errors.open("w") as err:
            process = subprocess.Popen([sys.executable, "-m", "gpuppetti", "demo", "--config", str(config)],
                                       stdout=out, stderr=err, env=environment)
            if moment == "importing":
                time.sleep(0.2)
            else:
                deadline = time.monotonic() + 30
                while "registered with the built-in kubelet" not in output.read_text():
                    assert time.monotonic() < deadline and process.poll() is None, errors.read_text()
                    time.sleep(0.02)
            process.send_signal(signal.SIGINT)
            code = process.wait(timeout=30)
        text = output.read_text() + errors.read_text()
        assert code == 130, (moment, code, text[-2000:])
        assert "Traceback" not in text, text[-2000:]
        assert errors.read_text().strip().splitlines()[-1] == "gpuppetti: interrupted", errors.read_text()


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(caught & (1 << (signum - 1)))


def test_the_early_handlers_are_in_before_anything_heavy_is_imported() -> None:
    # The console script's first lines, with what had been imported by the moment SIGHUP's handler went in: only
    # the package's own first modules beside what the interpreter loads before any program runs (a SIGHUP in the
    # milliseconds that `signal`, `typing` or `threading` take to import would end the process).
    code = (
        "import sys, _signal\n"
        "before = set(sys.modules)\n"
        "real = _signal.signal\n"
        "seen = []\n"
        "def spy(signum, handler):\n"
        "    if signum == _signal.SIGHUP and not seen:\n"
        "        seen.append(sorted(set(sys.modules) - before))\n"
        "    return real(signum, handler)\n"
        "_signal.signal = spy\n"
        "from gpuppetti.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(' '.join(seen[0]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    imported = set(out.stdout.splitlines()[-1].split()) - {"__future__", "gc"}
    assert imported == {"gpuppetti", "gpuppetti.cli", "gpuppetti.base", "gpuppetti.base.earlysignals"}, imported


@pytest.mark.parametrize("command", [["plugin"], ["dra", "--node-name", "n"], ["discover"], ["doctor"]],
                         ids=lambda c: c[0])
def test_ctrl_c_while_a_command_starts_is_one_line_and_130(tmp_path: Path, command: list[str]) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GPUPPETTI_")}
    environment["GPUPPETTI_DEVICE_PLUGIN_DIR"] = str(tmp_path / "dp")
    process = subprocess.Popen([sys.executable, "-m", "gpuppetti", *command], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=environment)
    # Once the command line's first lines have run (it catches SIGHUP from then on; before that, Python itself is
    # starting, and no program can say anything), inside the imports, which take most of a second.
    deadline = time.monotonic() + 20
    while not _catches(process.pid, signal.SIGHUP) and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130, (process.returncode, err)
    assert "Traceback" not in out + err, err
    assert err.strip().splitlines() == ["gpuppetti: interrupted"], err
