"""Run in the venus guest with the installed package's Python: the kubelet's side of the device plugin, and the
runtime's side of each Allocate answer.

The kubelet emulator (gpuppetti.kubelet.emulator, from the installed wheel) serves ``kubelet.sock`` in WORK/dp,
where ``gpuppetti plugin`` (started beside it by node.sh) registers. Pods are admitted, and each Allocate answer is
applied as a container runtime applies it, with the guest's own tools: a private mount namespace (``unshare -m``)
whose /dev/dri holds only the device nodes the answer names (made with mknod from the node's, as runc makes them),
the answer's mounts bind-mounted at their container paths (read-only where it says so), and its env as the whole
environment. The workloads run inside and print JSON; everything is written to OUT/steps.json for the tests on
the host to judge.

    python driver.py WORK OUT APPS_PYTHON
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.kubelet.emulator import AdmissionError, KubeletEmulator, Pod

RESOURCE = "apple.com/gpu"
# Four replicas of one GPU: two pods of one slice, one of two, and one that finds nothing left.
PODS = (("pod-1", 1), ("pod-2", 1), ("pod-3", 2), ("pod-4", 1))
STEP_TIMEOUT_S = 300.0
PATH = "/usr/local/bin:/usr/bin:/bin"
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
    """Each workload run in a container, by name, with what it printed: OUT/steps.json."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: dict[str, dict[str, Any]] = {}

    def save(self) -> None:
        (self.out / "steps.json.tmp").write_text(json.dumps(self.steps, indent=1))
        (self.out / "steps.json.tmp").rename(self.out / "steps.json")

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


def answer(response: pb.ContainerAllocateResponse) -> dict[str, Any]:
    return {
        "envs": dict(response.envs),
        "devices": [{"container_path": d.container_path, "host_path": d.host_path, "permissions": d.permissions}
                    for d in response.devices],
        "mounts": [{"container_path": m.container_path, "host_path": m.host_path, "read_only": m.read_only}
                   for m in response.mounts],
        "cdi_devices": [d.name for d in response.cdi_devices],
    }


async def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


async def main(work: Path, out: Path, apps_python: str) -> int:
    steps = Steps(out)
    async with KubeletEmulator(work / "dp") as kubelet:
        # The plugin starts beside this process: importing everything takes seconds on an emulated CPU.
        await kubelet.wait_registered(RESOURCE, timeout=240)
        (out / "registered").write_text(f"{kubelet.allocatable(RESOURCE)}\n")
        answers: dict[str, Any] = {}
        responses: dict[str, pb.ContainerAllocateResponse] = {}
        for name, count in PODS:
            try:
                [allocation] = await kubelet.admit(Pod.simple(name, RESOURCE, count))
            except AdmissionError as exc:
                answers[name] = {"refused": str(exc)}
                continue
            responses[name] = allocation.response
            answers[name] = {"units": allocation.device_ids, **answer(allocation.response)}
        (out / "allocations.json").write_text(json.dumps(answers, indent=1))

        one, two = responses["pod-1"], responses["pod-3"]
        await steps.run("dri", one, ["ls", "/dev/dri"])
        await steps.run("env", one, ["env"])
        # The container's Vulkan without the layer: every device its drivers show.
        await steps.run("unlayered", one, ["gpuppetti-vkinfo", "--json"], {"GPUPPETTI_VK_DISABLE": "1"})
        await steps.run("slice", one, ["gpuppetti-vkinfo", "--json", "--allocate", "16"])
        # Two processes of one container share its slice: the first holds 192 MiB while the second allocates.
        await steps.run("shared", one, ["sh", "-c", "gpuppetti-vkinfo --json --allocate 64 --limit 192 --hold 8 "
                                        "> /tmp/pod-1-first & sleep 4; gpuppetti-vkinfo --json --allocate 64; "
                                        "wait; cat /tmp/pod-1-first"])
        await steps.run("two-slices", two, ["gpuppetti-vkinfo", "--json", "--allocate", "64"])
        # Time is measured only once the node's other commands are done: they would take the guest's CPUs.
        await wait_for(out / "quiet", 300)
        three = responses["pod-2"]
        # On this stand-in a Venus ring now and then stops moving ("MESA-VIRTIO: debug: stuck in ring seqno wait")
        # in a process that also loaded the guest's own lavapipe, with the layer and without it; never yet where
        # Venus was the only driver. The timed workloads run as in an image with Venus alone, and a run that
        # stalls all the same is killed and run again (the tests say so).
        alone = {"VK_DRIVER_FILES": VENUS_ICD}
        await steps.run("busy-share", three, ["gpuppetti-vkinfo", "--busy", "2", "--fill", "32"], alone,
                        timeout=60, attempts=3)
        await steps.run("busy-free", three, ["gpuppetti-vkinfo", "--busy", "2", "--fill", "32"],
                        {**alone, "GPUPPETTI_VK_DISABLE": "1"}, timeout=60, attempts=3)
        await steps.run("wgpu", three, [apps_python, str(work / "wgpu_slice.py"), "--slice-mib", "512"])
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])))
