"""make gpu-check: what gpuppetti does with this host's real GPU, in one run a user can repeat on any GPU host.

1. `gpuppetti discover`: the GPUs found (the backend chosen as the daemons choose it).
2. `gpuppetti doctor`: the host's readiness, Vulkan driver and layer included.
3. The Vulkan layer holding `gpuppetti-vkinfo` to a 256 MiB slice of the first GPU: its heaps and budget report the
   slice, and allocation stops at the slice's edge with VK_ERROR_OUT_OF_DEVICE_MEMORY.
4. A real application inside that slice: wgpu (where `import wgpu` works for --wgpu-python, e.g. the test suite's
   application venv), its adapter's limits no larger than the slice and a compute shader's result correct.

The layer is installed as an implicit layer for these processes only (XDG_DATA_HOME), as it is in a container:
nothing on the host is changed. Exit status 0 when every step that could run passed; a step that cannot run here
says why and is skipped.
"""

from __future__ import annotations

import argparse
import array
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpuppetti.core.model import Gpu, Vendor
from gpuppetti.layer.vulkan import BUILT, LIBRARY, MANIFEST, PROBE, manifest
from gpuppetti.sharing.budgets import Budget
from tests.apps.wgpu_app import values
from tests.ledger_client import ServedLayer

MIB = 2**20
SLICE = 256 * MIB
# The slice is of whatever Vulkan device the first is: selected as "any", as a simulated GPU's is.
GPU = Gpu(id="gpu-check", index=0, vendor=Vendor.VIRTIO, model="the first Vulkan device", backend="simulated",
          simulated=True)
WGPU_APP = Path(__file__).resolve().parents[1] / "tests" / "apps" / "wgpu_app.py"


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    print(result.stdout.rstrip())
    if result.stderr.strip():
        print(result.stderr.rstrip())
    return result


def layer_env(root: Path) -> tuple[dict[str, str], ServedLayer]:
    """An installed layer, an allocation of one SLICE-sized slice of the first GPU served as a daemon serves it, and
    the env that runs under it (stop the ServedLayer after)."""
    served = ServedLayer(root / "vulkan")
    # The manifest as in a container, but naming the library where it is on this host.
    implicit = root / "data" / "vulkan" / "implicit_layer.d"
    implicit.mkdir(parents=True)
    document: dict[str, Any] = manifest()
    document["layer"]["library_path"] = str(served.layer.path / LIBRARY)
    (implicit / MANIFEST).write_text(json.dumps(document, indent=2))
    name, edits = served.allocation([Budget(GPU, SLICE)])
    return {**os.environ, "XDG_DATA_HOME": str(root / "data"), **served.host_env(name, edits)}, served


def check_layer(env: dict[str, str], probe: Path) -> bool:
    ok = True
    result = subprocess.run([str(probe), "--json"], capture_output=True, text=True, env=env, timeout=300,
                            check=False)
    if result.returncode != 0:
        print("FAILED: gpuppetti-vkinfo could not use Vulkan under the layer")
        return False
    report = json.loads(result.stdout)
    print(f"layer loaded: {report.get('layer')}")
    for device in report.get("devices", []):
        counted = [heap for heap in device["heaps"] if heap["size"] <= SLICE]
        print(f"{device.get('name')}: heaps {[heap['size'] // MIB for heap in device['heaps']]} MiB")
        ok &= bool(counted)
    allocated = subprocess.run([str(probe), "--json", "--allocate", "16"], capture_output=True, text=True, env=env,
                               timeout=300, check=False)
    allocation: dict[str, Any] = json.loads(allocated.stdout).get("allocation", {}) if allocated.returncode == 0 else {}
    print(f"allocation in 16 MiB chunks: {json.dumps(allocation)}")
    ok &= int(allocation.get("obtained", SLICE + 1)) <= SLICE
    ok &= str(allocation.get("refused_with")) == "VK_ERROR_OUT_OF_DEVICE_MEMORY"
    print("ok: held to the slice" if ok else "FAILED: not held to the slice")
    return ok


def check_wgpu(env: dict[str, str], python: str) -> bool | None:
    probe = subprocess.run([python, "-c", "import wgpu"], capture_output=True, check=False)
    if probe.returncode != 0 or not WGPU_APP.exists():
        print(f"skipped: wgpu is not importable by {python} (pip install wgpu, or --wgpu-python)")
        return None
    quiet = {**env, "XDG_RUNTIME_DIR": env.get("XDG_RUNTIME_DIR", tempfile.gettempdir())}
    info = subprocess.run([python, str(WGPU_APP), "info"], capture_output=True, text=True, env=quiet, timeout=300,
                          check=False)
    doubled = subprocess.run([python, str(WGPU_APP), "double", "--mib", "16", "--seed", "7"], capture_output=True,
                             text=True, env=quiet, timeout=300, check=False)
    if info.returncode != 0 or doubled.returncode != 0:
        print(f"FAILED: wgpu did not run inside the slice: {(info.stderr + doubled.stderr)[-2000:]}")
        return False
    report = json.loads(info.stdout.splitlines()[-1])
    limit = report["limits"]["max-buffer-size"]
    print(f"wgpu {report['wgpu']} on {report['adapter']['device']}: max-buffer-size {limit // MIB} MiB")
    # What doubling the input gives, computed here: the shader's result must be exactly that.
    words = array.array("I", values(16 * MIB, 7))
    expected = hashlib.sha256(array.array("I", ((w * 2) & 0xFFFFFFFF for w in words)).tobytes()).hexdigest()
    correct: bool = json.loads(doubled.stdout.splitlines()[-1])["sha256"] == expected
    print(f"a compute shader doubled 16 MiB: {'correct' if correct else 'WRONG'}")
    fits = limit <= SLICE
    print("ok: wgpu ran inside the slice" if fits and correct else "FAILED: wgpu was not held to the slice")
    return fits and correct


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpuppetti" / "apps" / "venv"
    default = cache / "bin" / "python" if (cache / "bin" / "python").exists() else Path(sys.executable)
    parser.add_argument("--wgpu-python", default=str(default),
                        help="a Python that can import wgpu (default: the test suite's application venv where it "
                             "exists, else this one)")
    args = parser.parse_args()
    gpuppetti = [sys.executable, "-m", "gpuppetti"]
    failed = False
    step("gpuppetti discover")
    failed |= run([*gpuppetti, "discover"]).returncode != 0
    step("gpuppetti doctor")
    run([*gpuppetti, "doctor"])  # warnings and a missing cluster are expected on a bare host
    step(f"the Vulkan layer: gpuppetti-vkinfo held to a {SLICE // MIB} MiB slice")
    if not (BUILT / LIBRARY).exists() or not (BUILT / PROBE).exists():
        print("FAILED: this installation has no built Vulkan layer (make native)")
        return 1
    with tempfile.TemporaryDirectory(prefix="gpuppetti-gpu-check-") as directory:
        env, served = layer_env(Path(directory))
        try:
            failed |= not check_layer(env, Path(directory) / "vulkan" / PROBE)
            step(f"a real application inside the {SLICE // MIB} MiB slice: wgpu")
            failed |= check_wgpu(env, shutil.which(args.wgpu_python) or args.wgpu_python) is False
        finally:
            served.stop()
    print("\ngpu-check: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
