"""In a Venus VM (guest/node.sh, with the guest's own lavapipe shown beside Venus): the project installed from its
wheel, used through its commands as on a krunkit node. ``gpuppetti discover`` with the guide's virtio config,
``gpuppetti plugin`` on the virtio-gpu (drm backend) registered with the kubelet emulator, each Allocate answer
applied as a runtime applies it (guest/driver.py), workloads held to their slices on Venus, and ``gpuppetti
doctor`` against that plugin. Beside them, ``gpuppetti dra`` on the same GPU against the tests' API server and DRA
kubelet stand-ins (guest/dra.py): its ResourceSlices, claims it prepares, each claim's CDI device applied to a
container whose Vulkan probe runs on Venus, and the node re-sliced into partitions.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import pytest

from tests.apps.support import Ran
from tests.apps.test_llama_cpp import answer, free_mib, offloaded, vulkan_buffer_mib
from tests.apps.test_llama_cpp import log as llama_log
from tests.cdi_checks import spec_problems
from tests.dra_support import validate
from tests.venus.venusnode import Batch

MIB = 2**20
SLICE = 512 * MIB
GPU = "virtio-0000-00-01.0"
VENUS = "Virtio-GPU Venus ("
SELECTOR = "pci:0000:00:01.0"


def step(node: Batch, name: str) -> dict[str, Any]:
    steps = node.json("steps.json")
    assert name in steps, f"the guest ran no step {name}:\n{node.context()}"
    ran: dict[str, Any] = steps[name]
    assert ran["code"] == 0, f"{name} exited {ran['code']}:\n{ran['stderr']}"
    return ran


def reports(node: Batch, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in step(node, name)["stdout"].splitlines() if line.startswith("{")]


def test_discover_finds_the_gpu_with_the_guides_virtio_config(node: Batch) -> None:
    assert node.code("discover") == 0, node.text("discover.err")
    [gpu] = node.json("discover.json")
    assert (gpu["id"], gpu["vendor"], gpu["model"], gpu["backend"]) == (GPU, "apple", "Apple M3 Max", "drm")
    assert (gpu["cores"], gpu["memory_bytes"], gpu["facts"]) == (40, 48 * 2**30, "config")
    assert gpu["device_nodes"] == ["/dev/dri/renderD128"], "the render node only: no card node for a virtio-gpu"
    assert gpu["pci_address"] == "0000:00:01.0"
    assert (gpu["resource"], gpu["replicas"], gpu["slice_memory_bytes"]) == ("apple.com/gpu", 4, 12 * 2**30)


def test_the_plugin_serves_the_virtio_gpu_to_the_kubelet(node: Batch) -> None:
    assert node.text("registered").strip() == "4", node.context()
    allocations = node.json("allocations.json")
    assert allocations["pod-1"]["units"] == [f"{GPU}::0"]
    assert allocations["pod-3"]["units"] == [f"{GPU}::2", f"{GPU}::3"]
    assert "requested number of devices unavailable for apple.com/gpu" in allocations["pod-4"]["refused"]
    answer = allocations["pod-1"]
    assert answer["devices"] == [{"container_path": "/dev/dri/renderD128", "host_path": "/dev/dri/renderD128",
                                  "permissions": "rw"}]
    mounted = {mount["container_path"]: mount for mount in answer["mounts"]}
    assert set(mounted) == {"/etc/vulkan/implicit_layer.d/VkLayer_gpuppetti.json",
                            "/usr/lib/gpuppetti/libVkLayer_gpuppetti.so", "/usr/local/bin/gpuppetti-vkinfo",
                            "/run/gpuppetti/vulkan"}
    assert all(mount["read_only"] for mount in mounted.values()), "nothing writable from the node"
    assert node.code("driver") == 0, node.text("driver.log")[-3000:]
    assert node.code("plugin") == 0, "SIGTERM stops the plugin cleanly"


def test_the_container_sees_its_render_node_and_the_env_that_selects_venus(node: Batch) -> None:
    assert step(node, "dri")["stdout"].split() == ["renderD128"], "only the node Allocate named, not card0"
    env = dict(line.split("=", 1) for line in step(node, "env")["stdout"].splitlines() if "=" in line)
    assert env["GGML_VK_VISIBLE_DEVICES"] == "0"
    assert env["GPUPPETTI_VK_SLICES"] == f"{SELECTOR}={SLICE}", "Venus is found by its PCI bus address"
    assert env["GPUPPETTI_VK_COMPUTE"] == "250"
    # No Vulkan ids configured: the config's vulkanDevice cannot name Venus on lavapipe (vendor 0x10005 has five
    # digits), so nothing sets MESA_VK_DEVICE_SELECT here.
    assert "MESA_VK_DEVICE_SELECT" not in env


def test_position_0_is_venus_whether_or_not_the_layer_hides_the_other_device(node: Batch) -> None:
    # Without the layer the container's Vulkan shows Venus and the guest's own lavapipe; with it, only Venus, so
    # GGML_VK_VISIBLE_DEVICES=0 names Venus either way.
    [unlayered] = reports(node, "unlayered")
    names = [device["name"] for device in unlayered["devices"]]
    assert len(names) == 2 and names[0].startswith(VENUS) and names[1].startswith("llvmpipe"), names
    [sliced] = reports(node, "slice")
    assert [device["name"] for device in sliced["devices"]] == names[:1]


def test_a_slice_is_the_containers_gpu_on_venus(node: Batch) -> None:
    [report] = reports(node, "slice")
    assert report["layer"] is True
    [device] = report["devices"]
    assert (device["driver"]["id"], device["driver"]["name"]) == (22, "venus")
    assert (device["pci_bus"], device["drm"]["render"]) == ("0000:00:01.0", "226:128")
    assert device["memory_budget"] is True, "VK_EXT_memory_budget, which Venus lacks, comes from the layer"
    assert device["max_allocation"] <= SLICE
    [heap] = device["heaps"]
    assert (heap["size"], heap["budget"]) == (SLICE, SLICE)
    allocation = report["allocation"]
    assert allocation["obtained"] == SLICE
    assert allocation["refused_with"] == "VK_ERROR_OUT_OF_DEVICE_MEMORY"
    assert allocation["heap_usage_after"] == SLICE


def test_two_processes_of_a_container_share_its_slice(node: Batch) -> None:
    second, first = reports(node, "shared")
    assert first["allocation"]["obtained"] == 192 * MIB
    assert second["allocation"]["obtained"] == SLICE - 192 * MIB
    assert second["devices"][0]["heaps"][0]["usage"] == 192 * MIB, "the budget counts the other process"


def test_two_slices_give_twice_the_memory_and_the_time(node: Batch) -> None:
    [report] = reports(node, "two-slices")
    assert report["slices"] == f"{SELECTOR}={2 * SLICE}" and report["compute"] == "500"
    assert report["devices"][0]["heaps"][0]["size"] == 2 * SLICE
    assert report["allocation"]["obtained"] == 2 * SLICE


def share(node: Batch, name: str) -> float:
    ran = step(node, name)
    [report] = [json.loads(line) for line in ran["stdout"].splitlines() if line.startswith("{")]
    busy = report["busy"]
    assert busy["batches"] >= 5, busy
    value: float = busy["gpu_seconds"] / busy["seconds"]
    return value


def test_a_quarter_share_keeps_venus_busy_about_a_quarter_of_the_time(node: Batch) -> None:
    free = share(node, "busy-free")
    quarter = share(node, "busy-share")
    # The share is of wall time, so a quarter holds however loaded the host is; what the workload reaches without
    # the layer depends on that load (a CI machine running other tiers beside this one took it to 0.49 with one
    # batch in flight), so it is judged by a margin over the quarter rather than by an absolute figure.
    print(f"busy without the layer: {free:.2f}; with a quarter share: {quarter:.2f}")
    assert 0.1 <= quarter <= 0.4, (free, quarter)
    assert free >= 0.4 and free >= quarter + 0.15, ("without the layer, the workload keeps Venus busy", free, quarter)
    hung = [attempt for name in ("busy-share", "busy-free") for attempt in step(node, name)["attempts"]
            if attempt["timed_out"]]
    if hung:
        # Said in the output (-rP) but not a failure: a stand-in's stall, with the layer and without it.
        print(f"{len(hung)} busy run(s) stalled on Venus and were run again: {[a['stderr'][-200:] for a in hung]}")


def doubled(mib: int, seed: int) -> str:
    """What wgpu_app's compute shader makes of ``mib`` MiB from ``seed``, computed here: its SHA-256."""
    data = random.Random(seed).randbytes(mib * MIB)
    words = memoryview(data).cast("I")
    return hashlib.sha256(b"".join(((word * 2) & 0xFFFFFFFF).to_bytes(4, "little") for word in words)).hexdigest()


