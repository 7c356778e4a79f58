"""What holds each slice to its memory (issue 30): the Vulkan layer, NVIDIA's driver (driver r615 and the
toolkit's apply-cuda-memory-limits hook), the kernel's dmem controller; found by discovery, handed to containers
as env and CDI hooks, and shown wherever GPUs are shown."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
import re
import time
import tracemalloc
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
from prometheus_client import generate_latest

from gpuppetti.commands.doctor.enforcement import enforcement_checks
from gpuppetti.commands.doctor.result import Status
from gpuppetti.core import cdi
from gpuppetti.core.config import VirtioSection
from gpuppetti.core.model import ContainerEdits, DriverLimit, Gpu, Hook, Mechanism, Vendor, enforced_by
from gpuppetti.discovery.drm import DrmBackend, dmem_regions
from gpuppetti.discovery.nvml import NvmlBackend
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.dra.plan import plan_claim
from gpuppetti.dra.slices import pool_content
from gpuppetti.kit.draplugin import ClaimRef
from gpuppetti.layer import dmem_hook
from gpuppetti.layer.vulkan import LayerDir
from gpuppetti.node.inventory import Inventory
from gpuppetti.node.metrics import Metrics
from gpuppetti.node.report import gpu_records
from gpuppetti.sharing.budgets import Budget
from gpuppetti.sharing.limits import DMEM_HOOK, limit_edits
from tests.dra_support import DRIVER, NODE
from tests.fakes.toolkit import fake_toolkit
from tests.fixtures import FakeHost
from tests.helpers import config_from

FAKES = Path(__file__).resolve().parent.parent / "fakes"
MIB = 2**20
GIB = 2**30
NVML_HOOK = DriverLimit(Mechanism.NVML, hook="/usr/bin/nvidia-cdi-hook")
XE_REGION = DriverLimit(Mechanism.DMEM, region="drm/0000:03:00.0/vram0")


def _gpu(vendor: Vendor = Vendor.NVIDIA, *limits: DriverLimit, gpu_id: str = "g0") -> Gpu:
    return Gpu(id=gpu_id, index=0, vendor=vendor, model="m", backend="test", memory_bytes=16 * GIB,
               pci_address="0000:03:00.0", limits=limits)


def test_mechanisms_are_joined_in_one_order_and_nothing_is_none() -> None:
    assert enforced_by([Mechanism.DMEM, Mechanism.VULKAN_LAYER]) == "vulkan-layer+dmem"
    assert enforced_by([Mechanism.NVML, Mechanism.VULKAN_LAYER]) == "vulkan-layer+nvml"
    assert enforced_by([]) == "none"


def test_a_hook_is_written_into_the_cdi_spec() -> None:
    edits = ContainerEdits(env={"A": "1"})
    edits.add_hook(Hook("createContainer", "/usr/bin/nvidia-cdi-hook", ("nvidia-cdi-hook", "x"), timeout=10))
    edits.merge(ContainerEdits(hooks=[Hook("createContainer", "/usr/bin/nvidia-cdi-hook",
                                           ("nvidia-cdi-hook", "x"), timeout=10)]))
    spec = cdi.build_spec("gpu.gpuppetti.dev/gpu", [("d", edits)])
    assert spec["devices"][0]["containerEdits"]["hooks"] == [
        {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook", "args": ["nvidia-cdi-hook", "x"],
         "timeout": 10}]
    assert spec["cdiVersion"] == "0.3.0"


def test_an_nvidia_slice_carries_the_drivers_limit_in_mib_and_its_hook() -> None:
    gpu = _gpu(Vendor.NVIDIA, NVML_HOOK)
    edits = limit_edits([Budget(gpu, 4 * GIB + 5)], "/var/lib/gpuppetti/vulkan")
    assert edits.env["NVIDIA_GPU_MEMORY_LIMIT"] == "4096"
    assert edits.env["GPUPPETTI_ENFORCED_BY"] == "vulkan-layer+nvml"
    assert edits.hooks == [Hook("createContainer", "/usr/bin/nvidia-cdi-hook",
                                ("nvidia-cdi-hook", "apply-cuda-memory-limits"), timeout=10)]


def test_the_drivers_one_limit_is_not_used_where_a_container_has_nvidia_gpus_of_other_sizes() -> None:
    one, two = _gpu(Vendor.NVIDIA, NVML_HOOK), _gpu(Vendor.NVIDIA, NVML_HOOK, gpu_id="g1")
    edits = limit_edits([Budget(one, GIB), Budget(two, 0)], None)
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in edits.env and not edits.hooks
    assert edits.env["GPUPPETTI_ENFORCED_BY"] == "none,none"
    # Without the toolkit's hook, nothing but the layer.
    edits = limit_edits([Budget(_gpu(Vendor.NVIDIA), GIB)], "/layer")
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in edits.env
    assert edits.env["GPUPPETTI_ENFORCED_BY"] == "vulkan-layer"


def test_a_dmem_slice_gets_the_hook_from_the_layer_directory() -> None:
    gpu = _gpu(Vendor.INTEL, XE_REGION)
    edits = limit_edits([Budget(gpu, GIB)], "/layer", "/tmp/cgroup")
    assert edits.env["GPUPPETTI_ENFORCED_BY"] == "vulkan-layer+dmem"
    assert edits.hooks == [Hook("createRuntime", f"/layer/{DMEM_HOOK}", (DMEM_HOOK, f"{XE_REGION.region}={GIB}"),
                                env=("GPUPPETTI_DMEM_CGROUP_ROOT=/tmp/cgroup",), timeout=10)]
    # The hook is installed with the layer: no layer directory, no dmem.
    assert not limit_edits([Budget(gpu, GIB)], None).hooks


def _fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: str) -> ModuleType:
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"driver_version": driver, "devices": [
        {"uuid": "GPU-1", "name": "NVIDIA H100", "memory": 80 * GIB, "minor": 0, "bus_id": "00000000:3B:00.0"}]}))
    monkeypatch.setenv("FAKE_NVML_STATE", str(state))
    spec = importlib.util.spec_from_file_location(f"fake_pynvml_{tmp_path.name}", FAKES / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("driver", "commands", "held"), [
    ("615.20.01", "apply-cuda-memory-limits, update-ldcache", True),
    ("580.95.05", "apply-cuda-memory-limits, update-ldcache", False),
    ("615.20.01", "update-ldcache", False),
    ("620.1", None, False),
])
def test_nvml_finds_the_drivers_limit_only_with_driver_615_and_the_toolkits_hook(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: str, commands: str | None, held: bool) -> None:
    if commands is not None:
        fake_toolkit(tmp_path, commands)
    backend = NvmlBackend(tmp_path, [], module=_fake_nvml(tmp_path, monkeypatch, driver))
    [gpu] = backend.discover()
    assert gpu.limits == ((NVML_HOOK,) if held else ())
    limit, why = backend.limits_support()
    assert (limit is not None) == held
    if not held:
        assert ("older than r615" in why) == driver.startswith("580")


def _xe_host(root: Path, capacity: str | None, python: bool = True) -> FakeHost:
    host = FakeHost(root)
    if python:
        (root / "usr/bin").mkdir(parents=True, exist_ok=True)
        (root / "usr/bin/python3").write_text("")
        (root / "usr/bin/python3").chmod(0o755)
    host.pci_gpu(card=0, render=128, bdf="0000:03:00.0", vendor=0x8086, device=0xE20B, driver="xe")
    if capacity is not None:
        (root / "sys/fs/cgroup").mkdir(parents=True)
        (root / "sys/fs/cgroup/dmem.capacity").write_text(capacity)
    return host


def test_drm_gives_a_gpu_its_dmem_region_and_the_regions_size_as_its_memory(tmp_path: Path) -> None:
    _xe_host(tmp_path, "drm/0000:03:00.0/vram0 12884901888\ndrm/0000:03:00.0/stolen 1024\nbogus\n")
    assert dmem_regions(tmp_path) == {"0000:03:00.0": ("drm/0000:03:00.0/vram0", 12 * GIB)}
    [gpu] = DrmBackend(tmp_path, VirtioSection()).discover()
    assert gpu.limits == (XE_REGION,)
    assert gpu.memory_bytes == 12 * GIB


def test_drm_leaves_the_region_out_where_the_host_has_no_python_for_the_hook(tmp_path: Path) -> None:
    _xe_host(tmp_path, "drm/0000:03:00.0/vram0 12884901888\n", python=False)
    [gpu] = DrmBackend(tmp_path, VirtioSection()).discover()
    assert gpu.limits == ()


def test_drm_without_the_dmem_controller_finds_no_region(tmp_path: Path) -> None:
    _xe_host(tmp_path, None)
    [gpu] = DrmBackend(tmp_path, VirtioSection()).discover()
    assert gpu.limits == ()
    assert dmem_regions(tmp_path) is None


SIMULATED = """\
version: v1
backend: simulated
simulated:
  gpus:
    - {model: H100, vendor: nvidia, memory: 80Gi, count: 2}
