"""What users install: the package built from a clean clone of this repository, as pip and the Dockerfile build it.

The build runs without build isolation (the test venv's setuptools), so that it needs no network; installing the
wheel's dependencies into a fresh venv does (PyPI, as the Dockerfile's build does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NATIVE = ("gpuppetti/_native/libVkLayer_gpuppetti.so", "gpuppetti/_native/gpuppetti-vkinfo")


def why_no_build() -> str | None:
    """Why the package with its layer cannot be built from a clean clone here, or None."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return "not a git checkout (a clean clone is built from the repository's HEAD)"
    if shutil.which(os.environ.get("CC", "cc")) is None or not Path("/usr/include/vulkan/vulkan.h").exists():
        return "no C compiler or Vulkan headers here (Debian: gcc libvulkan-dev)"
    return None


def clean_clone(destination: Path) -> Path:
    """HEAD of this repository, cloned: what is committed, nothing that a build left in the working tree."""
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(destination)], check=True,
                   capture_output=True, timeout=120)
    return destination


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **(env or {})}
    return subprocess.run(args, cwd=cwd, env=environment, capture_output=True, text=True, timeout=600, check=False)


def pip_wheel(source: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`pip wheel .` in source, as the Dockerfile builds the package (the layer required)."""
    return _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                 "--wheel-dir", str(out), "."], source, {"GPUPPETTI_REQUIRE_LAYER": "1", **(env or {})})


def sdist_then_wheel(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """An sdist, and a wheel built from that sdist (python -m build's default): the sdist must carry the layer."""
    return _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), "."], source,
                {"GPUPPETTI_REQUIRE_LAYER": "1"})


def only(directory: Path, pattern: str) -> Path:
    [found] = sorted(directory.glob(pattern))
    return found


@dataclass(frozen=True)
class Member:
    name: str
    size: int
    mode: int


def members(wheel: Path) -> dict[str, Member]:
    with zipfile.ZipFile(wheel) as archive:
        return {info.filename: Member(info.filename, info.file_size, (info.external_attr >> 16) & 0o7777)
                for info in archive.infolist()}


def wheel_tag(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/WHEEL")]
        lines = archive.read(name).decode().splitlines()
    return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Tag:"))


def venv_with(wheel: Path, destination: Path, compile: bool = True) -> Path:
    """A fresh venv with the wheel installed the way a user installs it (its dependencies from the index), by this
    interpreter's pip (``--python``: the venv needs no pip of its own). ``compile=False`` leaves out the bytecode
    (most of the install's CPU) where nothing runs long enough to miss it."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(destination)
    python = destination / "bin" / "python"
    result = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                   "--disable-pip-version-check", *([] if compile else ["--no-compile"]), str(wheel)], destination)
    if result.returncode != 0:
        raise RuntimeError(f"installing {wheel.name} into a fresh venv failed:\n{result.stderr[-2000:]}")
    return destination