def test_wgpu_runs_inside_a_slice_on_venus(node: Batch) -> None:
    [report] = reports(node, "wgpu")
    adapter = report["info"]["adapter"]
    assert (adapter["backend_type"], adapter["vendor"]) == ("Vulkan", "venus")
    assert adapter["device"].startswith(VENUS)
    assert report["info"]["limits"]["max-buffer-size"] <= SLICE, "wgpu sizes its buffers by the slice"
    assert report["double"]["sha256"] == doubled(1, 7), "a compute shader's result, right, on Venus"
    fill = report["fill"]
    assert fill["error"] is not None, "wgpu obtained twice its slice"
    assert "Not enough memory left" in fill["error"]["message"], fill["error"]
    assert SLICE // 2 <= fill["obtained"] <= SLICE, fill["obtained"]
    assert fill["after"]["sha256"] == doubled(4, 7), "refused, wgpu goes on computing right"


def llama(node: Batch, name: str) -> Ran:
    """llama.cpp's run of step ``name`` as the apps' tests see theirs: its exit, its answer, its whole log."""
    skipped = node.out.parent / "llama" / "skipped"
    if skipped.exists():
        pytest.skip(f"no llama.cpp in the guest: {skipped.read_text().strip()}")
    steps = node.json("steps.json")
    assert name in steps, f"the guest ran no step {name}:\n{node.context()}"
    ran = steps[name]
    return Ran(ran["code"], ran["stdout"], node.text(f"{name}.log"), ran["seconds"])


