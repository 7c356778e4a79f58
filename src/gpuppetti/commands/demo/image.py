"""The sandbox's image for a node's own GPUs: a static busybox, the Vulkan loader, and the Vulkan drivers of those
GPUs (Venus for a virtio-gpu, RADV, ANV, NVIDIA's) with the libraries they load, copied from this machine, so that
each container reaches its GPU through the device node its Allocate answer names."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from gpuppetti.base.processes import run_within
from gpuppetti.core.model import Gpu, Vendor
from gpuppetti.kubelet.sandbox import BUSYBOX, PODMAN_FLAGS, VULKAN_LOADER, SandboxError, linked_libraries
from gpuppetti.layer.vulkan import BUILT, LIBRARY, PROBE

NODE_IMAGE = "localhost/gpuppetti-sandbox"
ICD_DIRS = (Path("/usr/share/vulkan/icd.d"), Path("/etc/vulkan/icd.d"))
# Mesa's device selection layer, which reads MESA_VK_DEVICE_SELECT: a container with its GPU's driver has it too.
DEVICE_SELECT = Path("/usr/share/vulkan/implicit_layer.d/VkLayer_MESA_device_select.json")
# The drivers a container needs to reach each kind of GPU, by their ICD manifests' names. Apple's GPU reaches a
# krunkit VM as a virtio-gpu, which Mesa's Venus drives; a simulated GPU is whatever device the container has
# (lavapipe, Mesa's CPU driver).
DRIVER_MANIFESTS: dict[Vendor | None, tuple[str, ...]] = {
    Vendor.VIRTIO: ("virtio_icd*.json",),
    Vendor.APPLE: ("virtio_icd*.json",),
    Vendor.AMD: ("radeon_icd*.json",),
    Vendor.INTEL: ("intel_icd*.json", "intel_hasvk_icd*.json"),
    Vendor.NVIDIA: ("nvidia_icd*.json", "nouveau_icd*.json"),
    None: ("lvp_icd*.json",),
}
IMAGE_APPLETS = ("sh", "env", "ls", "cat", "grep", "sort", "echo")


def driver_manifests(gpus: Iterable[Gpu], directories: Sequence[Path] = ICD_DIRS) -> list[Path]:
    """The ICD manifests on this machine of the drivers that serve ``gpus``."""
    patterns: list[str] = []
    for gpu in gpus:
        for pattern in DRIVER_MANIFESTS.get(None if gpu.simulated else gpu.vendor, ()):
            if pattern not in patterns:
                patterns.append(pattern)
    found: list[Path] = []
    for pattern in patterns:
        for directory in directories:
            found += [path for path in sorted(directory.glob(pattern)) if path not in found]
    return found


def library_of(manifest: Path, key: str = "ICD") -> Path | None:
    """The library a driver's (or layer's) manifest names, as the dynamic linker would find it here."""
    try:
        named = str(json.loads(manifest.read_text(encoding="utf-8"))[key]["library_path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if "/" in named:
        path = Path(named) if named.startswith("/") else manifest.parent / named
        return path if path.is_file() else None
    for directory in (VULKAN_LOADER.parent, Path("/usr/lib64"), Path("/usr/lib"), Path("/lib64")):
        if (directory / named).is_file():
            return directory / named
    return None


async def node_image(gpus: Sequence[Gpu], podman: str = "podman") -> str:
    """A local image with a static busybox, the Vulkan loader and the drivers of ``gpus`` from this machine, tagged
    by a digest of what went in (built once). Raises SandboxError where this machine lacks them."""
    manifests = driver_manifests(gpus)
    if not manifests:
        kinds = ", ".join(sorted({gpu.vendor.value for gpu in gpus}))
        raise SandboxError(f"no Vulkan driver for the GPUs here ({kinds}) in {', '.join(map(str, ICD_DIRS))}: the "
                           "containers could not reach them (Debian: mesa-vulkan-drivers)")
    if not VULKAN_LOADER.is_file():
        raise SandboxError(f"no Vulkan loader at {VULKAN_LOADER} to build the containers' image from (Debian: "
                           "libvulkan1)")
    layers = [DEVICE_SELECT] if DEVICE_SELECT.is_file() and library_of(DEVICE_SELECT, "layer") else []
    binaries = [VULKAN_LOADER]
    for manifest in manifests:
        if (library := library_of(manifest)) is not None:
            binaries.append(library)
    binaries += [library for layer in layers if (library := library_of(layer, "layer")) is not None]
    # What the slice layer and its probe load, which are mounted in, not copied (libpthread.so.0 for the layer,
    # which a newer glibc's drivers no longer bring): without it the loader skips the layer without a word.
    mounted = [BUILT / name for name in (LIBRARY, PROBE) if (BUILT / name).is_file()]
    # And busybox's, where it is not the static one (a distribution's busybox package).
    linked = await linked_libraries([*binaries, *mounted, BUSYBOX])
    libraries = [path for path in linked if path not in (*mounted, BUSYBOX)]
    files = [BUSYBOX, *libraries, *manifests, *layers]
    digest = hashlib.sha256()
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    tag = f"{NODE_IMAGE}:node-{digest.hexdigest()[:16]}"
    exists = await _podman(podman, "image", "exists", tag)
    if exists[0] == 0:
        return tag
    with tempfile.TemporaryDirectory(prefix="gpuppetti-image-") as workdir:
        root = Path(workdir) / "root"
        for directory in ("bin", "dev", "proc", "sys", "tmp", "usr/local/bin", "etc/vulkan/implicit_layer.d"):
            (root / directory).mkdir(parents=True)
        shutil.copy2(BUSYBOX, root / "bin" / "busybox")
        for applet in IMAGE_APPLETS:
            os.symlink("busybox", root / "bin" / applet)
        for path in [*libraries, *manifests, *layers]:
            # The file itself, at the path it is asked for by (no links to follow inside the image).
            target = root / path.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path.resolve(), target)
            os.chmod(target, 0o755 if path in libraries else 0o644)
        archive = Path(workdir) / "rootfs.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(root, arcname=".")
        code, stderr = await _podman(podman, "import", str(archive), tag)
    if code != 0:
        raise SandboxError(f"building {tag} from this machine's files failed: {stderr.strip()}")
    return tag


async def _podman(podman: str, *args: str) -> tuple[int, str]:
    try:
        code, _, stderr = await run_within([podman, *PODMAN_FLAGS, *args], 300, stdout=asyncio.subprocess.DEVNULL)
    except TimeoutError:
        raise SandboxError(f"podman {args[0]} did not finish in 300s") from None
    return code, stderr.decode(errors="replace")
