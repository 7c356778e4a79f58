"""Local base images for building the Dockerfile where no registry can be reached: Debian rootfs made with debootstrap
and imported with `podman import`, cached per machine under /tmp (GPUPPETTI_IMAGE_BASES) so that CI pays for them once.

- the build image (amd64): python3 and pip, gcc, the aarch64 cross compiler, libvulkan-dev for amd64 and (unpacked
  from Debian's libvulkan-dev:arm64 and libvulkan1:arm64) for arm64, and pci.ids; it also serves as the amd64 base;
- the arm64 base: `debootstrap --foreign --arch=arm64` with python3, its packages unpacked and nothing arm64 run
  (they are not configured: nothing needs them to be, as the final stage only copies);
- a manifest list naming both bases, which `podman build --platform linux/amd64,linux/arm64` resolves per platform.

`python -m tests.imagebases` makes them ahead of the tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gpuppetti.kubelet.sandbox import PODMAN_FLAGS
from tests import helpers

STATE_DIR = Path(os.environ.get("GPUPPETTI_IMAGE_BASES", "/tmp/gpuppetti-image-bases"))
LOCK = STATE_DIR.parent / f"{STATE_DIR.name}.lock"
SUITE = "bookworm"
BUILD_IMAGE = "localhost/gpuppetti-base:build-amd64"
ARM64_BASE = "localhost/gpuppetti-base:arm64"
# The manifest list the Dockerfile's BASE_IMAGE names: the build image for amd64, the foreign rootfs for arm64.
BASE_LIST = "localhost/gpuppetti-base:bookworm"
BUILD_PACKAGES = ("python3", "python3-pip", "gcc", "libc6-dev", "gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross",
                  "libvulkan-dev", "pci.ids")
FOREIGN_DEBS = ("libvulkan-dev:arm64", "libvulkan1:arm64")


class CannotPrepare(Exception):
    """The bases cannot be made here; the message is the one-line reason."""


def why_not_here() -> str | None:
    if os.geteuid() != 0:
        return "not root: debootstrap and podman run as root here"
    for tool, package in (("debootstrap", "debootstrap"), ("podman", "podman")):
        if shutil.which(tool) is None:
            return f"no {tool} here (Debian: {package})"
    return None


def mirror() -> str:
    """The Debian mirror this machine's apt uses (its sources), else Debian's own."""
    for sources in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        try:
            text = sources.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if words[:1] == ["URIs:"] and len(words) > 1:
                return words[1].rstrip("/")
            if words[:1] == ["deb"] and len(words) > 2:
                return words[1].rstrip("/")
    return "http://deb.debian.org/debian"


def podman(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *PODMAN_FLAGS, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def _run(args: list[str], log: Path, timeout: float = 900, cwd: Path | None = None) -> None:
    with log.open("a") as out:
        result = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False, cwd=cwd)
    if result.returncode != 0:
        raise CannotPrepare(f"{' '.join(args[:3])} failed (log: {log})")


def _rootfs(name: str, debootstrap: list[str], finish: Callable[[Path, Path], None] | None = None) -> Path:
    """The tarball of a rootfs made once by debootstrap (then ``finish(root, log)``), kept in STATE_DIR."""
    archive = STATE_DIR / f"{name}.tar"
    if archive.exists():
        return archive
    root = STATE_DIR / f"{name}.partial"
    shutil.rmtree(root, ignore_errors=True)
    log = STATE_DIR / f"{name}.log"
    log.unlink(missing_ok=True)
    _run(["debootstrap", "--variant=minbase", *debootstrap, SUITE, str(root), mirror()], log)
    if finish is not None:
        finish(root, log)
    # The downloaded packages are no part of an image.
    for deb in (root / "var" / "cache" / "apt" / "archives").glob("*.deb"):
        deb.unlink()
    partial = archive.with_suffix(".partial.tar")
    _run(["tar", "-C", str(root), "-cf", str(partial), "."], log)
    partial.replace(archive)
    shutil.rmtree(root, ignore_errors=True)
    return archive


def _foreign_loader(root: Path, log: Path) -> None:
    """The arm64 loader's files unpacked into the build rootfs (what links the arm64 probe), from Debian's packages
    downloaded by this machine's apt (arm64 added as a foreign architecture, as .ci/run does)."""
    with tempfile.TemporaryDirectory(prefix="gpuppetti-debs-") as directory:
        _run(["apt-get", "download", *FOREIGN_DEBS], log, timeout=300, cwd=Path(directory))
        for deb in Path(directory).glob("*.deb"):
            _run(["dpkg-deb", "-x", str(deb), str(root)], log)


def _unpack_included(root: Path, log: Path) -> None:
    """debootstrap --foreign unpacks the base system only, and leaves the packages --include named downloaded: their
    files unpacked too (python3), configured by nothing, as nothing arm64 runs here."""
    for deb in sorted((root / "var" / "cache" / "apt" / "archives").glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(root)], log)


def _image(tag: str, archive: Path, arch: str) -> None:
    if podman("image", "exists", tag, timeout=60).returncode == 0:
        return
    imported = podman("import", "--arch", arch, "--os", "linux", str(archive), tag)
    if imported.returncode != 0:
        raise CannotPrepare(f"podman import {tag} failed: {imported.stderr.strip()[-300:]}")


def prepare() -> str:
    """The bases, made where missing; the manifest list's name (the Dockerfile's BASE_IMAGE). Raises CannotPrepare."""
    reason = why_not_here()
    if reason is not None:
        raise CannotPrepare(reason)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with helpers.machine_lock(LOCK, f"image bases: waiting for another run to finish with {STATE_DIR}"):
        started = time.monotonic()
        build = _rootfs("build-amd64", ["--arch=amd64", f"--include={','.join(BUILD_PACKAGES)}"], _foreign_loader)
        arm64 = _rootfs("base-arm64", ["--foreign", "--arch=arm64", "--include=python3"], _unpack_included)
        _image(BUILD_IMAGE, build, "amd64")
        _image(ARM64_BASE, arm64, "arm64")
        if podman("manifest", "exists", BASE_LIST, timeout=60).returncode != 0:
            for args in (("manifest", "create", BASE_LIST),
                         ("manifest", "add", BASE_LIST, f"containers-storage:{BUILD_IMAGE}"),
                         ("manifest", "add", BASE_LIST, f"containers-storage:{ARM64_BASE}")):
                made = podman(*args, timeout=120)
                if made.returncode != 0:
                    raise CannotPrepare(f"podman {' '.join(args[:2])} failed: {made.stderr.strip()[-300:]}")
        spent = time.monotonic() - started
        if spent > 5:
            print(f"image bases made in {spent:.0f} s ({STATE_DIR})", file=sys.stderr)
    return BASE_LIST


if __name__ == "__main__":
    try:
        print(prepare())
    except CannotPrepare as exc:
        sys.exit(f"image bases: {exc}")
