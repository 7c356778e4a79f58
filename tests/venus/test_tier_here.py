"""The venus tier's own machinery, on this host (no VM): the guide's config it runs, the wheel's identity, and the
watch for a guest that stopped moving."""

from __future__ import annotations

import zipfile
from pathlib import Path

from gpuppetti.core.config import parse_config
from tests.venus import venusnode

# What the guest kernel printed when an emulated VM here stopped moving, and when a task hung in virtio-gpu.
RCU_STALL = ("[  102.707391] rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:\n"
             "[  102.709645] rcu: \t1-...!: (0 ticks this GP) idle=95f8/0/0x0 softirq=1894/1894 fqs=0\n")
HUNG_TASK = "[  242.599074] INFO: task gpuppetti-vkinf:251 blocked for more than 120 seconds.\n"


def test_the_guides_virtio_config_is_found_and_valid() -> None:
    config = parse_config(venusnode.guide_virtio_config(), "docs/apple-silicon.md")
    assert config.backend == "drm"
    assert (config.virtio.vendor, config.virtio.model, config.virtio.cores) == ("apple", "Apple M3 Max", 40)


def test_a_rebuilt_wheel_of_the_same_tree_is_installed_once(tmp_path: Path) -> None:
    def wheel(name: str, date: tuple[int, int, int, int, int, int], body: bytes) -> Path:
        path = tmp_path / name / "gpuppetti-0.1.0-py3-none-linux_x86_64.whl"
        path.parent.mkdir()
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(zipfile.ZipInfo("gpuppetti/__init__.py", date), body)
        return path

    first = wheel("a", (2026, 1, 1, 0, 0, 0), b"x = 1\n")
    again = wheel("b", (2026, 1, 2, 0, 0, 0), b"x = 1\n")
    changed = wheel("c", (2026, 1, 1, 0, 0, 0), b"x = 2\n")
    assert first.read_bytes() != again.read_bytes(), "the build's times differ"
    assert venusnode.wheel_digest(first) == venusnode.wheel_digest(again)
    assert venusnode.wheel_digest(first) != venusnode.wheel_digest(changed)


def test_a_guest_that_stopped_moving_is_seen_in_its_console(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    old, new = runs / "run.old", runs / "run.new"
    for run in (old, new):
        run.mkdir(parents=True)
    (old / "serial.log").write_text(HUNG_TASK)
    (new / "serial.log").write_text("venusnode-guest: userspace up [t=7.72s]\n")
    assert venusnode._stall(runs, {"run.old"}) is None, "an earlier run's console is not this one's"
    (new / "serial.log").write_text("venusnode-guest: userspace up [t=5.39s]\n" + RCU_STALL)
    assert venusnode._stall(runs, {"run.old"}) == "rcu: INFO: rcu_preempt detected stalls"
    assert venusnode._stall(runs, {"run.new"}) == "INFO: task gpuppetti-vkinf:251 blocked for more than 120 seconds"
