"""The health and metrics endpoint of both front ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from gpuppetti.kubelet.emulator import KubeletEmulator, Pod
from tests.helpers import TWO_M3_MAX, Daemon

pytestmark = pytest.mark.e2e


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def test_healthz_is_ready_once_registered_and_metrics_count(
    plugin_dir: Path, start_plugin: Callable[..., Daemon]
) -> None:
    plugin = start_plugin(TWO_M3_MAX)
    url = await plugin.http_url()
    # No kubelet yet: not ready, and the answer says what it waits for.
    async with asyncio.timeout(10):
        while "no resource is being served yet" in (text := (await _get(f"{url}/healthz"))[1]):
            await asyncio.sleep(0.02)
    status = (await _get(f"{url}/healthz"))[0]
    assert status == 503 and "not registered with the kubelet: apple.com/gpu" in text
    assert (await _get(f"{url}/livez"))[0] == 200

    async with KubeletEmulator(plugin_dir) as kubelet:
        await kubelet.wait_registered("apple.com/gpu")
        async with asyncio.timeout(10):
            while (await _get(f"{url}/healthz"))[0] != 200:
                await asyncio.sleep(0.02)
        await kubelet.admit(Pod.simple("a", "apple.com/gpu", 2))
        await kubelet.restart()
        await kubelet.wait_registered("apple.com/gpu", count=2)
        # The kubelet sees the registration a moment before the plugin's Register call returns and counts it.
        registered = 'gpuppetti_registrations_total{resource="apple.com/gpu"} 2.0'
        async with asyncio.timeout(10):
            while registered not in (metrics := (await _get(f"{url}/metrics"))[1]):
                await asyncio.sleep(0.02)
    lines = set(metrics.splitlines())
    assert 'gpuppetti_allocate_requests_total{resource="apple.com/gpu",result="ok"} 1.0' in lines
    assert 'gpuppetti_allocated_units_total{resource="apple.com/gpu"} 2.0' in lines
    # The kubelet deleted the plugin's socket twice: when it first started, and when it restarted.
    assert 'gpuppetti_plugin_restarts_total{resource="apple.com/gpu"} 2.0' in lines
    assert 'gpuppetti_units{health="Healthy",resource="apple.com/gpu"} 8.0' in lines
    # 48 GiB in 4 slices: what the Vulkan layer holds a container given one to.
    assert 'gpuppetti_slice_memory_bytes{gpu="sim-apple-0",resource="apple.com/gpu"} 1.2884901888e+10' in lines
    assert 'gpuppetti_gpus{backend="simulated",health="Healthy",model="Apple M3 Max",vendor="apple"} 2.0' in lines
    assert any(line.startswith('gpuppetti_allocate_duration_seconds_bucket{le="0.005",resource="apple.com/gpu"}')
               for line in lines)


def test_the_listener_defaults_to_localhost() -> None:
    from gpuppetti.cli.main import parse

    assert parse(["plugin"], {}).http_address == "127.0.0.1:9400"
    assert parse(["dra", "--node-name", "n"], {}).http_address == "127.0.0.1:9400"
    assert parse(["plugin"], {"GPUPPETTI_HTTP_ADDRESS": ""}).http_address == "", "an empty value turns it off"


async def test_an_address_in_use_is_a_clear_error(
    start_plugin: Callable[..., Daemon], kubelet: KubeletEmulator
) -> None:
    first = start_plugin(TWO_M3_MAX)
    url = await first.http_url()
    taken = url.removeprefix("http://")
    second = start_plugin(TWO_M3_MAX, "--http-address", taken)
    assert await second.wait() == 1
    assert f"cannot listen on {taken}" in second.log()


async def test_a_list_too_big_for_the_kubelet_is_said_not_sent(
    plugin_dir: Path, start_plugin: Callable[..., Daemon]
) -> None:
    huge = TWO_M3_MAX.replace("count: 2", "count: 150").replace("replicas: 4", "replicas: 1024")
    plugin = start_plugin(huge)
    url = await plugin.http_url(timeout=60)
    async with KubeletEmulator(plugin_dir) as kubelet:
        await plugin.wait_for_log("not sending the device list", timeout=60)
        status, text = await _get(f"{url}/healthz")
        assert status == 503 and "more than the kubelet accepts (4,194,304 bytes" in text, text
        assert kubelet.capacity("apple.com/gpu") == 0
    assert plugin.running()


async def test_a_request_whose_client_has_gone_is_dropped_and_held_connections_give_way() -> None:
    from gpuppetti.base import webserver

    started, dropped = asyncio.Event(), asyncio.Event()

    async def slow() -> webserver.Answer:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            dropped.set()
            raise
        return webserver.Answer.text(200, "late\n")

    async def fast() -> webserver.Answer:
        return webserver.Answer.text(200, "ok\n")

    server = webserver.Server({"/slow": slow, "/healthz": fast})
    await server.start("127.0.0.1", 0)
    serving = asyncio.create_task(server.serve())
    host, port = server.address.rsplit(":", 1)
    try:
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(started.wait(), 5)
        writer.close()
        await asyncio.wait_for(dropped.wait(), 5)

        # Twice the cap in connections that say nothing: the oldest give way, and a probe is answered at once.
        held = [(await asyncio.open_connection(host, int(port)))[1] for _ in range(2 * webserver.MAX_CONNECTIONS)]
        try:
            assert await asyncio.wait_for(_get(f"http://{server.address}/healthz"), 2) == (200, "ok\n")
            assert len(server._open) <= webserver.MAX_CONNECTIONS
        finally:
            for writer in held:
                writer.close()
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving


async def test_slow_pages_for_abandoned_scrapes_are_built_once_and_leave_the_default_executor_free() -> None:
    # The checkpoint and the CDI specs are written on the loop's default executor: 200 scrapes of a page that takes
    # half a second to build, each given up on at once, must neither queue there nor be built 200 times.
    import time

    from gpuppetti.node.httpserver import HttpServer
    from gpuppetti.node.metrics import Metrics

    built = 0

    def slow() -> list[dict[str, object]]:
        nonlocal built
        built += 1
        time.sleep(0.5)
        return []

    http = HttpServer(Metrics())
    http.slices = slow
    await http.start("127.0.0.1:0")
    serving = asyncio.create_task(http.serve())
    host, port = http.address.rsplit(":", 1)
    try:
        for _ in range(200):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /v1/slices HTTP/1.1\r\nhost: x\r\n\r\n")
            await writer.drain()
            writer.close()
        began = time.monotonic()
        await asyncio.to_thread(lambda: None)
        assert time.monotonic() - began < 0.25, "the default executor waits behind the pages"
        await asyncio.sleep(1.5)
        assert built <= 2, f"{built} pages built for clients that had gone"
        # A client that waits gets a page built after it asked.
        assert await asyncio.wait_for(_get(f"http://{http.address}/v1/slices"), 5) == (200, "[]")
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
