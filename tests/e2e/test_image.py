"""The Dockerfile builds linux/amd64 and linux/arm64 on this x86 machine without emulation, into one manifest list
(`make image PLATFORMS=...`), from local bases (tests/imagebases.py: no registry here) and offline (the targets'
wheels downloaded here beforehand, given to the build's pip with PIP_OPTIONS): each image holds a layer of its
architecture on a base of its architecture, and the amd64 one runs."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuppetti.kubelet.sandbox import PODMAN_FLAGS, RUN_FLAGS
from tests import imagebases
from tests.packaging import ELF_MACHINES, clean_clone, elf_facts, why_no_build

# The first test builds the bases once per machine (minutes) and both images (about 90 s).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

IMAGE = "localhost/gpuppetti-test:multiarch"
PYTHON_VERSION = "3.11"
ARCHES = {"amd64": "x86_64", "arm64": "aarch64"}
NATIVE_IN_IMAGE = "/opt/gpuppetti/gpuppetti/_native"


def wheelhouse(destination: Path) -> Path:
    """The targets' wheels of every dependency (the nvml extra's too), and setuptools for the build, fetched here
    from the index as the build's pip would, so that the build itself needs no network."""
    requirements = [re.sub(r";.*$", "", requirement).strip()
                    for requirement in importlib.metadata.requires("gpuppetti") or []
                    if "extra ==" not in requirement or 'extra == "nvml"' in requirement]
    platforms = [flag for n in range(17, 37) for flag in ("--platform", f"manylinux_2_{n}_{{arch}}")]
    for arch in ARCHES.values():
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--implementation", "cp",
             "--python-version", PYTHON_VERSION, "--platform", f"manylinux2014_{arch}",
             *[flag.format(arch=arch) for flag in platforms], "--dest", str(destination),
             "setuptools>=70.1", *requirements], capture_output=True, text=True, timeout=600, check=False)
        assert result.returncode == 0, result.stderr[-2000:]
    return destination


def podman(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *PODMAN_FLAGS, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Each platform's image in the manifest list: {architecture: digest}."""
    reason = why_no_build() or imagebases.why_not_here()
    if reason is not None:
        pytest.skip(f"the image cannot be built here: {reason}")
    started = time.monotonic()
    try:
        base = imagebases.prepare()
    except imagebases.CannotPrepare as exc:
        pytest.skip(f"no local base images: {exc}")
    prepared = time.monotonic()
    work = tmp_path_factory.mktemp("image")
    clone = clean_clone(work / "gpuppetti")
    wheels = wheelhouse(work / "wheels")
    build_flags = shlex.join([
        "--pull=never", "--no-cache", "--layers=false", "--network=none", "--ulimit=nofile=1024:1024",
        "--ulimit=nproc=1024:1024",
        f"--volume={wheels}:/wheelhouse:ro", f"--build-arg=BASE_IMAGE={base}",
        f"--build-arg=BUILD_IMAGE={imagebases.BUILD_IMAGE}", f"--build-arg=PYTHON_VERSION={PYTHON_VERSION}",
        "--build-arg=PIP_OPTIONS=--no-index --find-links /wheelhouse"])
    result = subprocess.run(["make", "--no-print-directory", "image", f"IMAGE={IMAGE}",
                             "PLATFORMS=linux/amd64,linux/arm64", f"IMAGE_BUILD_FLAGS={build_flags}",
                             f"CONTAINER_TOOL=podman {' '.join(PODMAN_FLAGS)}"],
                            cwd=clone, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(f"bases {prepared - started:.0f} s, build {time.monotonic() - prepared:.0f} s", file=sys.stderr)
    listed = json.loads(podman("manifest", "inspect", IMAGE).stdout)
    built = {entry["platform"]["architecture"]: entry["digest"] for entry in listed["manifests"]}
    ids = [podman("image", "inspect", "--format", "{{.Id}}", f"{IMAGE}@{digest}").stdout.strip()
           for digest in built.values()]
    yield built
    # Built anew each run (--no-cache): the list and its images go, the bases stay.
    podman("manifest", "rm", IMAGE)
    podman("rmi", "--force", *[image for image in ids if image])


def copied_out(image: str, path: str, destination: Path) -> bytes:
    """A file of the image, read without running anything in it."""
    created = podman("create", image)
    assert created.returncode == 0, created.stderr
    container = created.stdout.strip()
    try:
        copied = podman("cp", f"{container}:{path}", str(destination))
        assert copied.returncode == 0, copied.stderr
    finally:
        podman("rm", "--force", container)
    return destination.read_bytes()


def test_the_manifest_list_holds_both_platforms(images: dict[str, str]) -> None:
    assert sorted(images) == sorted(ARCHES)


@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_each_image_holds_a_layer_and_a_python_of_its_architecture(images: dict[str, str], arch: str,
                                                                    tmp_path: Path) -> None:
    image = f"{IMAGE}@{images[arch]}"
    machine = ELF_MACHINES[ARCHES[arch]]
    for name in ("libVkLayer_gpuppetti.so", "gpuppetti-vkinfo"):
        data = copied_out(image, f"{NATIVE_IN_IMAGE}/{name}", tmp_path / name)
        assert elf_facts(data).machine == machine, f"{name} in the {arch} image"
    # The base is the platform's own (the manifest list of bases resolved per platform), and so are the wheels.
    python = copied_out(image, f"/usr/bin/python{PYTHON_VERSION}", tmp_path / "python")
    assert elf_facts(python).machine == machine
    inspected = podman("image", "inspect", "--format", "{{.Architecture}}", image)
    assert inspected.stdout.strip() == arch, inspected.stderr


def test_the_amd64_image_runs(images: dict[str, str]) -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("only the image of this machine's architecture runs here")
    image = f"{IMAGE}@{images['amd64']}"
    helped = podman("run", *RUN_FLAGS, image, "--help")
    assert helped.returncode == 0, helped.stderr
    assert "usage: gpuppetti" in helped.stdout
    checked = podman("run", *RUN_FLAGS, "--entrypoint", "python3", image, "-c",
                     "import gpuppetti.layer.vulkan as v; print(v.missing_files())")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.strip() == "[]"

