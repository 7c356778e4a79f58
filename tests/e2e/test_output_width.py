"""Output that fits: the demo, ``discover``, ``top`` and the bench at 80 and 120 columns and piped (80, rich's
default for a pipe), with every id, device path and env value whole, and no trailing blanks."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from rich.cells import cell_len
from rich.console import Console

from bench.run import Figure, render
from tests.e2e.piecemeal import PiecemealServer
from tests.fixtures import MACHINES
from tests.helpers import run_here, short_tmpdir

pytestmark = pytest.mark.e2e

# (label, COLUMNS, the width the output must fit).
WIDTHS = [("80", "80", 80), ("120", "120", 120), ("piped", None, 80)]


def assert_fits(output: str, width: int) -> None:
    for line in output.splitlines():
        assert cell_len(line) <= width, f"{cell_len(line)} columns: {line!r}"
        assert line == line.rstrip(), f"trailing blanks: {line!r}"
    assert "…" not in output, "a value was cut short"


def _env(columns: str | None) -> dict[str, str]:
    return {"COLUMNS": columns} if columns else {}


@pytest.mark.parametrize(("label", "columns", "width"), WIDTHS, ids=[w[0] for w in WIDTHS])
def test_the_demo_fits(label: str, columns: str | None, width: int) -> None:
    result = run_here("demo", env=_env(columns))
    assert result.returncode == 0, result.stderr
    assert_fits(result.stdout, width)
    for gpu in (0, 1):
        for replica in range(4):
            assert f"sim-apple-{gpu}::{replica}" in result.stdout
    for value in ("GPUPPETTI_VISIBLE_DEVICES=sim-apple-0,sim-apple-1", "GPUPPETTI_SLICES=sim-apple-0::3,sim-apple-1::3",
                  "GPUPPETTI_SHARING=time-slicing", "Apple M3 Max", "apple.com/gpu"):
        assert value in result.stdout, value


@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize(("label", "columns", "width"), WIDTHS, ids=[w[0] for w in WIDTHS])
def test_discover_fits(tmp_path: Path, machine: str, label: str, columns: str | None, width: int) -> None:
    MACHINES[machine](tmp_path)
    listed = run_here("discover", "--json", "--host-root", str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    records = json.loads(listed.stdout)
    result = run_here("discover", "--host-root", str(tmp_path), env=_env(columns))
    assert result.returncode == 0, result.stderr
    assert_fits(result.stdout, width)
    for record in records:
        assert record["id"] in result.stdout
        shown = "device nodes" in result.stdout.splitlines()[2]
        for path in record["device_nodes"] if shown else ():
            assert path in result.stdout, path


def test_discover_finding_nothing_says_so_in_lines_that_fit() -> None:
    # Nothing here: no sysfs, no NVML module, not macOS, no simulated GPUs. Each backend's reason is one line.
    host = short_tmpdir()
    result = run_here("discover", "--host-root", str(host), env={"PYTHONPATH": "/nonexistent"})
    host.rmdir()
    assert result.returncode == 1
    assert "looked at:" in result.stderr
    for line in result.stderr.splitlines():
        assert cell_len(line) <= 80, f"{cell_len(line)} columns: {line!r}"


# A GPU whose line is wider than 80 columns: its id, model, memory, health, and how much of it is held.
TOP_GPU = {"id": "gpu-0000:c1:00.0", "vendor": "nvidia", "model": "NVIDIA GeForce RTX 4090 Laptop GPU",
           "memory_bytes": 16 * 2**30, "health": "Unhealthy", "resource": "nvidia.com/gpu", "replicas": 12}
TOP_PHRASES = ["gpu-0000:c1:00.0", "NVIDIA GeForce RTX 4090 Laptop GPU", "16 GiB", "Unhealthy",
               "3 of 12 slice(s) held, 6 GiB in use"]


@pytest.mark.parametrize(("label", "columns", "width"), WIDTHS, ids=[w[0] for w in WIDTHS])
async def test_top_fits_and_breaks_a_line_between_phrases(label: str, columns: str | None, width: int) -> None:
    slices = [{"namespace": "research", "pod": f"trainer-{n}", "container": "main", "gpu": TOP_GPU["id"],
               "unit": f"{TOP_GPU['id']}::{n}", "budget_bytes": 2**30 * 4 // 3, "used_bytes": 2 * 2**30,
               "compute_wait_seconds": 12.25} for n in range(3)]
    bodies = {"/v1/gpus": json.dumps([TOP_GPU]).encode(), "/v1/slices": json.dumps(slices).encode()}
    async with PiecemealServer(bodies) as server:
        result = await asyncio.to_thread(run_here, "top", "--from", server.url, "--once", env=_env(columns))
    assert result.returncode == 0, result.stderr
    assert_fits(result.stdout, width)
    lines = result.stdout.splitlines()
    for phrase in TOP_PHRASES:
        assert any(phrase in line for line in lines), f"{phrase!r} is broken across lines:\n{result.stdout}"
    if width >= 120:
        assert any("  ".join(TOP_PHRASES) in line for line in lines), "the GPU's line on one line where it fits"
    for n in range(3):
        assert f"research/trainer-{n}/main" in result.stdout


FIGURES = [
    Figure("first ListAndWatch list after Register, 50,000 units", 9.41, "ms", "≤ 50 ms", True,
           "p50 of 20 registrations; the plugin's own time from Register to the list on the wire"),
    Figure("start to registered", 1070.4, "ms", "≤ 860 ms", False,
           "bare grpc.aio plugin 172 ms in the same run, times 5"),
    Figure("resident memory", 55.2, "MiB", "≤ 50 MiB", False, "VmRSS after registration with 10,000 units"),
    Figure("DRA NodePrepareResources, 1,000 claims in one call", 231.0, "ms", "≤ 300 ms", True,
           "1000 CDI specs written to /tmp/gp-bench-abcdef/cdi-with-a-long-name"),
]


@pytest.mark.parametrize(("label", "columns", "width"), WIDTHS, ids=[w[0] for w in WIDTHS])
def test_the_bench_table_fits(monkeypatch: pytest.MonkeyPatch, label: str, columns: str | None, width: int) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    # A StringIO is not a terminal: with no width given, rich takes 80, as for a pipe.
    console = Console(file=out, width=int(columns) if columns else None)
    render(FIGURES, console)
    text = out.getvalue()
    assert_fits(text, width)
    assert "1,070 ms" in text and "9.41 ms" in text and "e+" not in text
