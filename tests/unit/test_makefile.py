"""The Makefile's own behaviour where it speaks to a new user: plain `make`, and `make dist`'s checks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def _make(workdir: Path, *args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    venv = Path(sys.prefix)
    env = {"PATH": path or "/usr/bin:/bin"}
    return subprocess.run(["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "-o", str(venv / ".installed"),
                           f"VENV={venv}", *args], cwd=workdir, capture_output=True, text=True, timeout=60, env=env)


def test_plain_make_lists_the_targets(tmp_path: Path) -> None:
    result = _make(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "is up to date" not in result.stdout
    for target in ("demo", "test", "unit", "dist", "image", "clean"):
        assert f"make {target} " in result.stdout, result.stdout


def test_make_dist_checks_each_architecture_first_and_names_the_right_package(tmp_path: Path) -> None:
    # A cross compiler that finds no arm64 Vulkan loader (as gcc -print-file-name says: the bare name).
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "aarch64-linux-gnu-gcc").write_text(
        '#!/bin/sh\nfor a; do case $a in -print-file-name=*) echo "${a#*=}"; exit 0;; esac; done\nexit 1\n')
    (shims / "aarch64-linux-gnu-gcc").chmod(0o755)
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "earlier.whl").write_text("")
    result = _make(tmp_path, "DIST_ARCHES=aarch64", "dist", path=f"{shims}:/usr/bin:/bin")
    assert result.returncode != 0
    assert ("make dist: aarch64-linux-gnu-gcc finds no libvulkan.so for the aarch64 wheel (Debian: dpkg "
            "--add-architecture arm64 && apt-get update && apt-get install libvulkan-dev:arm64)") in result.stderr
    assert (tmp_path / "dist" / "earlier.whl").exists(), "nothing is removed or built before the checks pass"
    result = _make(tmp_path, "DIST_ARCHES=riscv64", "dist")
    assert "no riscv64-linux-gnu-gcc for the riscv64 wheel (Debian: apt-get install gcc-riscv64-linux-gnu " \
           "libvulkan-dev:riscv64)" in result.stderr
    assert (tmp_path / "dist" / "earlier.whl").exists()
