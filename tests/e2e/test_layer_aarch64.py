"""The Vulkan layer built for aarch64 (cross-compiled, as `make dist` builds the aarch64 wheel's) and run under
qemu-aarch64-static, with Debian's arm64 Vulkan loader and lavapipe installed as a foreign architecture: the layer
holds the probe to its slice, reports the budget, and refuses an allocation past it; the parsers survive fuzzing.

qemu-aarch64-static runs one aarch64 program given its sysroot (``-L /``: the arm64 libraries live under
/usr/lib/aarch64-linux-gnu), with no binfmt_misc. The C harness of `make check` re-executes itself for each scenario,
which qemu cannot follow without binfmt_misc (a setting of the whole machine): its scenarios stay on x86-64, under
the sanitizers (test_layer_native.py), which do not run under qemu either. Small slices and chunks: lavapipe is slow
when emulated.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpuppetti.core.model import Gpu, Vendor
from gpuppetti.layer.vulkan import LIBRARY, PROBE, manifest
from gpuppetti.sharing.budgets import Budget
from tests.helpers import short_tmpdir
from tests.ledger_client import ServedLayer

pytestmark = pytest.mark.e2e

LAYER_SOURCE = Path(__file__).resolve().parents[2] / "native" / "vulkan-layer"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64-static"
ARM64_LOADER = Path("/usr/lib/aarch64-linux-gnu/libvulkan.so.1")
ARM64_LAVAPIPE = Path("/usr/share/vulkan/icd.d/lvp_icd.aarch64.json")
MIB = 2**20
SLICE = 64 * MIB
GPU = Gpu(id="sim-apple-0", index=0, vendor=Vendor.APPLE, model="Apple M3 Max", backend="simulated",
          memory_bytes=2048 * MIB, simulated=True)


def why_not_here() -> str | None:
    if shutil.which(CROSS_CC) is None or not Path("/usr/lib/aarch64-linux-gnu/libvulkan.so").exists():
        return f"no {CROSS_CC} or arm64 libvulkan-dev here (Debian: gcc-aarch64-linux-gnu libvulkan-dev:arm64)"
    if shutil.which(QEMU) is None:
        return f"no {QEMU} here (Debian: qemu-user-static)"
    if not ARM64_LOADER.exists() or not ARM64_LAVAPIPE.exists():
        return "no arm64 Vulkan loader and lavapipe here (Debian: libvulkan1:arm64 mesa-vulkan-drivers:arm64)"
    return None


def make(target: str, out: Path, *extra: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "-C", str(LAYER_SOURCE), target, f"OUT={out}",
                           f"CC={CROSS_CC}", *extra], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = why_not_here()
    if reason is not None:
        pytest.skip(f"the aarch64 layer cannot run here: {reason}")
    out = tmp_path_factory.mktemp("aarch64")
    result = make("all", out, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    head = (out / LIBRARY).read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183, "EM_AARCH64"
    return out


def probe(built: Path, tmp_path: Path, budgets: list[int], *args: str) -> dict[str, Any]:
    """gpuppetti-vkinfo for aarch64 under qemu, on the arm64 lavapipe, under the aarch64 layer (an implicit layer, as
    in a container), held to ``budgets`` by an allocation's ledger served as the daemons serve it."""
    served = ServedLayer(short_tmpdir() / "vulkan", built)
    layer = served.layer
    name, edits = served.allocation([Budget(GPU, budget) for budget in budgets])
    env = {key: value for key, value in os.environ.items() if not key.startswith(("VK_", "GPUPPETTI_"))}
    env.update(served.host_env(name, edits))
    layers = tmp_path / "data" / "vulkan" / "implicit_layer.d"
    layers.mkdir(parents=True)
    document: Any = manifest()
    document["layer"]["library_path"] = str(layer.path / LIBRARY)
    (layers / "VkLayer_gpuppetti.json").write_text(json.dumps(document))
    env.update(XDG_DATA_HOME=str(tmp_path / "data"), XDG_DATA_DIRS="/nonexistent", XDG_CONFIG_DIRS="/nonexistent",
               VK_DRIVER_FILES=str(ARM64_LAVAPIPE), VK_ICD_FILENAMES=str(ARM64_LAVAPIPE))
    try:
        result = subprocess.run([QEMU, "-L", "/", str(layer.path / PROBE), "--json", *args], env=env,
                                capture_output=True, text=True, timeout=120, check=False)
    finally:
        served.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout)
    return report


@pytest.mark.timeout(300)
def test_the_aarch64_layer_holds_the_probe_to_its_slice(built: Path, tmp_path: Path) -> None:
    report = probe(built, tmp_path, [SLICE], "--allocate", "16")
    assert report["layer"] is True
    [device] = report["devices"]
    assert device["memory_budget"] is True, "the layer adds VK_EXT_memory_budget, which lavapipe lacks"
    [heap] = [h for h in device["heaps"] if h["device_local"]][:1]
    assert heap["size"] == SLICE
    assert heap["budget"] == SLICE
    assert report["allocation"]["obtained"] == SLICE
    assert report["allocation"]["refused_with"] == "VK_ERROR_OUT_OF_DEVICE_MEMORY"
    assert report["allocation"]["heap_usage_after"] == SLICE


@pytest.mark.timeout(300)
def test_the_aarch64_parsers_survive_fuzzing(tmp_path: Path) -> None:
    reason = why_not_here()
    if reason is not None:
        pytest.skip(f"the aarch64 parsers cannot be fuzzed here: {reason}")
    # The plain driver (libFuzzer is this machine's clang's, not aarch64's), without the sanitizers (qemu-user cannot
    # give them their shadow memory), for a short time each: emulated, it is slow.
    result = make("fuzz", tmp_path, "FUZZ_CC=", "SANITIZE=-g -O1", f"EMULATOR={QEMU} -L /", "FUZZ_SECONDS=2",
                  timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for target in ("slices", "compute", "hello"):
        assert f"fuzz-{target}: 2 s" in result.stdout
    assert result.stdout.count("no failure") == 3, result.stdout