def test_llama_cpp_inside_a_slice_on_venus_sees_the_slice_and_answers_as_without_the_layer(node: Batch) -> None:
    inside, alone = llama(node, "llama-inside"), llama(node, "llama-alone")
    assert inside.code == 0, llama_log(inside)
    assert alone.code == 0, llama_log(alone)
    assert "using device Vulkan0 (Virtio-GPU Venus" in inside.stderr, llama_log(inside)
    # Its device's free memory is the slice (VK_EXT_memory_budget, from the layer); without the layer, Venus's heap.
    assert SLICE // MIB - 4 <= free_mib(inside) <= SLICE // MIB
    assert free_mib(alone) > SLICE // MIB
    assert offloaded(inside) == (5, 5), "every layer and the output on Venus"
    used = sum(vulkan_buffer_mib(inside, kind) for kind in ("model", "KV", "compute"))
    assert 8 < used <= SLICE // MIB
    generated = answer(inside)
    assert len(generated.strip()) >= 8, f"it generated text: {generated!r}"
    assert generated == answer(alone), "greedy, token for token what it generates without the layer"


def test_llama_cpp_past_the_slice_on_venus_fails_with_its_own_out_of_memory_error(node: Batch) -> None:
    refused = llama(node, "llama-past")
    assert not refused.signalled, f"llama.cpp crashed ({refused.code}):\n{llama_log(refused)}"
    assert refused.code == 1, llama_log(refused)
    assert free_mib(refused) <= SLICE // MIB
    assert "ErrorOutOfDeviceMemory" in refused.stderr, llama_log(refused)
    assert "unable to allocate Vulkan0 buffer" in refused.stderr, llama_log(refused)
    # llama-server's log thread may not flush its last lines ("failed to load model") before it exits here.
    assert refused.reports() == [], llama_log(refused)


