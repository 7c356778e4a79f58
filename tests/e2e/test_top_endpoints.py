"""gpuppetti top against what may answer on the address it is given: a large answer in pieces, a hostile endpoint,
malformed records, nothing at all."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from gpuppetti.commands.top import MAX_ANSWER_BYTES
from tests.e2e.piecemeal import PiecemealServer
from tests.helpers import run_cli, run_here

pytestmark = pytest.mark.e2e

GIB = 2**30


def gpu(gpu_id: str = "sim-apple-0", **changes: Any) -> dict[str, Any]:
    record = {"id": gpu_id, "index": 0, "vendor": "apple", "model": "Apple M3 Max", "cores": 40,
              "memory_bytes": 48 * GIB, "device_nodes": [], "numa_node": None, "health": "Healthy",
              "backend": "simulated", "pci_address": None, "uuid": None, "driver": None, "metal_family": None,
              "utilization_percent": None, "memory_used_bytes": None, "facts": None, "resource": "apple.com/gpu",
              "replicas": 4, "slice_memory_bytes": 12 * GIB}
    return record | changes


def held(n: int = 0, **changes: Any) -> dict[str, Any]:
    record = {"namespace": "default", "pod": f"trainer-{n}", "container": "main", "gpu": "sim-apple-0",
              "unit": f"sim-apple-0::{n}", "budget_bytes": 12 * GIB, "used_bytes": 3 * GIB,
              "compute_wait_seconds": 1.5}
    return record | changes


def answers(gpus: Any, slices: Any) -> dict[str, bytes]:
    return {"/v1/gpus": json.dumps(gpus).encode(), "/v1/slices": json.dumps(slices).encode()}


async def top(url: str, *args: str, columns: str = "100") -> Any:
    return await asyncio.to_thread(run_here, "top", "--from", url, *args, env={"COLUMNS": columns})


async def test_ten_thousand_slices_with_the_longest_names_arrive_in_pieces_and_are_all_shown() -> None:
    # Kubernetes' longest names: a namespace and a container of 63 characters, a pod of 253.
    slices = [held(n, namespace="n" * 63, pod=f"{'p' * 248}{n:05d}", container="c" * 63) for n in range(10_000)]
    bodies = answers([gpu()], slices)
    assert 5_000_000 < len(bodies["/v1/slices"]) < MAX_ANSWER_BYTES
    async with PiecemealServer(bodies, piece=256 * 1024, pause=0.01) as server:
        shown = await top(server.url, "--json")
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["slices"] == slices


async def test_an_answer_over_the_bound_is_one_line() -> None:
    slices = [held(n, pod="p" * 253) for n in range(MAX_ANSWER_BYTES // 300 + 1)]
    async with PiecemealServer(answers([gpu()], slices), piece=1024 * 1024, pause=0.0,
                               content_length=False) as server:
        shown = await top(server.url, "--once")
    assert shown.returncode == 1
    assert shown.stderr == f"gpuppetti: {server.url}/v1/slices sent more than {MAX_ANSWER_BYTES} bytes\n"


# What a hostile endpoint puts in a string, to act on the terminal that shows it: CSI (colour, cursor, erase),
# OSC 52 (writes the clipboard), OSC 8 (a link), C1 CSI, DEL, backspace and carriage return (rewrite the line), a
# bidi override (reverses what follows), a null.
HOSTILE = ("\x1b[31m\x1b[2J\x1b[H" "\x1b]52;c;cm0gLXJmIH4K\x07" "\x1b]8;;https://example.invalid/\x1b\\" "\x9b2J"
           "\x7f\x08\r\u202e\u2066\x00")
UNSHOWN = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
                            *range(0x2066, 0x206A)]} - {"\n"}


def hostile(value: str) -> str:
    return f"{HOSTILE}{value}{HOSTILE}"


@pytest.mark.parametrize("mode", ["--once", "--json"])
async def test_a_hostile_endpoint_gets_no_control_character_to_the_terminal(mode: str) -> None:
    gpus = [gpu(hostile("gpu-a"), model=hostile("Model"), vendor=hostile("apple"), health=hostile("Healthy"),
                resource=hostile("apple.com/gpu"))]
    slices = [held(0, namespace=hostile("ns"), pod=hostile("pod"), container=hostile("ctr"), gpu=hostile("gpu-a"),
                   unit=hostile("unit-0"))]
    async with PiecemealServer(answers(gpus, slices)) as server:
        shown = await top(server.url, mode, columns="200")
    assert shown.returncode == 0, shown.stderr
    if mode == "--json":
        document = json.loads(shown.stdout)
        strings = [value for record in [*document["gpus"], *document["slices"]] for value in record.values()
                   if isinstance(value, str)]
        assert strings and not [value for value in strings if UNSHOWN & set(value)]
        # What is left is text, shown as it came.
        left = "[31m[2J[H]52;c;cm0gLXJmIH4K]8;;https://example.invalid/\\2J"
        assert document["slices"][0]["pod"] == f"{left}pod{left}"
    else:
        assert not UNSHOWN & set(shown.stdout + shown.stderr), repr(shown.stdout)
        assert "ns" in shown.stdout and "gpu-a" in shown.stdout and "Model" in shown.stdout


MALFORMED = {
    "slices not a list": ([gpu()], {"slices": []}, "/v1/slices answered JSON that is not what gpuppetti serves "
                          "(input should be a valid array)"),
    "a slice not an object": ([gpu()], [held(), "x"], "(item 1: input should be an object)"),
    "a number as a string": ([gpu()], [held(used_bytes="3221225472")], "(item 0, used_bytes: input should be a "
                             "valid integer)"),
    "a missing field": ([gpu()], [{k: v for k, v in held().items() if k != "pod"}], "(item 0, pod: field "
                        "required)"),
    "null for a number": ([gpu()], [held(compute_wait_seconds=None)], "(item 0, compute_wait_seconds: input "
                          "should be a valid number)"),
    "a negative size": ([gpu()], [held(budget_bytes=-1)], "(item 0, budget_bytes: input should be greater than or "
                        "equal to 0)"),
    "a GPU without an id": ([{k: v for k, v in gpu().items() if k != "id"}], [], "/v1/gpus answered JSON that is "
                            "not what gpuppetti serves (item 0, id: field required)"),
    "a GPU's model a number": ([gpu(model=7)], [], "(item 0, model: input should be a valid string)"),
    "two things wrong": ([gpu()], [held(pod=1, gpu=2)], "(item 0, pod: input should be a valid string; 1 "
                         "more)"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("mode", ["--once", "--json"])
async def test_a_malformed_answer_is_one_line_and_exit_1(case: str, mode: str) -> None:
    gpus, slices, said = MALFORMED[case]
    async with PiecemealServer(answers(gpus, slices)) as server:
        shown = await top(server.url, mode)
    assert shown.returncode == 1, shown.stdout
    assert shown.stdout == ""
    assert len(shown.stderr.splitlines()) == 1 and said in shown.stderr, shown.stderr


async def test_an_answer_that_is_not_json_is_one_line() -> None:
    async with PiecemealServer({"/v1/gpus": b"<html>", "/v1/slices": b"[]"}) as server:
        shown = await top(server.url, "--once")
    assert (shown.returncode, shown.stderr) == (1, f"gpuppetti: {server.url} is not a gpuppetti plugin or DRA "
                                                   "driver's HTTP endpoint (its --http-address): /v1/gpus answered "
                                                   "something that is not JSON\n")


async def test_a_server_that_does_not_speak_http_is_one_line_without_its_escapes() -> None:
    # aiohttp's message about a bad status line quotes what it got: escaped, on one line, as it must stay.
    head = f"{HOSTILE}HTTP/1.1 200 OK\r\n\r\n".encode()
    async with PiecemealServer(answers([gpu()], []), head=head) as server:
        shown = await top(server.url, "--once")
    assert shown.returncode == 1
    assert len(shown.stderr.splitlines()) == 1 and "Bad status line" in shown.stderr, shown.stderr
    assert not UNSHOWN & set(shown.stderr.rstrip("\n")), repr(shown.stderr)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("mode", [[], ["--once"], ["--json"]], ids=["live", "once", "json"])
def test_nothing_answering_says_what_to_start_and_stops(mode: list[str]) -> None:
    port = _closed_port()
    # The default --from, through the env var the daemons (and the demo) share.
    shown = run_cli("top", *mode, env={"GPUPPETTI_HTTP_ADDRESS": f"127.0.0.1:{port}"}, timeout=30)
    assert shown.returncode == 1
    assert shown.stderr == (f"gpuppetti: nothing answers on 127.0.0.1:{port} (http://127.0.0.1:{port}): start a "
                            "daemon (gpuppetti plugin or gpuppetti dra), or `gpuppetti demo --keep-running`\n")
