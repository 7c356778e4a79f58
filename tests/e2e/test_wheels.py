"""`make dist` from a clean clone: an sdist and one wheel per architecture (x86_64, and aarch64 cross-compiled), each
tagged manylinux as PyPI takes it, the lowest tag its binaries satisfy, and carrying a layer and probe of its own
architecture."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

from tests.packaging import (
    DIST_ARCHES,
    ELF_MACHINES,
    NATIVE,
    SYSTEM_LIBRARIES,
    clean_clone,
    elf_facts,
    lowest_manylinux,
    make_dist,
    members,
    native_files,
    only,
    wheel_tag,
    why_no_dist,
)

pytestmark = pytest.mark.e2e

# What PyPI takes: a PEP 600 platform tag, never linux_<arch>.
WHEEL_NAME = re.compile(r"^gpuppetti-[0-9][^-]*-py3-none-(manylinux_2_[0-9]+_(x86_64|aarch64))\.whl$")


@pytest.fixture
def dist(dist_dir: Path) -> Path:
    return dist_dir


def wheels(dist: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for wheel in dist.glob("*.whl"):
        match = WHEEL_NAME.match(wheel.name)
        assert match is not None, f"{wheel.name} is not a manylinux wheel PyPI would take"
        found[match.group(2)] = wheel
    return found


def test_dist_holds_an_sdist_and_a_manylinux_wheel_per_architecture(dist: Path) -> None:
    assert sorted(path.name for path in dist.iterdir() if not path.name.endswith(".whl")) == [
        only(dist, "gpuppetti-*.tar.gz").name]
    with tarfile.open(only(dist, "gpuppetti-*.tar.gz")) as sdist:
        assert not [name for name in sdist.getnames() if name.endswith(".so") or "/_native/" in name]
    built = wheels(dist)
    assert sorted(built) == sorted(DIST_ARCHES)
    for arch, wheel in built.items():
        # The tag inside the wheel is the one in its name.
        assert wheel_tag(wheel) == wheel.name.removesuffix(".whl").split("-", 2)[2], wheel.name
        listed = members(wheel)
        for name in NATIVE:
            assert listed[name].mode & 0o111, f"{name} is not executable in {wheel.name}"
        assert not [name for name in listed if "libvulkan" in name], f"{wheel.name} carries a Vulkan loader"
        assert arch in wheel.name


@pytest.mark.parametrize("arch", DIST_ARCHES)
def test_each_wheels_binaries_are_of_its_architecture(dist: Path, arch: str) -> None:
    for name, data in native_files(wheels(dist)[arch]).items():
        assert elf_facts(data).machine == ELF_MACHINES[arch], f"{name} in the {arch} wheel"


@pytest.mark.parametrize("arch", DIST_ARCHES)
def test_each_wheels_tag_is_the_lowest_manylinux_its_symbol_versions_fit(dist: Path, arch: str) -> None:
    wheel = wheels(dist)[arch]
    elves = [elf_facts(data) for data in native_files(wheel).values()]
    # What the layer and probe need of the system: glibc's libraries, and the Vulkan loader for the probe.
    for facts in elves:
        assert "libc.so.6" in facts.needed
        assert any(version.startswith("GLIBC_") for version in facts.versions["libc.so.6"])
    assert all(any(library in facts.needed for facts in elves) for library in SYSTEM_LIBRARIES)
    tag = wheel_tag(wheel).split("-")[2]
    assert tag == lowest_manylinux(arch, elves), f"{wheel.name}: its binaries need {[e.versions for e in elves]}"


def test_a_missing_cross_compiler_is_one_clear_line(tmp_path: Path) -> None:
    reason = why_no_dist()
    if reason is not None:
        pytest.skip(f"`make dist` cannot run here: {reason}")
    clone = clean_clone(tmp_path / "gpuppetti")
    result = make_dist(clone, "DIST_ARCHES=x86_64 riscv64")
    assert result.returncode != 0
    [line] = [line for line in result.stderr.splitlines() if line.startswith("make dist:")]
    assert line == ("make dist: no riscv64-linux-gnu-gcc for the riscv64 wheel (Debian: apt-get install "
                    "gcc-riscv64-linux-gnu libvulkan-dev:riscv64)")
    assert "Traceback" not in result.stdout + result.stderr
    assert not list((clone / "dist").glob("*.whl"))