def test_doctor_names_venus_as_the_driver_and_the_window(node: Batch) -> None:
    checks = {result["check"]: result for result in node.json("doctor.json")}
    assert checks["GPUs"]["detail"] == f"1 found by drm: {GPU} (Apple M3 Max)"
    driver = checks["Vulkan driver"]
    assert driver["detail"].startswith(f'{GPU} (/dev/dri/renderD128): venus (Mesa '), driver
    assert "MESA_VENUS" in driver["detail"] and '"Virtio-GPU Venus (llvmpipe' in driver["detail"]
    # The config calls the GPU Apple's; this stand-in's host renders on its CPU, and doctor says so.
    assert driver["status"] == "warn" and "a CPU renderer, not the Mac's GPU" in driver["detail"]
    found = checks["virtio-gpu window"]
    assert found["status"] == "ok", found
    assert found["detail"].startswith(f"{GPU}: the VM can map 1 GiB of GPU memory at once (the virtio-gpu's "
                                      "host-visible window, from debugfs"), found
    assert "each slice (512 MiB) fits" in found["detail"]
    for name in ("kubelet device plugins", "daemon", "Vulkan layer"):
        assert checks[name]["status"] == "ok", checks[name]
    assert "allocation(s) held to their slices" in checks["Vulkan layer"]["detail"]
    # No CRI runtime in this VM.
    assert checks["container runtime"]["status"] == "fail" and node.code("doctor") == 1


# The DRA driver in the guest (guest/dra.py): its node, its device, and the claims the runner allocates on it, each
# with its share ID, its cores and its memory.
DRIVER = "gpu.gpuppetti.dev"
NODE = "venus-node"
DEVICE = "gpu-apple-0"
CONSUMABLE = {"small": ("a1b2c3", 10, 384 * MIB), "large": ("d4e5f6", 20, 1024 * MIB)}
QUARTER = ("a7b8c9", 10, 512 * MIB)
LAYER = "/var/lib/gpuppetti/vulkan"


def dra(node: Batch, *keys: str) -> dict[str, Any]:
    """What guest/dra.py saw; ``keys`` must be there (a runner that stopped halfway says where)."""
    seen: dict[str, Any] = node.json("dra.json")
    missing = [key for key in keys if key not in seen]
    assert not missing, (f"the DRA runner exited {node.code('dra-runner')} without {missing} (it got to "
                         f"{seen['timeline'][-1:]}):\n{node.text('dra-runner.log')[-3000:]}\n"
                         f"{node.text('dra.log')[-3000:]}")
    return seen


def dra_step(node: Batch, name: str) -> tuple[list[str], dict[str, Any]]:
    """A claim's container: what ``ls /dev/dri`` listed in it, and the Vulkan probe's report."""
    steps = node.json("dra-steps.json")
    assert name in steps, f"the DRA runner ran no container {name}:\n{node.text('dra-runner.log')[-3000:]}"
    ran = steps[name]
    assert ran["code"] == 0, f"{name} exited {ran['code']}:\n{ran['stderr']}"
    lines = ran["stdout"].splitlines()
    [report] = [json.loads(line) for line in lines if line.startswith("{")]
    return [line for line in lines if not line.startswith("{")], report


def claim_edits(seen: dict[str, Any], phase: str, name: str) -> tuple[str, dict[str, Any]]:
    """A prepared claim's uid and its CDI device's edits, the spec checked as a CDI runtime checks it."""
    uid: str = seen[f"{phase}-claims"][name]["uid"]
    found = seen[f"{phase}-cdi"][name]
    assert found["file"] == f"gpu.gpuppetti.dev-gpu_{uid}.json"
    spec = found["spec"]
    assert spec_problems(spec) == []
    assert spec["kind"] == f"{DRIVER}/gpu" and "containerEdits" not in spec
    [device] = spec["devices"]
    assert device["name"] == f"claim-{uid}-gpu"
    edits: dict[str, Any] = device["containerEdits"]
    return uid, edits


