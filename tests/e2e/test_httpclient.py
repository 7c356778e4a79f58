"""The one HTTP client gpuppetti asks other processes with: whole bodies however they arrive, and bounded."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from gpuppetti.base.httpclient import FetchError, Unreachable, get
from tests.e2e.piecemeal import PiecemealServer
from tests.helpers import run_here

pytestmark = pytest.mark.e2e

BODY = bytes(range(256)) * 200  # 51,200 bytes, no two pieces alike in place


@pytest.mark.parametrize("content_length", [True, False], ids=["content-length", "until-close"])
async def test_a_body_that_arrives_in_pieces_is_read_whole(content_length: bool) -> None:
    async with PiecemealServer({"/v1/x": BODY}, piece=4096, pause=0.02, content_length=content_length) as server:
        reply = await get(f"{server.url}/v1/x")
    assert server.pieces_sent == 13
    assert (reply.status, reply.content_type, reply.body) == (200, "application/json", BODY)


async def test_a_body_over_the_bound_is_refused_however_it_arrives() -> None:
    # No Content-Length to refuse it by: the bound holds as the pieces are counted.
    async with PiecemealServer({"/v1/x": BODY}, piece=4096, pause=0.02, content_length=False) as server:
        with pytest.raises(FetchError, match=r"/v1/x sent more than 10000 bytes"):
            await get(f"{server.url}/v1/x", limit=10_000)
    assert server.pieces_sent < 13, "the client stops reading past its bound"


async def test_a_declared_length_over_the_bound_is_refused_before_reading() -> None:
    async with PiecemealServer({"/v1/x": BODY}, piece=4096, pause=0.02) as server:
        with pytest.raises(FetchError, match=r"sent 51200 bytes; at most 10000 are read"):
            await get(f"{server.url}/v1/x", limit=10_000)


async def test_nothing_listening_is_said_with_the_address_tried() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connecting is refused
        with pytest.raises(Unreachable) as caught:
            await get(f"http://127.0.0.1:{port}/v1/gpus")
    assert caught.value.address == f"127.0.0.1:{port}"
    assert str(caught.value) == (f"http://127.0.0.1:{port}/v1/gpus did not answer: cannot connect to "
                                 f"127.0.0.1:{port}: nothing listens there")


async def test_discover_from_takes_a_gpu_list_that_arrives_in_pieces() -> None:
    gpus: list[dict[str, object]] = [
        {"id": f"gpu-{n}", "vendor": "nvidia", "model": "NVIDIA A100-SXM4-80GB", "health": "Healthy",
         "resource": "nvidia.com/gpu", "replicas": 1, "memory_bytes": 80 * 2**30, "device_nodes": [], "cores": None,
         "numa_node": 0, "backend": "nvml", "facts": None}
        for n in range(64)]
    async with PiecemealServer({"/v1/gpus": json.dumps(gpus).encode()}, piece=512, pause=0.005) as server:
        shown = await asyncio.to_thread(run_here, "discover", "--from", server.url, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == gpus
    assert server.pieces_sent > 10
