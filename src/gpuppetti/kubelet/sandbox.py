"""Runs demo pods as real containers through podman, applying what Allocate returned as a CRI runtime would.

CDI names become ``--device vendor/class=name`` (podman resolves them from /etc/cdi and /var/run/cdi), device
specs become ``--device host:container:perms``, env becomes ``--env`` and mounts ``--mount``. Every argument is
passed as a list, never through a shell.

The image is built here, from the host's own files: a static busybox, and, where the host has them, the Vulkan
loader and Mesa's lavapipe with the libraries they load, so that each container can run the Vulkan layer's probe
against a GPU it really sees. Nothing is pulled.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.base.processes import run_within
from gpuppetti.core.model import ContainerEdits, DeviceNode, Mount

BUSYBOX_IMAGE = "localhost/gpuppetti-sandbox:busybox"
VULKAN_IMAGE = "localhost/gpuppetti-sandbox:vulkan"
BUSYBOX = Path("/bin/busybox")
VULKAN_LOADER = Path("/usr/lib/x86_64-linux-gnu/libvulkan.so.1")
ICD_DIR = Path("/usr/share/vulkan/icd.d")
VKINFO = "/usr/local/bin/gpuppetti-vkinfo"
# Each container's Vulkan workload: allocate chunks of this many MiB until refused.
CHUNK_MIB = 16
# The flags that make Debian's podman 4.3 run here: runc with cgroupfs, no network, bounded ulimits.
PODMAN_FLAGS = ("--runtime", "/usr/sbin/runc", "--cgroup-manager", "cgroupfs")
RUN_FLAGS = ("--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
# What each container prints: its GPUPPETTI_* env (CDI's marker included), its /dev entries, and, where the Vulkan
# layer's probe was mounted in, what the container sees of its GPU and obtains from it.
PROBE = ("/bin/sh", "-c", "env | grep '^GPUPPETTI_' | sort; echo '--- /dev'; ls /dev; echo '--- vulkan'; "
         f"if [ -x {VKINFO} ]; then {VKINFO} --json --allocate {CHUNK_MIB}; fi")
TIMEOUT_S = 120.0
# ldd only reads a binary's headers and the linker's cache.
LDD_TIMEOUT_S = 60.0


class SandboxError(Exception):
    pass


@dataclass(frozen=True)
class Seen:
    env: dict[str, str]
    dev: list[str]
    flags: list[str]
    # The probe's report (gpuppetti-vkinfo --json), where the container ran it.
    vulkan: dict[str, Any] | None = None


def edits_of(response: pb.ContainerAllocateResponse) -> tuple[ContainerEdits, list[str]]:
    """What an Allocate answer asks of the runtime: the container edits, and the CDI devices to apply."""
    edits = ContainerEdits(env=dict(response.envs))
    for spec in response.devices:
        edits.add_device_node(DeviceNode(spec.container_path, spec.host_path, spec.permissions or "rwm"))
    for mount in response.mounts:
        edits.add_mount(Mount(mount.container_path, mount.host_path, mount.read_only))
    return edits, [device.name for device in response.cdi_devices]


def podman_flags(edits: ContainerEdits, cdi_devices: Sequence[str] = ()) -> list[str]:
    """Container edits as podman flags: the third rendering, beside the Allocate answer and the CDI spec."""
    flags: list[str] = []
    for name in cdi_devices:
        flags += ["--device", name]
    for node in edits.device_nodes:
        flags += ["--device", f"{node.source}:{node.path}:{node.permissions}"]
    for mount in edits.mounts:
        options = ",ro" if mount.read_only else ""
        flags += ["--mount", f"type=bind,src={mount.host_path},dst={mount.container_path}{options}"]
    for key, value in sorted(edits.env.items()):
        flags += ["--env", f"{key}={value}"]
    return flags


def allocation_flags(response: pb.ContainerAllocateResponse) -> list[str]:
    return podman_flags(*edits_of(response))


def parse_probe(output: str) -> tuple[dict[str, str], list[str], dict[str, Any] | None]:
    env_part, _, rest = output.partition("--- /dev")
    dev_part, _, vulkan_part = rest.partition("--- vulkan")
    env = dict(line.split("=", 1) for line in env_part.splitlines() if "=" in line)
    vulkan: dict[str, Any] | None = None
    if vulkan_part.strip():
        try:
            vulkan = json.loads(vulkan_part)
        except ValueError:
            vulkan = {"error": vulkan_part.strip()[:200]}
    return env, dev_part.split(), vulkan


def vulkan_icd() -> Path | None:
    """Mesa's lavapipe ICD manifest on this host, if it has one (and the loader)."""
    if not VULKAN_LOADER.exists():
        return None
    # Debian names the manifest by architecture where a foreign one is installed beside it (lvp_icd.aarch64.json
    # for the cross tests): only this machine's lavapipe runs here.
    for name in (f"lvp_icd.{platform.machine()}.json", "lvp_icd.json"):
        if (ICD_DIR / name).is_file():
            return ICD_DIR / name
    return None


