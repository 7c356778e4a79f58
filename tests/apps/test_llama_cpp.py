"""llama.cpp's Vulkan backend in a container on lavapipe, inside a slice and past it.

llama.cpp is built by tools/build-llama-vulkan.sh into the apps' cache (its llama-simple example: greedy decoding,
all layers offloaded with -ngl 99); the models are llama models of random weights with a tiny vocabulary, written
here with gguf (tests/apps/tiny_llama.py). The container gets exactly the layer's mounts and env (LayerDir.edits),
and GGML_VK_VISIBLE_DEVICES=0: llama.cpp's own switch to use a Vulkan device of type CPU (lavapipe), which it
otherwise leaves out.

Lavapipe compiles llama.cpp's pipelines the first time they are used (half a minute); Mesa's shader cache is kept in
the apps' cache, so that later runs take seconds.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuppetti.core.model import ContainerEdits
from gpuppetti.kubelet.sandbox import podman_flags
from gpuppetti.node.vulkanlayer import LayerDir
from tests.apps.conftest import can_run
from tests.apps.support import (
    MIB,
    CannotRun,
    Ran,
    bind,
    llama_build,
    llama_image,
    run,
    shader_cache,
    slice_edits,
)

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
LARGE = ("--embd", "256", "--ff", "512", "--layers", "32")


@dataclass(frozen=True)
class Llama:
    image: str
    version: str


@dataclass(frozen=True)
class Models:
    small: Path
    large: Path


@pytest.fixture(scope="module")
def llama() -> Llama:
    can_run()
    try:
        build = llama_build()
        return Llama(llama_image(build), build.version)
    except CannotRun as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def models(venv_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Models:
    directory = tmp_path_factory.mktemp("models")
    written = Models(directory / "small.gguf", directory / "large.gguf")
    for path, shape, seed in ((written.small, SMALL, "1"), (written.large, LARGE, "2")):
        subprocess.run([str(venv_python), str(WRITER), str(path), *shape, "--seed", seed], check=True, timeout=120)
    assert written.small.stat().st_size < SLICE // 4
    assert written.large.stat().st_size > SLICE + 16 * MIB
    return written


@pytest.fixture(scope="module")
def module_layer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LayerDir]:
    can_run()
    installed = LayerDir(tmp_path_factory.mktemp("layer") / "vulkan")
    installed.install()
    yield installed


def generate(llama: Llama, edits: ContainerEdits | None, model: Path, tokens: int) -> Ran:
    """llama-simple on ``model`` in a container given ``edits`` (None: no layer at all)."""
    flags = podman_flags(edits) if edits is not None else []
    flags += bind(model, IN_CONTAINER) + shader_cache() + ["--env", "GGML_VK_VISIBLE_DEVICES=0"]
    return run(llama.image, flags, ["llama-simple", "-m", IN_CONTAINER, "-n", str(tokens), "-ngl", "99", PROMPT],
               timeout=300)


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
def inside(llama: Llama, models: Models, module_layer: LayerDir) -> Ran:
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
    # Greedy decoding: the same text, token for token, as on the same device without the layer.
    assert inside.stdout.startswith("<s> " + PROMPT), inside.stdout
    assert len(inside.stdout.strip()) > len("<s> " + PROMPT) + 8, "it generated text"
    assert inside.stdout == alone.stdout


def test_past_the_slice_a_larger_model_fails_with_llama_cpps_own_out_of_memory_error(
        llama: Llama, models: Models, module_layer: LayerDir) -> None:
    refused = generate(llama, slice_edits(module_layer, SLICE), models.large, 2)
    assert not refused.signalled, f"llama.cpp crashed ({refused.code}):\n{log(refused)}"
    assert refused.code == 1, log(refused)
    assert free_mib(refused) <= SLICE // MIB
    # ggml-vulkan's report of the driver's answer (the layer's), then llama.cpp's own.
    assert "ErrorOutOfDeviceMemory" in refused.stderr, log(refused)
    assert "unable to allocate Vulkan0 buffer" in refused.stderr, log(refused)
    assert "error: unable to load model" in refused.stderr, log(refused)
    # The same model, on the same device without the layer, loads and runs: it is the slice that refuses it.
    loaded = generate(llama, None, models.large, 2)
    assert loaded.code == 0, log(loaded)
    assert vulkan_buffer_mib(loaded, "model") > SLICE // MIB