sharing:
  timeSlicing:
    resources: [{name: nvidia.com/gpu, replicas: 4}]
dra: {slicing: consumable}
"""


def _inventory(limits: tuple[DriverLimit, ...] = (NVML_HOOK,)) -> Inventory:
    config = config_from(SIMULATED)
    gpus = SimulatedBackend(config.simulated).discover()
    return Inventory(config, [dataclasses.replace(gpus[0], limits=limits), gpus[1]])


def test_discover_records_the_resource_slice_attribute_and_metrics_say_what_holds_each_gpu() -> None:
    inventory = _inventory()
    records = gpu_records(inventory.snapshot, layer=True)
    assert [r["enforced_by"] for r in records] == ["vulkan-layer+nvml", "vulkan-layer"]
    assert [r["enforced_by"] for r in gpu_records(inventory.snapshot, layer=False)] == ["nvml", "none"]
    spec = pool_content(inventory.snapshot, NODE, layer=True).spec(0)
    attributes = {d["name"]: d["attributes"]["enforcedBy"] for d in spec["devices"]}
    assert attributes == {"gpu-nvidia-0": {"string": "vulkan-layer+nvml"}, "gpu-nvidia-1": {"string": "vulkan-layer"}}
    # A DRA attribute's name is a C identifier of at most 32 characters; its string value at most 64.
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,31}", "enforcedBy")
    assert all(len(a["string"]) <= 64 for a in attributes.values())
    metrics = Metrics()
    metrics.watch(inventory)
    metrics.enforced(True)
    text = generate_latest(metrics.registry).decode()
    assert 'gpuppetti_gpu_enforced_by{enforced_by="vulkan-layer+nvml",gpu="sim-nvidia-0"} 1.0' in text
    assert 'gpuppetti_gpu_enforced_by{enforced_by="vulkan-layer",gpu="sim-nvidia-1"} 1.0' in text


def test_a_consumable_claim_of_an_nvidia_slice_gets_the_limit_and_the_toolkits_hook_in_its_cdi_spec(
        tmp_path: Path) -> None:
    from gpuppetti.core.kubeobjects import ResourceClaim

    uid = "3f2a1b0c-0000-4000-8000-00000000c1a1"
    claim = msgspec.convert({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": [
            {"driver": DRIVER, "pool": NODE, "request": "gpu", "device": "gpu-nvidia-0", "shareID": "s1",
             "consumedCapacity": {"memory": "8Gi"}}], "config": []}}}}, ResourceClaim)
    plan = plan_claim(ClaimRef("default", uid, "c"), claim, _inventory().snapshot, NODE, cdi.DEFAULT_KIND,
                      LayerDir(tmp_path / "vulkan"))
    [device] = plan.spec["devices"]
    env = dict(line.split("=", 1) for line in device["containerEdits"]["env"])
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "8192"
    assert env["GPUPPETTI_ENFORCED_BY"] == "vulkan-layer+nvml"
    assert device["containerEdits"]["hooks"] == [
        {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
         "args": ["nvidia-cdi-hook", "apply-cuda-memory-limits"], "timeout": 10}]


def _proc(root: Path, pid: int, cgroup: str) -> Path:
    (root / "proc" / str(pid)).mkdir(parents=True)
    (root / "proc" / str(pid) / "cgroup").write_text(f"0::{cgroup}\n")
    return root / "proc"


def test_the_dmem_hook_writes_the_containers_dmem_max(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 42, "/kubepods/pod1/c1")
    root = tmp_path / "cgroup"
    (root / "kubepods/pod1/c1").mkdir(parents=True)
    (root / "dmem.capacity").write_text("drm/0000:03:00.0/vram0 12884901888\n")
    limits = dmem_hook.parse_limits(["drm/0000:03:00.0/vram0=1073741824", "drm/0000:04:00.0/vram0=5"])
    written = dmem_hook.apply({"pid": 42, "bundle": "/b"}, limits, root, proc)
    assert written == ["drm/0000:03:00.0/vram0 1073741824"]
    assert (root / "kubepods/pod1/c1/dmem.max").read_text() == "drm/0000:03:00.0/vram0 1073741824\n"


def test_the_dmem_hook_writes_nothing_where_the_kernel_has_no_controller(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 42, "/kubepods/pod1/c1")
    root = tmp_path / "cgroup"
    (root / "kubepods/pod1/c1").mkdir(parents=True)
    limits = dmem_hook.parse_limits(["drm/0000:03:00.0/vram0=1073741824"])
    assert dmem_hook.apply({"pid": 42}, limits, root, proc) == []
    assert not (root / "kubepods/pod1/c1/dmem.max").exists()


def test_the_dmem_hook_says_what_is_wrong_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert dmem_hook.main(["hook", "vram0"], io.StringIO("{}"), {}) == 1
    assert capsys.readouterr().err == "gpuppetti-dmem-hook: argument 'vram0' is not REGION=BYTES\n"
    assert dmem_hook.main(["hook"], io.StringIO("[1]"), {}) == 1
    assert "not a JSON object" in capsys.readouterr().err


def test_the_layer_directory_gets_the_dmem_hook(tmp_path: Path) -> None:
    layer = LayerDir(tmp_path / "vulkan")
    try:
        layer.install()
    except Exception as exc:  # an installation without the built layer installs nothing
        pytest.skip(str(exc))
    hook = tmp_path / "vulkan" / DMEM_HOOK
    assert hook.read_text().startswith("#!/usr/bin/env python3\n")
    assert hook.stat().st_mode & 0o111


def test_doctor_says_what_holds_each_gpu_and_the_fix_for_the_stronger_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", _fake_nvml(tmp_path, monkeypatch, "580.95.05"))
    nvidia = _gpu(Vendor.NVIDIA, gpu_id="n0")
    intel = dataclasses.replace(_gpu(Vendor.INTEL, gpu_id="i0"), driver="xe")
    held = _gpu(Vendor.INTEL, XE_REGION, gpu_id="i1")
    results = enforcement_checks([nvidia, intel, held], tmp_path, layer=True)
    by = {r.check: r for r in results}
    assert by["enforced by n0"].status is Status.WARN
    assert "older than r615" in by["enforced by n0"].detail and "r615" in (by["enforced by n0"].fix or "")
    assert by["enforced by i0"].status is Status.WARN
    assert "no dmem cgroup controller" in by["enforced by i0"].detail
    assert (by["enforced by i1"].status, by["enforced by i1"].detail) == (Status.OK, "vulkan-layer+dmem")
    nothing = enforcement_checks([_gpu(Vendor.APPLE, gpu_id="a0")], tmp_path, layer=False)
    assert [(r.status, r.detail) for r in nothing] == [(Status.WARN, "none: its slices are not held to their memory")]


def test_top_says_what_holds_each_gpus_slices() -> None:
    from rich.console import Console

    from gpuppetti.commands.top import GpuRecord, View, render

    records = [GpuRecord.model_validate(record) for record in gpu_records(_inventory().snapshot, layer=True)]
    console = Console(width=160, record=True)
    console.print(render(View("http://node:8080", records, [], 0.0), 160))
    lines = console.export_text().splitlines()
    assert any("sim-nvidia-0" in line and "enforced by vulkan-layer+nvml" in line for line in lines)
    assert any("sim-nvidia-1" in line and line.endswith("enforced by vulkan-layer") for line in lines)


def test_the_device_plugin_which_cannot_hand_a_hook_never_says_dmem() -> None:
    gpu = _gpu(Vendor.INTEL, XE_REGION)
    edits = limit_edits([Budget(gpu, GIB)], "/layer", hooks=False)
    assert (edits.env["GPUPPETTI_ENFORCED_BY"], edits.hooks) == ("vulkan-layer", [])
    assert "GPUPPETTI_DMEM_MAX" not in edits.env
    inventory = Inventory(config_from(SIMULATED), [dataclasses.replace(gpu, id="sim-x")])
    assert [r["enforced_by"] for r in gpu_records(inventory.snapshot, layer=True, hooks=False)] == ["vulkan-layer"]
    assert [r["enforced_by"] for r in gpu_records(inventory.snapshot, layer=True)] == ["vulkan-layer+dmem"]
    metrics = Metrics()
    metrics.watch(inventory)
    metrics.enforced(True, hooks=False)
    assert 'enforced_by="vulkan-layer",gpu="sim-x"' in generate_latest(metrics.registry).decode()


def test_a_fifo_or_a_huge_file_at_dmem_capacity_is_read_as_a_host_file(tmp_path: Path) -> None:
    # A FIFO would hang discovery for ever; a file of 64 MiB would be read whole.
    _xe_host(tmp_path, None)
    capacity = tmp_path / "sys/fs/cgroup/dmem.capacity"
    capacity.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(capacity)
    assert dmem_regions(tmp_path) is None
    [gpu] = DrmBackend(tmp_path, VirtioSection()).discover()
    assert gpu.limits == ()
    capacity.unlink()
    with capacity.open("wb") as handle:
        handle.write(b"drm/0000:03:00.0/vram0 12884901888\n")
        handle.write(b"x" * (64 << 20))
    tracemalloc.start()
    try:
        assert dmem_regions(tmp_path) == {"0000:03:00.0": ("drm/0000:03:00.0/vram0", 12 * GIB)}
        assert tracemalloc.get_traced_memory()[1] < 1 << 20, "not read whole"
    finally:
        tracemalloc.stop()


def test_a_toolkit_hook_that_talks_for_ever_or_leaves_children_is_cut_off_at_its_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuppetti.discovery import nvml

    monkeypatch.setattr(nvml, "HELP_TIMEOUT_S", 1.0)
    hook = tmp_path / "usr/bin/nvidia-cdi-hook"
    hook.parent.mkdir(parents=True)
    child = tmp_path / "child.pid"
    # A child that holds the output open and outlives the hook, and endless output after the commands' list.
    hook.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {child}\necho 'COMMANDS: apply-cuda-memory-limits'\n"
                    "exec yes\n")
    hook.chmod(0o755)
    began = time.monotonic()
    found, why = nvml.toolkit_hook(tmp_path)
    assert time.monotonic() - began < 3.0
    assert found is None and "within 1s (killed)" in why, why
    pid = int(child.read_text())
    time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], \
        "the hook's child was ended with it"
    # A hook that answers and exits, leaving a child behind that holds its output, is read at once.
    hook.write_text("#!/bin/sh\nsleep 60 &\necho 'COMMANDS: apply-cuda-memory-limits'\n")
    began = time.monotonic()
    found, _ = nvml.toolkit_hook(tmp_path)
    assert found == "/usr/bin/nvidia-cdi-hook" and time.monotonic() - began < 0.9
