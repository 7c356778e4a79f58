"""What a slice's figures say while its processes live and once they are killed, with the built layer on Mesa's
lavapipe in processes of this host (the ledger needs no container): /metrics, `top` and the reports read the
ledger's usage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpuppetti.core.model import ContainerEdits
from gpuppetti.kubelet.sandbox import vulkan_icd
from gpuppetti.layer.vulkan import BUILT, LIBRARY, MANIFEST, PROBE, manifest
from gpuppetti.sharing.budgets import Budget
from tests.e2e.test_vulkan_layer import SIMULATED
from tests.helpers import short_tmpdir
from tests.ledger_client import ServedLayer

pytestmark = pytest.mark.e2e

MIB = 2**20
SLICE = 256 * MIB


def layer_env(tmp_path: Path, served: ServedLayer, name: str, edits: ContainerEdits) -> dict[str, str]:
    """The env of a container's process, with the built layer installed as an implicit layer of this user's."""
    icd = vulkan_icd()
    if not (BUILT / LIBRARY).exists() or not (BUILT / PROBE).exists() or icd is None:
        pytest.skip("needs the built layer (make native) and lavapipe (Debian: libvulkan1 mesa-vulkan-drivers)")
    implicit = tmp_path / "data" / "vulkan" / "implicit_layer.d"
    implicit.mkdir(parents=True)
    described = manifest()
    layer_part = described["layer"]
    assert isinstance(layer_part, dict)
    layer_part["library_path"] = str(BUILT / LIBRARY)
    (implicit / MANIFEST).write_text(json.dumps(described))
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "XDG_DATA_HOME": str(tmp_path / "data"),
            "XDG_DATA_DIRS": "/nonexistent", "XDG_CONFIG_DIRS": "/nonexistent", "VK_DRIVER_FILES": str(icd),
            "VK_ICD_FILENAMES": str(icd), **served.host_env(name, edits)}


@pytest.mark.timeout(120)
def test_a_killed_processs_memory_leaves_the_slices_figures_at_once(tmp_path: Path) -> None:
    # A socket's path is short: not under pytest's own temporary directory.
    served = ServedLayer(short_tmpdir() / "vulkan")
    name, edits = served.allocation([Budget(SIMULATED, SLICE)])
    env = layer_env(tmp_path, served, name, edits)
    holder = subprocess.Popen([str(BUILT / PROBE), "--allocate", "32", "--limit", "96", "--hold", "600"], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        said = ""
        while "allocated" not in said and holder.poll() is None:
            said = holder.stdout.readline()
        assert "allocated 3 chunk(s) of 32 MiB" in said and ": 96 MiB" in said, said
        [use] = served.usage(name)
        assert use.used == 96 * MIB and use.budget == SLICE
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 5
    while served.usage(name)[0].used and time.monotonic() < deadline:
        time.sleep(0.01)
    [use] = served.usage(name)
    served.stop()
    assert use.used == 0, "a killed process's 96 MiB is gone from the figures before any process of the slice starts"
