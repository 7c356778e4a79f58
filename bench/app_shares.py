"""How closely a compute share holds the application tests' clients, wgpu and llama.cpp, to their part of the GPU's
time: the bench's "application shares" step.

Each runs exactly as the application tests run it (tests/apps/test_wgpu.py, tests/apps/test_llama_cpp.py, whose
helpers this uses): in a podman container on lavapipe, given a slice as the daemons hand it out, once with no share
and once with each share, interleaved, in rounds.

- wgpu (tests/apps/wgpu_app.py busy): compute passes timed by wgpu's own timestamps, which the layer never sees,
  against the wall time from the first submit to the last timestamps read back (the read's submit is in it, so what
  the client still owes at its end is counted): a frame at a time, and its whole run queued at once. A share is of
  the time the GPU spends on the slice's batches from submit to completion, and lavapipe's own work around each
  pass, outside its timestamps, is there without a share too: the figure is the share's part of what the same
  client gets without one.
- llama.cpp: the rate of one whole /completion (its prompt and its generation: llama-server's own timings) with the
  share over without. Its work on lavapipe is the GPU's all but a few percent, so the rate follows its GPU time;
  what is not (the CPU's sampling between tokens, which a share's wait overlaps) makes this read a little above the
  GPU's part, never below. Generation alone reads below it: the prompt's batch runs at once, and the wait it earns
  falls on the first generated token.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.figures import Figure
from bench.llama_cpp import warm_llama
from gpuppetti.sharing.budgets import WHOLE_COMPUTE
from tests.apps.conftest import PythonApp
from tests.apps.support import CannotRun, app_venv, python_image, slice_edits, why_not_here
from tests.apps.test_llama_cpp import SLICE, Llama, answer, completion_rate, generate
from tests.apps.test_wgpu import wgpu
from tests.ledger_client import ServedLayer

SHARES = (500, 250)
ROUNDS = 3
GOAL = 0.10
GOAL_TEXT = f"within {GOAL:.0%} of the share"
# wgpu: passes of about 30 ms each on lavapipe here; the queued client's whole run is about a second without a share.
WGPU_BATCHES = 40
# llama.cpp: tokens per run, about 4 s of generation without a share.
LLAMA_TOKENS = 32
NAME = "compute share held for an application: {client}, {share} % share"


@dataclass(frozen=True)
class Client:
    name: str
    # One run with the share in thousandths (WHOLE_COMPUTE: none): the measure, where larger is more of the GPU.
    measure: Callable[[int], float]
    how: str


def _wgpu_client(app: PythonApp, layer: ServedLayer, queued: bool) -> Client:
    args = ["busy", "--batches", str(WGPU_BATCHES), *(["--queued"] if queued else [])]

    def measure(share: int) -> float:
        report = wgpu(app, slice_edits(layer, SLICE, share), *args)
        return float(report["gpu_seconds"]) / float(report["seconds"])

    mode = f"its {WGPU_BATCHES} passes queued at once" if queued else f"{WGPU_BATCHES} passes, a frame at a time"
    return Client(f"wgpu, {mode}", measure, "wgpu's timestamps over the wall time of its run")


def _llama_client(llama: Llama, model: Path, layer: ServedLayer) -> Client:
    def measure(share: int) -> float:
        ran = generate(llama, slice_edits(layer, SLICE, share), model, LLAMA_TOKENS)
        answer(ran)
        return completion_rate(ran)

    return Client(f"llama.cpp, a {LLAMA_TOKENS}-token completion", measure,
                  "llama-server's tokens/s over its whole completion (prompt and generation)")


def _measure(workdir: Path) -> list[Figure]:
    reason = why_not_here()
    if reason is not None:
        raise CannotRun(reason)
    python = app_venv()
    layer = ServedLayer(workdir / "shares-vulkan")
    clients = [_wgpu_client(PythonApp(python, python_image(python)), layer, queued) for queued in (False, True)]
    not_llama: str | None = None
    model = workdir / "shares-llama.gguf"
    try:
        llama = warm_llama(python, model)
    except CannotRun as exc:
        not_llama = str(exc)
    else:
        clients.append(_llama_client(llama, model, layer))
    figures: list[Figure] = []
    for client in clients:
        readings: dict[int, list[float]] = {share: [] for share in (WHOLE_COMPUTE, *SHARES)}
        for round_ in range(ROUNDS):
            # Each round without a share and with each, back to back, the order turned every other round: the
            # machine's speed moves within a minute, so each share is read against runs seconds from it.
            order = list(readings) if round_ % 2 == 0 else list(reversed(readings))
            for share in order:
                readings[share].append(client.measure(share))
        for share in SHARES:
            parts = [got / free for got, free in zip(readings[share], readings[WHOLE_COMPUTE], strict=True)]
            part = statistics.median(parts)
            figures.append(Figure(
                NAME.format(client=client.name, share=f"{share / 10:g}"), 100 * part, "% of without a share",
                GOAL_TEXT, abs(part * WHOLE_COMPUTE / share - 1) <= GOAL,
                f"the median of {ROUNDS} rounds' ratios of {client.how} with the share to the same without one, "
                f"interleaved ({', '.join(f'{100 * p:.1f}' for p in parts)} %; without a share "
                f"{', '.join(f'{r:.3g}' for r in readings[WHOLE_COMPUTE])}); lavapipe, in podman, each run a "
                "container given a slice"))
    if not_llama is not None:
        figures.append(Figure(NAME.format(client="llama.cpp", share="50 and 25"), None, "%", GOAL_TEXT, None,
                              f"not measured: {not_llama}"))
    return figures


async def bench_app_shares(workdir: Path, figures: list[Figure]) -> None:
    """The figures, or one that says why they were not measured (skipped where the app tests skip)."""
    try:
        # In a thread: the app tests' helpers are synchronous, and some run an event loop of their own.
        figures.extend(await asyncio.to_thread(_measure, workdir))
    except CannotRun as exc:
        figures.append(Figure(NAME.format(client="wgpu and llama.cpp", share="50 and 25"), None, "%", GOAL_TEXT,
                              None, f"not measured: {exc}"))
    except AssertionError as exc:
        figures.append(Figure(NAME.format(client="wgpu and llama.cpp", share="50 and 25"), None, "%", GOAL_TEXT,
                              False, f"an application failed: {exc}"))
