"""The container runtime's side, in the venus guest: what an Allocate answer (driver.py) or a CDI device (dra.py)
asks of the runtime, applied with the guest's own tools, and the workloads run inside.

A container is a private mount namespace (``unshare -m``) whose device directory holds only the device nodes it was
given (made with mknod from the node's, as runc makes them), with its mounts bind-mounted at their container paths
(read-only where it says so), and its env as the whole environment. What each workload printed is written to a JSON
file in OUT for the tests on the host to judge.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb

STEP_TIMEOUT_S = 300.0
PATH = "/usr/local/bin:/usr/bin:/bin"
# Venus's own ICD: a workload run with VK_DRIVER_FILES set to it sees Venus alone, as in an image without another
# Vulkan driver.
VENUS_ICD = "/usr/share/vulkan/icd.d/virtio_icd.json"


def runtime_script(response: pb.ContainerAllocateResponse) -> str:
    """A shell script that sets up, in the mount namespace it runs in, what ``response`` asks of the runtime, then
    runs "$@" with the answer's env as its whole environment."""
    lines = ["set -e"]
    directories = sorted({str(Path(spec.container_path).parent) for spec in response.devices})
    for directory in directories:
        # The container's device directory holds the devices it was given, and nothing else of the node's.
        lines.append(f"mkdir -p {shlex.quote(directory)} && mount -t tmpfs -o mode=0755 gpuppetti-dev "
                     f"{shlex.quote(directory)}")
    for spec in response.devices:
        device = os.stat(spec.host_path).st_rdev
        lines.append(f"mknod -m 0666 {shlex.quote(spec.container_path)} c {os.major(device)} {os.minor(device)}")
    covered: set[str] = set()
    for mount in response.mounts:
        target = mount.container_path
        if os.path.isdir(mount.host_path):
            lines.append(f"mkdir -p {shlex.quote(target)}")
        else:
            parent = str(Path(target).parent)
            # A file mounted where the node has none: the directory it goes in becomes the container's own (the
            # node's stays as it was, empty or absent, for everything outside the namespace).
            if parent not in covered and not os.path.exists(target):
                covered.add(parent)
                lines.append(f"mkdir -p {shlex.quote(parent)} && mount -t tmpfs -o mode=0755 gpuppetti-files "
                             f"{shlex.quote(parent)}")
            lines.append(f"[ -e {shlex.quote(target)} ] || : > {shlex.quote(target)}")
        lines.append(f"mount --bind {shlex.quote(mount.host_path)} {shlex.quote(target)}")
        if mount.read_only:
            lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
    env = [f"{key}={value}" for key, value in sorted(response.envs.items())]
    lines.append(f"exec env -i PATH={PATH} HOME=/root {' '.join(shlex.quote(e) for e in env)} \"$@\"")
    return "\n".join(lines)


class Steps:
    """Each workload run in a container, by name, with what it printed: OUT/steps.json (or ``name``)."""

    def __init__(self, out: Path, name: str = "steps.json") -> None:
        self.out = out
        self.name = name
        self.steps: dict[str, dict[str, Any]] = {}

    def save(self) -> None:
        (self.out / f"{self.name}.tmp").write_text(json.dumps(self.steps, indent=1))
        (self.out / f"{self.name}.tmp").rename(self.out / self.name)

    async def run(self, name: str, response: pb.ContainerAllocateResponse, command: list[str],
                  extra_env: dict[str, str] | None = None, timeout: float = STEP_TIMEOUT_S,
                  attempts: int = 1) -> dict[str, Any]:
        """Run ``command`` in a container given ``response``; a run that outlasts ``timeout`` is killed and, while
        ``attempts`` remain, run again (each attempt's end is kept in the step's ``attempts``)."""
        if extra_env:
            command = ["env", *(f"{k}={v}" for k, v in extra_env.items()), *command]
        ends: list[dict[str, Any]] = []
        step: dict[str, Any] = {}
        for _ in range(attempts):
            started = time.monotonic()
            process = await asyncio.create_subprocess_exec(
                "unshare", "-m", "--propagation", "private", "sh", "-c", runtime_script(response), "container",
                *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            timed_out = False
            try:
                async with asyncio.timeout(timeout):
                    stdout, stderr = await process.communicate()
            except TimeoutError:
                timed_out = True
                process.kill()
                stdout, stderr = await process.communicate()
            step = {"command": command, "code": process.returncode, "timed_out": timed_out,
                    "seconds": round(time.monotonic() - started, 2), "stdout": stdout.decode(errors="replace"),
                    "stderr": stderr.decode(errors="replace")[-4000:]}
            ends.append({key: step[key] for key in ("code", "timed_out", "seconds")} |
                        {"stderr": step["stderr"][-400:]})
            if not timed_out:
                break
        step["attempts"] = ends
        self.steps[name] = step
        self.save()
        return step
