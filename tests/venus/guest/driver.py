"""Run in the venus guest with the installed package's Python: the kubelet's side of the device plugin, and the
runtime's side of each Allocate answer.

The kubelet emulator (gpuppetti.kubelet.emulator, from the installed wheel) serves ``kubelet.sock`` in WORK/dp,
where ``gpuppetti plugin`` (started beside it by node.sh) registers. Pods are admitted, and each Allocate answer is
applied as a container runtime applies it, with the guest's own tools (guest/runtime.py): a private mount namespace
(``unshare -m``) whose /dev/dri holds only the device nodes the answer names (made with mknod from the node's, as
runc makes them), the answer's mounts bind-mounted at their container paths (read-only where it says so), and its
env as the whole environment. The workloads run inside and print JSON; everything is written to OUT/steps.json for
the tests on the host to judge.

    python driver.py WORK OUT APPS_PYTHON
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.kubelet.emulator import AdmissionError, KubeletEmulator, Pod

if TYPE_CHECKING:
    from tests.venus.guest.runtime import VENUS_ICD, Steps
else:
    # In the guest, guest/runtime.py is beside this script.
    from runtime import VENUS_ICD, Steps

RESOURCE = "apple.com/gpu"
# Set to 1: no timed workloads (the arm64 guest's batch).
QUICK_ENV = "GPUPPETTI_VENUS_QUICK"
# Four replicas of one GPU: two pods of one slice, one of two, and one that finds nothing left.
PODS = (("pod-1", 1), ("pod-2", 1), ("pod-3", 2), ("pod-4", 1))


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
        three = responses["pod-2"]
        if os.environ.get(QUICK_ENV) == "1":
            # The arm64 guest's batch: what the x86-64 guest's timed workloads measure is the layer's, not the
            # architecture's, and they would cost minutes more of emulated CPU.
            (out / "timed").write_text("")
            await steps.run("wgpu", three, [apps_python, str(work / "wgpu_slice.py"), "--slice-mib", "512"])
            return 0
        # Time is measured only once the node's other commands are done: they would take the guest's CPUs.
        await wait_for(out / "quiet", 300)
        # On this stand-in a Venus ring now and then stops moving ("MESA-VIRTIO: debug: stuck in ring seqno wait")
        # in a process that also loaded the guest's own lavapipe, with the layer and without it; never yet where
        # Venus was the only driver. The timed workloads run as in an image with Venus alone, and a run that
        # stalls all the same is killed and run again (the tests say so).
        alone = {"VK_DRIVER_FILES": VENUS_ICD}
        # Two batches queued at once: the next one is waiting while one runs, so the unthrottled workload keeps
        # Venus busy even when the host is loaded and each round trip through the ring takes longer.
        busy = ["gpuppetti-vkinfo", "--busy", "2", "--fill", "32", "--in-flight", "2"]
        await steps.run("busy-share", three, busy, alone, timeout=60, attempts=3)
        await steps.run("busy-free", three, busy, {**alone, "GPUPPETTI_VK_DISABLE": "1"}, timeout=60, attempts=3)
        # The timed workloads are done: node.sh starts the DRA scenario beside the last ones.
        (out / "timed").write_text("")
        await steps.run("wgpu", three, [apps_python, str(work / "wgpu_slice.py"), "--slice-mib", "512"])
        # llama.cpp's llama-server (its own Vulkan loader) on Venus alone, where the host wrote its models and
        # scripts (work/llama): a model that fits the slice, the same without the layer, and one past the slice.
        # Its log (stderr) goes whole to OUT/<step>.log: the lines judged come from its start and its end.
        llama = work / "llama"
        if (llama / "small.sh").exists():
            for name, model, env in (("llama-inside", "small", alone),
                                     ("llama-alone", "small", {**alone, "GPUPPETTI_VK_DISABLE": "1"}),
                                     ("llama-past", "large", alone)):
                await steps.run(name, three, ["sh", "-c", f"sh {llama / model}.sh 2> {out / name}.log"], env)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])))
