"""``gpuppetti demo --runtime podman``: demo pods as real containers."""

from __future__ import annotations

import asyncio
import os

import pytest

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.kubelet.sandbox import PodmanSandbox, allocation_flags, parse_probe, vulkan_icd
from gpuppetti.layer.vulkan import BUILT, LIBRARY
from tests.helpers import run_cli

pytestmark = pytest.mark.e2e


def _why_podman_cannot_run() -> str | None:
    if os.geteuid() != 0:
        return "the sandbox writes CDI specs to /var/run/cdi, which needs root"
    return asyncio.run(PodmanSandbox().why_not())


def test_allocation_becomes_podman_flags() -> None:
    response = pb.ContainerAllocateResponse(envs={"B": "2", "A": "1"})
    response.cdi_devices.add(name="sandbox.gpuppetti.dev/gpu=sim-apple-0")
    response.devices.add(container_path="/dev/dri/renderD128", host_path="/dev/dri/renderD128", permissions="rw")
    response.mounts.add(container_path="/run/x", host_path="/var/x", read_only=True)
    assert allocation_flags(response) == [
        "--device", "sandbox.gpuppetti.dev/gpu=sim-apple-0",
        "--device", "/dev/dri/renderD128:/dev/dri/renderD128:rw",
        "--mount", "type=bind,src=/var/x,dst=/run/x,ro",
        "--env", "A=1", "--env", "B=2",
    ]


def test_probe_output() -> None:
    env, dev, vulkan = parse_probe("GPUPPETTI_SLICES=a::0\nGPUPPETTI_SHARING=time-slicing\n--- /dev\nnull\nzero\n"
                                   "--- vulkan\n")
    assert env == {"GPUPPETTI_SLICES": "a::0", "GPUPPETTI_SHARING": "time-slicing"}
    assert (dev, vulkan) == (["null", "zero"], None)
    _, _, vulkan = parse_probe('--- /dev\nnull\n--- vulkan\n{"layer": true, "devices": []}\n')
    assert vulkan == {"layer": True, "devices": []}


def test_demo_runs_each_pod_in_a_real_container() -> None:
    reason = _why_podman_cannot_run()
    if reason is not None:
        pytest.skip(f"podman cannot run containers here: {reason}")
    # Wide enough for every column of the containers' table.
    result = run_cli("demo", "--runtime", "podman", timeout=600, env={"COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Containers run by podman" in out
    # Seen from inside: the CDI device's marker (applied by podman from the spec) and the Allocate env.
    assert "GPUPPETTI_CDI_SIM_APPLE_0=sim-apple-0" in out
    assert "GPUPPETTI_SLICES=sim-apple-0::0" in out
    assert "--device sandbox.gpuppetti.dev/gpu=sim-apple-0" in out
    assert "urandom" in out
    # A 2 GiB GPU in four slices: each container sees its slice as its GPU's heap, and obtains all of it; the pod
    # given two slices, twice that. (Where the layer is built and the host has lavapipe.)
    if (BUILT / LIBRARY).exists() and vulkan_icd() is not None:
        containers = out[out.index("Containers run by podman"):]
        rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:5]]
                for line in containers.splitlines() if line.startswith("│ gpu-pod-")}
        assert rows == {"gpu-pod-1": ["512 MiB"] * 3, "gpu-pod-2": ["512 MiB"] * 3, "gpu-pod-3": ["1 GiB"] * 3}
    assert not os.path.exists("/var/run/cdi/sandbox.gpuppetti.dev-gpu.json"), "the sandbox cleans up its spec"


def test_an_image_that_is_not_here_is_one_line_and_pulls_nothing() -> None:
    reason = _why_podman_cannot_run()
    if reason is not None:
        pytest.skip(f"podman cannot run containers here: {reason}")
    result = run_cli("demo", "--runtime", "podman", "--image", "localhost/gpuppetti-no-such-image:1", timeout=120)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("gpuppetti: --image localhost/gpuppetti-no-such-image:1: no such image here, and the "
                           "sandbox pulls nothing"), line
    assert "Traceback" not in result.stdout + result.stderr
