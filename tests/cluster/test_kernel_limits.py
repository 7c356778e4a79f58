"""The kernel's dmem limit on the real node (issue 30): a claim that selects, with CEL, a device whose slices the
dmem controller holds gets a CDI spec whose createRuntime hook containerd runs, and the hook writes the container's
dmem.max. This host's kernel has no dmem controller: the GPU (an xe card) and the cgroup tree's region list are a
stand-in tree under --host-root, and GPUPPETTI_DMEM_CGROUP_ROOT points the hook at a stand-in cgroup root."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.realnode import RealNode, wait_for
from tests.cluster.test_dra import DRIVER, claim_pod, classes, devices, pending
from tests.fixtures import FakeHost

__all__ = ["classes"]  # the fixture, from the DRA tests

REGION = "drm/0000:03:00.0/vram0"
CONFIG = "version: v1\nbackend: drm\ndra:\n  slicing: consumable\n"


def selecting(name: str, expression: str, memory: str = "1Gi") -> dict[str, Any]:
    request: dict[str, Any] = {"name": "gpu", "exactly": {
        "deviceClassName": DRIVER, "capacity": {"requests": {"memory": memory}},
        "selectors": [{"cel": {"expression": expression}}]}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [request]}}}}


def test_a_claim_selecting_dmem_held_devices_gets_its_cgroups_dmem_max(
        node: RealNode, workdir: Path, classes: None, monkeypatch: pytest.MonkeyPatch) -> None:
    host = workdir / "host"
    FakeHost(host).pci_gpu(card=0, render=128, bdf="0000:03:00.0", vendor=0x8086, device=0xE20B, driver="xe")
    # The stand-in card's device nodes are not the host's: none is handed to the container.
    for entry in (host / "dev/dri").iterdir():
        entry.unlink()
    # The host's python3, which the hook runs with, as the stand-in tree says it.
    (host / "usr/bin").mkdir(parents=True)
    (host / "usr/bin/python3").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    (host / "sys/fs/cgroup").mkdir(parents=True)
    (host / "sys/fs/cgroup/dmem.capacity").write_text(f"{REGION} 4294967296\n")
    cgroups = workdir / "cgroup"
    cgroups.mkdir()
    (cgroups / "dmem.capacity").write_text(f"{REGION} 4294967296\n")
    monkeypatch.setenv("GPUPPETTI_DMEM_CGROUP_ROOT", str(cgroups))
    config = workdir / "dra.yaml"
    config.write_text(CONFIG)
    daemon = node.gpuppetti("gpuppetti-dra", "dra", "--config", str(config), "--node-name", node.name,
                            "--kubeconfig", str(node.kubeconfig), "--http-address", "127.0.0.1:0",
                            "--host-root", str(host))
    daemon.wait_ready()
    wait_for("the xe device published", lambda: devices(node) or None, 60)
    [device] = devices(node).values()
    assert device["attributes"]["enforcedBy"] == {"string": "vulkan-layer+dmem"}

    node.apply([selecting("held", f'device.attributes["{DRIVER}"].enforcedBy.matches("dmem")'),
                selecting("by-nvidia", f'device.attributes["{DRIVER}"].enforcedBy.matches("nvml")'),
                claim_pod("dmem-held", "held"), claim_pod("nvidia-held", "by-nvidia")])
    node.wait_running("dmem-held")
    env = node.env_of("dmem-held")
    assert env["GPUPPETTI_ENFORCED_BY"] == "vulkan-layer+dmem"
    written = {path.read_text() for path in cgroups.rglob("dmem.max")}
    assert written == {f"{REGION} {2**30}\n"}
    # No device is held by NVIDIA's driver here: that claim is never allocated.
    assert pending(node, "nvidia-held")