def held_to(edits: dict[str, Any], uid: str, memory: int, compute: int) -> dict[str, str]:
    """Check that the edits give the render node and put the container under the Vulkan layer with ``memory`` and
    ``compute`` (thousandths of the GPU's time); returns the env."""
    assert edits["deviceNodes"] == [{"path": "/dev/dri/renderD128", "permissions": "rw"}]
    env = dict(line.split("=", 1) for line in edits["env"])
    assert env["GPUPPETTI_VK_SLICES"] == f"{SELECTOR}={memory}", "Venus is found by its PCI bus address"
    assert env["GPUPPETTI_VK_COMPUTE"] == str(compute)
    assert (env["GPUPPETTI_VK_LEDGER"], env["GPUPPETTI_LIMITS"]) == ("/run/gpuppetti/vulkan/ledger.sock", "vulkan")
    assert (env["GPUPPETTI_VISIBLE_DEVICES"], env["GGML_VK_VISIBLE_DEVICES"]) == (GPU, "0")
    assert (env["GPUPPETTI_CLAIM"], env["GPUPPETTI_MEMORY"]) == (uid, str(memory))
    mounts = {mount["containerPath"]: (mount["hostPath"], mount["options"][0]) for mount in edits["mounts"]}
    assert mounts == {
        "/etc/vulkan/implicit_layer.d/VkLayer_gpuppetti.json": (f"{LAYER}/VkLayer_gpuppetti.json", "ro"),
        "/usr/lib/gpuppetti/libVkLayer_gpuppetti.so": (f"{LAYER}/libVkLayer_gpuppetti.so", "ro"),
        "/usr/local/bin/gpuppetti-vkinfo": (f"{LAYER}/gpuppetti-vkinfo", "ro"),
        "/run/gpuppetti/vulkan": (f"{LAYER}/ledgers/dra-{uid}-gpu", "ro"),
    }
    return env


def sees_on_venus(node: Batch, name: str, memory: int) -> None:
    """The claim's container has the render node only, and its Vulkan (Venus alone, as in an image without another
    driver) has the claim's memory as its heap and budget, all of which it obtains before it is refused."""
    listed, report = dra_step(node, name)
    assert listed == ["renderD128"], "only the node the CDI device names, not card0"
    assert report["layer"] is True
    [device] = report["devices"]
    assert device["name"].startswith(VENUS)
    assert (device["driver"]["id"], device["driver"]["name"]) == (22, "venus")
    assert (device["pci_bus"], device["drm"]["render"]) == ("0000:00:01.0", "226:128")
    assert device["memory_budget"] is True
    [heap] = device["heaps"]
    assert (heap["size"], heap["budget"]) == (memory, memory)
    allocation = report["allocation"]
    assert (allocation["obtained"], allocation["heap_usage_after"]) == (memory, memory)
    assert allocation["refused_with"] == "VK_ERROR_OUT_OF_DEVICE_MEMORY"


def test_the_dra_driver_publishes_the_virtio_gpu_as_consumable_capacity(node: Batch) -> None:
    seen = dra(node, "registration", "consumable-slices")
    assert seen["registration"] == {"service": "v1.DRAPlugin",
                                    "endpoint": f"/var/lib/kubelet/plugins/{DRIVER}/dra.sock"}
    [published] = seen["consumable-slices"]
    validate(published)
    spec = published["spec"]
    assert (spec["driver"], spec["nodeName"], spec["pool"]["name"], spec["pool"]["resourceSliceCount"]) == (
        DRIVER, NODE, NODE, 1)
    [device] = spec["devices"]
    assert (device["name"], device["allowMultipleAllocations"]) == (DEVICE, True)
    attributes = device["attributes"]
    assert (attributes["vendor"], attributes["model"], attributes["cores"], attributes["backend"]) == (
        {"string": "apple"}, {"string": "Apple M3 Max"}, {"int": 40}, {"string": "drm"})
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:00:01.0"}
    # The node's config: 40 cores and 2 GiB; with no shares configured, a claim that names no capacity gets a
    # quarter of each, and one that names some takes the least of the others.
    assert device["capacity"] == {
        "share": {"value": "1", "requestPolicy": {"default": "1m", "validRange": {"min": "1m", "max": "1",
                                                                                   "step": "1m"}}},
        "cores": {"value": "40", "requestPolicy": {"default": "10", "validRange": {"min": "1", "max": "40",
                                                                                    "step": "1"}}},
        "memory": {"value": "2Gi", "requestPolicy": {"default": "512Mi", "validRange": {"min": "1Mi", "max": "2Gi",
                                                                                         "step": "1Mi"}}},
    }


