"""What users install: the package built from a clean clone of this repository, as pip and the Dockerfile build it.

The build runs without build isolation (the test venv's setuptools), so that it needs no network; installing the
wheel's dependencies into a fresh venv does (PyPI, as the Dockerfile's build does).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# -- the wheels `make dist` writes, one per architecture, and what their ELF files need --------------------------------
DIST_ARCHES = ("x86_64", "aarch64")
# ELF's e_machine for each wheel architecture.
ELF_MACHINES = {"x86_64": "EM_X86_64", "aarch64": "EM_AARCH64"}
# The probe's Vulkan loader is the system's (the one the GPU's driver is installed for): never carried in a wheel.
SYSTEM_LIBRARIES = frozenset({"libvulkan.so.1"})


def cross_compiler(arch: str) -> str:
    return f"{arch}-linux-gnu-gcc"


def why_no_dist() -> str | None:
    """Why `make dist` cannot build every architecture's wheel here, or None."""
    if (reason := why_no_build()) is not None:
        return reason
    if shutil.which("make") is None:
        return "no make here"
    for arch in DIST_ARCHES:
        if shutil.which(cross_compiler(arch)) is None:
            return f"no {cross_compiler(arch)} here (Debian: gcc-{arch.replace('_', '-')}-linux-gnu)"
        if not Path(f"/usr/lib/{arch}-linux-gnu/libvulkan.so").exists():
            return f"no libvulkan-dev for {arch} here (Debian: libvulkan-dev as a foreign architecture)"
    return None


def make_dist(source: Path) -> subprocess.CompletedProcess[str]:
    """`make dist` in source, with this interpreter's venv (which has the dev extras) as its venv."""
    venv_dir = Path(sys.prefix)
    return _run(["make", "--no-print-directory", "-o", str(venv_dir / ".installed"), f"VENV={venv_dir}", "dist"],
                source)


@dataclass(frozen=True)
class ElfFacts:
    machine: str
    needed: frozenset[str]
    # Per library, the symbol versions it must define (GLIBC_2.34, ...).
    versions: dict[str, frozenset[str]]


def elf_facts(data: bytes) -> ElfFacts:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection

    elf = ELFFile(io.BytesIO(data))
    needed: set[str] = set()
    versions: dict[str, frozenset[str]] = {}
    for section in elf.iter_sections():
        if isinstance(section, DynamicSection):
            # pyelftools gives a DT_NEEDED tag its library's name as an attribute of that kind of tag alone.
            needed |= {str(tag.needed) for tag in section.iter_tags()  # type: ignore[attr-defined]
                       if tag.entry.d_tag == "DT_NEEDED"}
        elif isinstance(section, GNUVerNeedSection):
            for verneed, auxiliaries in section.iter_versions():
                versions[str(verneed.name)] = frozenset(str(aux.name) for aux in auxiliaries)
    return ElfFacts(str(elf.header["e_machine"]), frozenset(needed), versions)


def native_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in NATIVE}


def manylinux_policies() -> list[dict[str, Any]]:
    """The manylinux policies (PEP 600), most compatible first, as auditwheel holds them."""
    from importlib.resources import files

    policies: list[dict[str, Any]] = json.loads((files("auditwheel.policy") / "manylinux-policy.json").read_text())
    return sorted((p for p in policies if p["name"].startswith("manylinux_")), key=lambda p: -int(p["priority"]))


def _fits(policy: dict[str, Any], arch: str, facts: ElfFacts) -> bool:
    allowed = policy["symbol_versions"].get(arch)
    # The dynamic linker is glibc's own (auditwheel's policies take it beside libc.so.6 without listing it).
    others = {name for name in facts.needed if not name.startswith(("ld-linux", "ld64.so."))}
    if allowed is None or not others <= set(policy["lib_whitelist"]) | SYSTEM_LIBRARIES:
        return False
    for library, versions in facts.versions.items():
        if library in SYSTEM_LIBRARIES:
            continue
        for version in versions:
            family, _, number = version.partition("_")
            if number not in allowed.get(family, ()):
                return False
    return True


def lowest_manylinux(arch: str, elves: list[ElfFacts]) -> str | None:
    """The most compatible manylinux tag every one of the ELF files satisfies (its libraries and symbol versions), or
    None."""
    for policy in manylinux_policies():
        if all(_fits(policy, arch, facts) for facts in elves):
            return f"{policy['name']}_{arch}"
    return None