class PodmanSandbox:
    def __init__(self, image: str | None = None, podman: str = "podman") -> None:
        self._icd = vulkan_icd() if image is None else None
        self.image = image or (VULKAN_IMAGE if self._icd is not None else BUSYBOX_IMAGE)
        self._build_default = image is None
        self._podman = podman

    async def _podman_call(self, *args: str, timeout: float = TIMEOUT_S) -> tuple[int, str, str]:
        try:
            code, stdout, stderr = await run_within([self._podman, *PODMAN_FLAGS, *args], timeout)
        except TimeoutError:
            raise SandboxError(f"podman {' '.join(args[:2])} did not finish in {timeout:.0f}s") from None
        return code, stdout.decode(errors="replace"), stderr.decode(errors="replace")

    async def why_not(self) -> str | None:
        """None if podman can run containers here, else the reason."""
        if shutil.which(self._podman) is None:
            return f"{self._podman} is not installed (Debian: apt-get install podman runc busybox-static)"
        if not Path(PODMAN_FLAGS[1]).exists():
            return f"{PODMAN_FLAGS[1]} is not installed (Debian: apt-get install runc)"
        code, _, stderr = await self._podman_call("info", "--format", "{{.Host.OCIRuntime.Name}}", timeout=60)
        if code != 0:
            return f"podman cannot run here: {stderr.strip().splitlines()[-1] if stderr.strip() else code}"
        if self._build_default and not BUSYBOX.exists():
            return f"{BUSYBOX} is missing to build the sandbox image (Debian: apt-get install busybox-static)"
        return None

    async def ensure_image(self) -> str:
        code, _, _ = await self._podman_call("image", "exists", self.image, timeout=60)
        if code == 0:
            return self.image
        if not self._build_default:
            raise SandboxError(f"--image {self.image}: no such image here, and the sandbox pulls nothing: pull or "
                               "build it first (podman pull, podman build), or leave --image out for the built-in one")
        libraries = await self._vulkan_libraries() if self._icd is not None else []
        await self._build_image(libraries)
        return self.image

    async def _vulkan_libraries(self) -> list[Path]:
        """The loader, lavapipe, and every library they load, as ldd names them."""
        assert self._icd is not None
        driver = Path(json.loads(self._icd.read_text())["ICD"]["library_path"])
        return await linked_libraries((VULKAN_LOADER, driver))

    async def _build_image(self, libraries: list[Path]) -> None:
        # A root filesystem of one static busybox, and the Vulkan libraries copied from this host: no registry,
        # no base image.
        with tempfile.TemporaryDirectory(prefix="gpuppetti-image-") as workdir:
            root = Path(workdir) / "root"
            for directory in ("bin", "dev", "proc", "sys", "tmp", "usr/local/bin", "etc/vulkan/implicit_layer.d"):
                (root / directory).mkdir(parents=True)
            shutil.copy2(BUSYBOX, root / "bin" / "busybox")
            for applet in ("sh", "env", "ls", "cat", "grep", "sort", "echo"):
                os.symlink("busybox", root / "bin" / applet)
            for library in libraries:
                # The file itself, at the path the loader asks for (no links to follow inside the image).
                target = root / library.relative_to("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(library.resolve(), target)
                os.chmod(target, 0o755)
            if self._icd is not None:
                target = root / self._icd.relative_to("/")
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self._icd, target)
            archive = Path(workdir) / "rootfs.tar"
            with tarfile.open(archive, "w") as tar:
                tar.add(root, arcname=".")
            code, _, stderr = await self._podman_call("import", str(archive), self.image)
        if code != 0:
            raise SandboxError(f"building {self.image} from this host's files failed: {stderr.strip()}")

    async def shell(self, name: str, flags: Sequence[str], script: str) -> tuple[int, str, str]:
        """Run ``script`` with /bin/sh in a container given ``flags``; (exit code, stdout, stderr)."""
        return await self._podman_call("run", *RUN_FLAGS, "--name", name, *flags, self.image, "/bin/sh", "-c", script)

    async def run(self, name: str, response: pb.ContainerAllocateResponse) -> Seen:
        flags = allocation_flags(response)
        code, stdout, stderr = await self._podman_call("run", *RUN_FLAGS, "--name", name, *flags, self.image, *PROBE)
        if code != 0:
            raise SandboxError(f"container {name} failed ({code}): {stderr.strip()}")
        env, dev, vulkan = parse_probe(stdout)
        return Seen(env, dev, flags, vulkan)


async def linked_libraries(binaries: Iterable[Path]) -> list[Path]:
    """The binaries and every library they load, as ldd names them (none for a static one): what an image of
    this host's files must hold for them to run."""
    found: dict[str, Path] = {}
    for binary in binaries:
        found[str(binary)] = binary
        try:
            code, stdout, _ = await run_within(["ldd", str(binary)], LDD_TIMEOUT_S, stderr=asyncio.subprocess.STDOUT)
        except TimeoutError:
            raise SandboxError(f"ldd {binary} did not finish in {LDD_TIMEOUT_S:.0f}s") from None
        if code != 0:
            if b"not a dynamic executable" in stdout:
                continue
            raise SandboxError(f"ldd {binary} failed: cannot tell which libraries its image needs")
        for line in stdout.decode(errors="replace").splitlines():
            path = line.split("=>")[-1].split("(")[0].strip()
            if path.startswith("/"):
                found[path] = Path(path)
    return list(found.values())
