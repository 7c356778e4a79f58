"""Runs demo pods as real containers through podman, applying what Allocate returned as a CRI runtime would.

CDI names become ``--device vendor/class=name`` (podman resolves them from /etc/cdi and /var/run/cdi), device
specs become ``--device host:container:perms``, env becomes ``--env`` and mounts ``--mount``. Every argument is
passed as a list, never through a shell.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.model import ContainerEdits, DeviceNode, Mount

DEFAULT_IMAGE = "localhost/gpuppetti-sandbox:busybox"
BUSYBOX = Path("/bin/busybox")
# The flags that make Debian's podman 4.3 run here: runc with cgroupfs, no network, bounded ulimits.
PODMAN_FLAGS = ("--runtime", "/usr/sbin/runc", "--cgroup-manager", "cgroupfs")
RUN_FLAGS = ("--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
# What each container prints: its GPUPPETTI_* env (CDI's marker included), then its /dev entries.
PROBE = ("/bin/sh", "-c", "env | grep '^GPUPPETTI_' | sort; echo '--- /dev'; ls /dev")
TIMEOUT_S = 120.0


class SandboxError(Exception):
    pass


@dataclass(frozen=True)
class Seen:
    env: dict[str, str]
    dev: list[str]
    flags: list[str]


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


def parse_probe(output: str) -> tuple[dict[str, str], list[str]]:
    env_part, _, dev_part = output.partition("--- /dev")
    env = dict(line.split("=", 1) for line in env_part.splitlines() if "=" in line)
    return env, dev_part.split()


class PodmanSandbox:
    def __init__(self, image: str | None = None, podman: str = "podman") -> None:
        self.image = image or DEFAULT_IMAGE
        self._build_default = image is None
        self._podman = podman

    async def _podman_call(self, *args: str, timeout: float = TIMEOUT_S) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            self._podman, *PODMAN_FLAGS, *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(timeout):
                stdout, stderr = await process.communicate()
        except TimeoutError:
            process.kill()
            await process.wait()
            raise SandboxError(f"podman {' '.join(args[:2])} did not finish in {timeout:.0f}s") from None
        return process.returncode or 0, stdout.decode(errors="replace"), stderr.decode(errors="replace")

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
        await self._build_busybox_image()
        return self.image

    async def _build_busybox_image(self) -> None:
        # A root filesystem of one static busybox: no registry, no base image.
        with tempfile.TemporaryDirectory(prefix="gpuppetti-image-") as workdir:
            root = Path(workdir) / "root"
            for directory in ("bin", "dev", "proc", "sys", "tmp"):
                (root / directory).mkdir(parents=True)
            shutil.copy2(BUSYBOX, root / "bin" / "busybox")
            for applet in ("sh", "env", "ls", "cat", "grep", "sort", "echo"):
                os.symlink("busybox", root / "bin" / applet)
            archive = Path(workdir) / "rootfs.tar"
            with tarfile.open(archive, "w") as tar:
                tar.add(root, arcname=".")
            code, _, stderr = await self._podman_call("import", str(archive), self.image)
        if code != 0:
            raise SandboxError(f"building {self.image} from {BUSYBOX} failed: {stderr.strip()}")

    async def run(self, name: str, response: pb.ContainerAllocateResponse) -> Seen:
        flags = allocation_flags(response)
        code, stdout, stderr = await self._podman_call("run", *RUN_FLAGS, "--name", name, *flags, self.image, *PROBE)
        if code != 0:
            raise SandboxError(f"container {name} failed ({code}): {stderr.strip()}")
        env, dev = parse_probe(stdout)
        return Seen(env, dev, flags)