def test_dra_claims_with_share_ids_are_prepared_under_the_vulkan_layer(node: Batch) -> None:
    seen = dra(node, "consumable-prepared", "consumable-cdi", "consumable-layer-before")
    uids = []
    for name, (share_id, cores, memory) in CONSUMABLE.items():
        claim = seen["consumable-claims"][name]
        validate(claim["object"])
        uid, edits = claim_edits(seen, "consumable", name)
        assert seen["consumable-prepared"][name] == {"error": "", "devices": [{
            "pool": NODE, "device": DEVICE, "requests": ["gpu"], "cdi": [f"{DRIVER}/gpu=claim-{uid}-gpu"],
            "share_id": share_id}]}
        env = held_to(edits, uid, memory, cores * 1000 // 40)
        assert (env["GPUPPETTI_SHARING"], env["GPUPPETTI_CORES"], env["GPUPPETTI_SHARE_ID"]) == (
            "consumable", str(cores), share_id)
        uids.append(uid)
    assert seen["consumable-layer-before"] == sorted(f"dra-{uid}-gpu" for uid in uids)


def test_a_dra_claims_container_has_the_claims_memory_on_venus(node: Batch) -> None:
    for name, (_, _, memory) in CONSUMABLE.items():
        sees_on_venus(node, f"consumable-{name}", memory)


def test_re_sliced_into_partitions_a_dra_claim_of_a_quarter_gets_a_quarter_on_venus(node: Batch) -> None:
    seen = dra(node, "partitions-slices", "partitions-prepared", "partitions-cdi")
    [published] = seen["partitions-slices"]
    validate(published)
    [before] = seen["consumable-slices"]
    assert published["spec"]["pool"]["generation"] > before["spec"]["pool"]["generation"]
    [device] = published["spec"]["devices"]
    assert (device["name"], device["allowMultipleAllocations"]) == (DEVICE, True)
    assert device["attributes"]["partitions"] == {"int": 8}
    assert device["capacity"] == {"memory": {"value": "2Gi", "requestPolicy": {
        "default": "256Mi", "validValues": ["256Mi", "512Mi", "1Gi", "2Gi"]}}}
    share_id, cores, memory = QUARTER
    validate(seen["partitions-claims"]["quarter"]["object"])
    uid, edits = claim_edits(seen, "partitions", "quarter")
    assert seen["partitions-prepared"]["quarter"]["error"] == ""
    assert seen["partitions-prepared"]["quarter"]["devices"][0]["share_id"] == share_id
    env = held_to(edits, uid, memory, 250)
    assert (env["GPUPPETTI_SHARING"], env["GPUPPETTI_CORES"], env["GPUPPETTI_REPLICAS"]) == (
        "partition", str(cores), "4")
    assert "consumedCapacity.memory '640Mi' is not the size of one of its partitions (1/1, 1/2, 1/4, 1/8)" in (
        seen["partitions-prepared"]["odd"]["error"])
    sees_on_venus(node, "partitions-quarter", memory)


def test_unprepared_dra_claims_leave_nothing_and_the_driver_stops_cleanly(node: Batch) -> None:
    seen = dra(node, "consumable-unprepared", "partitions-unprepared", "driver-exit")
    assert seen["consumable-unprepared"] == {"small": "", "large": ""}
    assert seen["partitions-unprepared"] == {"quarter": "", "odd": ""}
    for phase in ("consumable", "partitions"):
        assert (seen[f"{phase}-cdi-after"], seen[f"{phase}-layer-after"]) == ([], []), phase
    assert seen["driver-exit"] == 0, node.text("dra.log")[-3000:]
    assert seen["sockets-after"] == [], "SIGTERM removes the registration and DRA sockets"
    assert node.code("dra-runner") == 0, node.text("dra-runner.log")[-3000:]
