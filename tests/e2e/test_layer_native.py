"""The Vulkan layer tested in C: `make check` (the layer and a harness built with AddressSanitizer and UBSan, the
layer installed as an implicit layer, driven through the real loader on lavapipe and on a fake driver whose GPUs,
heaps and budgets each scenario sets, with a ledger served by gpuppetti.layer.ledgers) and `make fuzz` (its parsers of
GPUPPETTI_VK_SLICES, GPUPPETTI_VK_COMPUTE and the ledger's answer to HELLO, for a bounded time)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuppetti.kubelet.sandbox import vulkan_icd

pytestmark = pytest.mark.e2e

LAYER_SOURCE = Path(__file__).resolve().parents[2] / "native" / "vulkan-layer"
# Per parser, in every test run; `make -C native/vulkan-layer fuzz FUZZ_SECONDS=600` fuzzes for longer.
FUZZ_SECONDS = 4


def why_not_here(lavapipe: bool) -> str | None:
    if shutil.which(os.environ.get("CC", "cc")) is None or not Path("/usr/include/vulkan/vulkan.h").exists():
        return "no C compiler or Vulkan headers here (Debian: gcc libvulkan-dev)"
    if lavapipe and vulkan_icd() is None:
        return "no Vulkan loader and lavapipe here (Debian: libvulkan1 mesa-vulkan-drivers)"
    return None


def make(target: str, out: Path, *extra: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "-C", str(LAYER_SOURCE), target, f"OUT={out}", *extra],
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def check_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build for both runs of `make check`."""
    return tmp_path_factory.mktemp("layer-check")


@pytest.mark.timeout(300)
def test_the_sanitized_layer_passes_every_scenario_on_lavapipe(check_out: Path) -> None:
    reason = why_not_here(lavapipe=True)
    if reason is not None:
        pytest.skip(f"the layer's C harness cannot run: {reason}")
    result = make("check", check_out, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "every scenario passed" in result.stdout
    assert "FAILED" not in result.stdout
    assert " lavapipe\n" in result.stdout and " fake: " in result.stdout


@pytest.mark.timeout(300)
def test_without_lavapipe_the_fake_drivers_scenarios_run_alone(check_out: Path) -> None:
    reason = why_not_here(lavapipe=False)
    if reason is not None:
        pytest.skip(f"the layer's C harness cannot be built here: {reason}")
    result = make("check", check_out, "LAVAPIPE=", timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "lavapipe's scenarios skipped" in result.stdout
    assert " lavapipe\n" not in result.stdout and " fake: " in result.stdout
    assert "every scenario passed" in result.stdout
    assert "FAILED" not in result.stdout


@pytest.mark.timeout(300)
def test_the_parsers_survive_fuzzing(tmp_path: Path) -> None:
    reason = why_not_here(lavapipe=False)
    if reason is not None:
        pytest.skip(f"the layer's parsers cannot be fuzzed here: {reason}")
    result = make("fuzz", tmp_path, f"FUZZ_SECONDS={FUZZ_SECONDS}", timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for target in ("slices", "compute", "hello"):
        assert f"fuzz-{target}: {FUZZ_SECONDS} s" in result.stdout
