"""The DRA driver against the real kubelet, API server and scheduler: slices, claims, CDI, restarts, health."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.realnode import BUSYBOX, CDI_DIR, REPO, Daemon, RealNode, pod, wait_for, write_config

DRIVER = "gpu.gpuppetti.dev"
SPEC_PREFIX = "gpu.gpuppetti.dev-gpu_"
EXAMPLES = REPO / "deploy" / "examples" / "dra"


def config(slicing: str = "whole", gpus: str = "", extra: str = "") -> str:
    gpus = gpus or "    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: 2}\n"
    return (f"version: v1\nbackend: simulated\nsimulated:\n  gpus:\n{gpus}"
            f"dra:\n  slicing: {slicing}\n  partitions: [4]\n{extra}")


@pytest.fixture(scope="module")
def classes(realnode: RealNode) -> Iterator[None]:
    """The DRA base's RBAC and DeviceClasses (not its DaemonSet: the driver runs on the host here), the examples."""
    rendered = subprocess.run([sys.executable, "-m", "gpuppetti", "manifests", "--mode", "dra"], check=True,
                              capture_output=True, text=True).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o["kind"] != "DaemonSet"]
    realnode.apply(objects)
    realnode.kubectl("apply", "-f", str(EXAMPLES))
    yield
    realnode.kubectl("delete", "--ignore-not-found", "-f", str(EXAMPLES))


def start(node: RealNode, workdir: Path, text: str, ready: bool = True) -> Daemon:
    path = write_config(workdir, "dra.yaml", text)
    daemon = node.gpuppetti("gpuppetti-dra", "dra", "--config", str(path), "--node-name", node.name,
                            "--kubeconfig", str(node.kubeconfig), "--http-address", "127.0.0.1:0")
    if ready:
        daemon.wait_ready()
    return daemon


def reload(daemon: Daemon, workdir: Path, text: str) -> None:
    write_config(workdir, "dra.yaml", text)
    mark = len(daemon.log())
    daemon.signal(signal.SIGHUP)
    daemon.wait_log("config reloaded", after=mark)


def devices(node: RealNode) -> dict[str, dict[str, Any]]:
    slices = node.get("resourceslices", field_selector=f"spec.driver={DRIVER}")["items"]
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def template(name: str, requests: dict[str, str] | None = None, klass: str = DRIVER,
             config: dict[str, Any] | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {"name": "gpu", "exactly": {"deviceClassName": klass}}
    if requests:
        request["exactly"]["capacity"] = {"requests": requests}
    spec: dict[str, Any] = {"devices": {"requests": [request]}}
    if config:
        spec["devices"]["config"] = [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.gpuppetti.dev/v1alpha1", "kind": "GpuConfig", **config}}}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": spec}}


def claim_pod(name: str, template_name: str) -> dict[str, Any]:
    return pod(name, claims=[("gpu", "template", template_name)])


def pending(node: RealNode, name: str) -> bool:
    conditions = node.pod(name)["status"].get("conditions") or []
    return any(c["type"] == "PodScheduled" and c["status"] == "False" for c in conditions)


def specs() -> list[Path]:
    return sorted(CDI_DIR.glob(f"{SPEC_PREFIX}*.json"))


def test_slices_are_accepted_in_every_mode_with_a_taint(node: RealNode, workdir: Path, classes: None) -> None:
    gpus = ("    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi}\n"
            "    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, health: Unhealthy}\n")
    expected = {
        ("whole", ""): {"gpu-apple-0", "gpu-apple-1"},
        ("partitions", ""): {"gpu-apple-0", "gpu-apple-1"},
        ("partitions", "  partitionLayout: counters\n"): {
            "gpu-apple-0", "gpu-apple-1", *(f"gpu-apple-{g}-p4-{p}" for g in (0, 1) for p in range(4))},
        ("consumable", ""): {"gpu-apple-0", "gpu-apple-1"},
    }
    daemon = start(node, workdir, config("whole", gpus))
    for (mode, extra), names in expected.items():
        if mode != "whole":
            reload(daemon, workdir, config(mode, gpus, extra))
        def listed(names: set[str] = names) -> dict[str, dict[str, Any]] | None:
            found = devices(node)
            return found if set(found) == names else None

        published = wait_for(f"{mode} slices", listed)
        for name, device in published.items():
            taints = [t["key"] for t in device.get("taints", [])]
            assert taints == ([f"{DRIVER}/unhealthy"] if name.startswith("gpu-apple-1") else []), (name, taints)
        # Consumable capacity, and partitions in their default (capacity) layout: one device many claims share.
        shared = mode == "consumable" or (mode == "partitions" and not extra)
        assert published["gpu-apple-0"].get("allowMultipleAllocations", False) is shared, (mode, extra)
    assert "failed" not in daemon.log().lower().replace("prepare failed", ""), daemon.log()[-3000:]


def test_whole_gpus_go_to_one_claim_each(node: RealNode, workdir: Path, classes: None) -> None:
    start(node, workdir, config("whole"))
    node.apply([claim_pod(f"whole-{n}", "whole-gpu") for n in range(3)])
    wait_for("two pods running and one pending", lambda: sorted(
        node.phase(f"whole-{n}") for n in range(3)) == ["Pending", "Running", "Running"], 90)
    running = [f"whole-{n}" for n in range(3) if node.phase(f"whole-{n}") == "Running"]
    seen = {node.env_of(p)["GPUPPETTI_VISIBLE_DEVICES"] for p in running}
    assert seen == {"sim-apple-0", "sim-apple-1"}
    waiting = next(f"whole-{n}" for n in range(3) if node.phase(f"whole-{n}") == "Pending")
    wait_for(f"{waiting} unschedulable", lambda: pending(node, waiting))


def test_four_quarter_partitions_of_one_gpu_and_a_fifth_waits(node: RealNode, workdir: Path, classes: None) -> None:
    one = "    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi}\n"
    start(node, workdir, config("partitions", one))
    node.apply([claim_pod(f"quarter-{n}", "quarter-gpu") for n in range(5)])
    wait_for("four quarters running", lambda: sum(node.phase(f"quarter-{n}") == "Running" for n in range(5)) == 4, 90)
    waiting = next(f"quarter-{n}" for n in range(5) if node.phase(f"quarter-{n}") != "Running")
    wait_for(f"{waiting} unschedulable", lambda: pending(node, waiting))
    shares = set()
    for n in range(5):
        if f"quarter-{n}" == waiting:
            continue
        env = node.env_of(f"quarter-{n}")
        assert env["GPUPPETTI_SHARING"] == "partition"
        assert (env["GPUPPETTI_CORES"], env["GPUPPETTI_MEMORY"]) == ("10", str(12 * 2**30))
        assert env["GPUPPETTI_SLICES"] == "gpu-apple-0"
        shares.add(env["GPUPPETTI_SHARE_ID"])
    assert len(shares) == 4


def test_counters_layout_four_quarter_partitions_and_a_fifth_waits(
        node: RealNode, workdir: Path, classes: None) -> None:
    one = "    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi}\n"
    start(node, workdir, config("partitions", one, "  partitionLayout: counters\n"))
    by_size = [{"cel": {"expression": "device.attributes['gpu.gpuppetti.dev'].partitions == 4"}}]
    node.apply([{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "p4"},
                 "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                     "deviceClassName": "partition.gpu.gpuppetti.dev", "selectors": by_size}}]}}}}])
    node.apply([claim_pod(f"part-{n}", "p4") for n in range(5)])
    wait_for("four partitions running", lambda: sum(node.phase(f"part-{n}") == "Running" for n in range(5)) == 4, 90)
    waiting = next(f"part-{n}" for n in range(5) if node.phase(f"part-{n}") != "Running")
    wait_for(f"{waiting} unschedulable", lambda: pending(node, waiting))
    parts = {node.env_of(f"part-{n}")["GPUPPETTI_SLICES"] for n in range(5) if f"part-{n}" != waiting}
    assert parts == {f"gpu-apple-0-p4-{p}" for p in range(4)}


def test_ten_small_consumable_claims_share_two_gpus(node: RealNode, workdir: Path, classes: None) -> None:
    start(node, workdir, config("consumable"))
    node.apply([template("small", {"cores": "1", "memory": "1Gi"})])
    node.apply([claim_pod(f"small-{n}", "small") for n in range(10)])
    node.wait_running(*(f"small-{n}" for n in range(10)))
    envs = [node.env_of(f"small-{n}") for n in range(10)]
    assert all(e["GPUPPETTI_SHARING"] == "consumable" for e in envs)
    assert all((e["GPUPPETTI_CORES"], e["GPUPPETTI_MEMORY"]) == ("1", str(2**30)) for e in envs)
    assert len({e["GPUPPETTI_SHARE_ID"] for e in envs}) == 10
    assert {e["GPUPPETTI_VISIBLE_DEVICES"] for e in envs} <= {"sim-apple-0", "sim-apple-1"}


def test_one_claim_shared_by_two_pods_is_prepared_once(node: RealNode, workdir: Path, classes: None) -> None:
    daemon = start(node, workdir, config("whole"))
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "together"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}}
    node.apply([claim, pod("first", claims=[("gpu", "claim", "together")]),
                pod("second", claims=[("gpu", "claim", "together")])])
    node.wait_running("first", "second")
    assert node.env_of("first")["GPUPPETTI_VISIBLE_DEVICES"] == node.env_of("second")["GPUPPETTI_VISIBLE_DEVICES"]
    assert daemon.log().count("prepared claim default/together") == 1
    uid = node.get("resourceclaim", "together")["metadata"]["uid"]
    spec = CDI_DIR / f"{SPEC_PREFIX}{uid}.json"
    assert spec.exists()
    node.delete("pod", "first")
    assert spec.exists(), "still used by the second pod"
    assert "unprepared claim default/together" not in daemon.log()
    node.delete("pod", "second")
    wait_for("the claim unprepared", lambda: not spec.exists())
    daemon.wait_log("unprepared claim default/together")


def test_driver_sigkill_then_restart_recreates_specs_and_pods_can_go(
        node: RealNode, workdir: Path, classes: None) -> None:
    daemon = start(node, workdir, config("whole"))
    node.apply([claim_pod("kept", "whole-gpu")])
    node.wait_running("kept")
    [spec] = specs()
    daemon.kill9()
    spec.unlink()  # as a reboot does to /var/run/cdi
    daemon.start()
    daemon.wait_ready()
    wait_for("the CDI spec re-created from the checkpoint", spec.exists)
    node.delete("pod", "kept")
    wait_for("the claim unprepared", lambda: not spec.exists())


def test_kubelet_restart_brings_the_slices_back(node: RealNode, workdir: Path, classes: None) -> None:
    daemon = start(node, workdir, config("whole"))
    wait_for("slices", lambda: len(devices(node)) == 2)
    mark = len(daemon.log())
    node.ctl("restart", "kubelet")
    daemon.wait_log("registered with the kubelet", after=mark, timeout=60)
    wait_for("slices back after the kubelet's start-up wipe", lambda: len(devices(node)) == 2, 60)
    node.apply([claim_pod("after-restart", "whole-gpu")])
    node.wait_running("after-restart")


def test_unhealthy_gpu_shows_in_the_pod_status(node: RealNode, workdir: Path, classes: None) -> None:
    daemon = start(node, workdir, config("whole"))
    node.apply([claim_pod("watched", "whole-gpu")])
    node.wait_running("watched")
    gpu = node.env_of("watched")["GPUPPETTI_VISIBLE_DEVICES"]
    sick = ("    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, health: "
            + ("Unhealthy}\n" if gpu == "sim-apple-0" else "Healthy}\n")
            + "    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, health: "
            + ("Healthy}\n" if gpu == "sim-apple-0" else "Unhealthy}\n"))
    reload(daemon, workdir, config("whole", sick))

    def reported() -> list[Any] | None:
        statuses = node.pod("watched")["status"]["containerStatuses"][0].get("allocatedResourcesStatus") or []
        unhealthy = [r for s in statuses if s["name"].startswith("claim:") for r in s.get("resources", [])
                     if r.get("health") == "Unhealthy"]
        return statuses if unhealthy else None

    statuses = wait_for("Unhealthy in the pod's allocatedResourcesStatus", reported, 90)
    assert statuses[0]["name"].startswith("claim:"), statuses


def driver_kubeconfig(node: RealNode, workdir: Path) -> Path:
    """A kubeconfig with a token of the driver's ServiceAccount bound to a pod on this node, as the DaemonSet's pod
    gets: the shipped RBAC, and the node the API server ties its associated-node permissions to."""
    node.apply([{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "token-anchor", "namespace": "gpuppetti"},
                 "spec": {"serviceAccountName": "gpuppetti-dra", "terminationGracePeriodSeconds": 1,
                          "containers": [{"name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
                                          "command": ["sleep", "3600"]}]}}])
    node.wait_running("token-anchor", namespace="gpuppetti")
    token = node.kubectl("-n", "gpuppetti", "create", "token", "gpuppetti-dra", "--bound-object-kind", "Pod",
                         "--bound-object-name", "token-anchor").strip()
    config = yaml.safe_load(node.kubeconfig.read_text())
    config["users"] = [{"name": "driver", "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = "driver"
    path = workdir / "driver.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def test_claim_status_says_what_was_prepared_and_unprepare_clears_it(
        node: RealNode, workdir: Path, classes: None) -> None:
    kubeconfig = driver_kubeconfig(node, workdir)
    try:
        path = write_config(workdir, "dra.yaml", config("partitions"))
        daemon = node.gpuppetti("gpuppetti-dra", "dra", "--config", str(path), "--node-name", node.name,
                                "--kubeconfig", str(kubeconfig), "--http-address", "127.0.0.1:0")
        daemon.wait_ready()
        node.apply([{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "quarter"},
                     "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                         "deviceClassName": f"partition.{DRIVER}", "capacity": {"requests": {"memory": "12Gi"}}}}]}}},
                    pod("holder", claims=[("gpu", "claim", "quarter")])])
        node.wait_running("holder")
        env = node.env_of("holder")

        def entry() -> dict[str, Any] | None:
            found = node.get("resourceclaims", "quarter")["status"].get("devices") or []
            return next((e for e in found if e["driver"] == DRIVER), None)

        written = wait_for("the driver's entry in the claim's status.devices", entry, 30)
        [result] = node.get("resourceclaims", "quarter")["status"]["allocation"]["devices"]["results"]
        assert (written["pool"], written["device"], written["shareID"]) == (
            result["pool"], result["device"], result["shareID"])
        [ready] = written["conditions"]
        assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
        data = written["data"]
        assert (data["memory"], data["cores"], data["computeShare"]) == ("12Gi", "10", "25%")
        assert data["gpu"] == env["GPUPPETTI_VISIBLE_DEVICES"]
        assert data["enforcedBy"] == env.get("GPUPPETTI_ENFORCED_BY"), "what the container was told"

        node.delete("pod", "holder")
        wait_for("the driver's entry gone after Unprepare", lambda: entry() is None, 60)
        # A claim deleted before its entry was written is said at info, and rightly not retried: no other write failed.
        failed = [line for line in daemon.log().splitlines()
                  if "the status of ResourceClaim" in line and "the claim is gone or replaced" not in line]
        assert not failed, failed
    finally:
        node.delete("pod", "token-anchor", "-n", "gpuppetti", "--grace-period=0", "--force")


@pytest.mark.parametrize(("slicing", "extra", "sharing", "memory"), [
    ("whole", "", "time-slicing", 48),
    ("consumable", "", "consumable", 12),
    ("partitions", "", "partition", 12),
    ("partitions", "  partitionLayout: counters\n", "partition", 12),
    ("partitions", "  defaultPartition: 1\n", "time-slicing", 48),
], ids=["whole", "consumable", "partitions", "partitions-counters", "partitions-default-whole"])
def test_extended_resource_bridge_serves_a_plain_limit_whatever_the_slicing(
        node: RealNode, workdir: Path, classes: None, slicing: str, extra: str, sharing: str, memory: int) -> None:
    """One pod spec, `apple.com/gpu: 1` in its limits, as on a device plugin's node: a whole GPU, a consumable
    share of 1/shares, or the default partition (dra.defaultPartition: the smallest unless chosen)."""
    start(node, workdir, config(slicing, extra=extra))
    node.apply([pod("bridged", limits={"apple.com/gpu": 1})])
    node.wait_running("bridged")
    env = node.env_of("bridged")
    assert env["GPUPPETTI_VISIBLE_DEVICES"] in ("sim-apple-0", "sim-apple-1")
    assert (env["GPUPPETTI_SHARING"], env["GPUPPETTI_MEMORY"]) == (sharing, str(memory * 2**30))
    # The claim the scheduler made for the limit says the same in its status (docs/dra.md's commands).
    claim = node.kubectl("get", "pod", "bridged", "-o",
                         "jsonpath={.status.extendedResourceClaimStatus.resourceClaimName}").strip()

    def data() -> dict[str, str] | None:
        entries = node.get("resourceclaims", claim)["status"].get("devices") or []
        return entries[0]["data"] if entries else None

    assert wait_for(f"ResourceClaim {claim}'s status", data, 30)["memory"] == f"{memory}Gi"


def test_device_classes_follow_the_vendor(node: RealNode, workdir: Path, classes: None) -> None:
    mixed = ("    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi}\n"
             "    - {model: A100, vendor: nvidia, cores: 108, memory: 80Gi}\n")
    start(node, workdir, config("whole", mixed))
    node.apply([pod("wants-apple", limits={"apple.com/gpu": 1}), pod("wants-nvidia", limits={"nvidia.com/gpu": 1})])
    node.wait_running("wants-apple", "wants-nvidia")
    assert node.env_of("wants-apple")["GPUPPETTI_VISIBLE_DEVICES"] == "sim-apple-0"
    assert node.env_of("wants-nvidia")["GPUPPETTI_VISIBLE_DEVICES"] == "sim-nvidia-0"
    node.apply([template("any-apple", klass=f"apple.{DRIVER}")])
    node.apply([claim_pod("by-class", "any-apple")])
    wait_for("by-class unschedulable: the only Apple GPU is taken", lambda: pending(node, "by-class"))


def test_strategies_that_cannot_be_honoured_are_refused(node: RealNode, workdir: Path, classes: None) -> None:
    start(node, workdir, config("consumable"))
    node.apply([template("exclusive-share", {"cores": "1"}, config={"sharing": {"strategy": "Exclusive"}}),
                template("mps-on-apple", {"cores": "1"}, config={"sharing": {"strategy": "MPS"}})])
    node.apply([claim_pod("exclusive", "exclusive-share"), claim_pod("mps", "mps-on-apple")])
    for name, words in (("exclusive", ("Exclusive", "gpu-apple-", "shares")), ("mps", ("MPS", "gpu-apple-", "NVIDIA"))):
        def refused(name: str = name) -> str | None:
            events = node.events(name)
            return events if "FailedPrepareDynamicResources" in events else None
        events = wait_for(f"{name}: preparation refused in the pod's events", refused, 90)
        assert all(word in events for word in words), events
        assert node.phase(name) == "Pending"


def test_own_writes_and_deletes_raise_no_false_alarm(node: RealNode, workdir: Path, classes: None) -> None:
    # The counters layout: its whole-GPU devices, and more devices than whole GPUs alone.
    daemon = start(node, workdir, config("partitions", extra="  partitionLayout: counters\n"))
    node.apply([claim_pod("a", "whole-gpu"), claim_pod("b", "whole-gpu")])
    node.wait_running("a", "b")
    node.delete("pod", "a")
    wait_for("one spec left", lambda: len(specs()) == 1)
    # Fewer devices: the surplus slice is the driver's own to delete.
    reload(daemon, workdir, config("whole"))
    wait_for("whole-GPU slices", lambda: set(devices(node)) == {"gpu-apple-0", "gpu-apple-1"})
    log = daemon.log()
    assert "CDI specs were removed" not in log, log[-3000:]
    assert "was deleted; publishing it again" not in log, log[-3000:]


def test_slices_are_published_only_once_the_kubelet_registered_the_driver(
        node: RealNode, workdir: Path, classes: None) -> None:
    node.delete("resourceslices", "--all")
    daemon = start(node, workdir, config("whole"), ready=False)
    wait_for("slices", lambda: len(devices(node)) == 2, 60, 0.05)
    log = daemon.log()
    registered = log.find("registered with the kubelet as DRA driver")
    published = log.find("published pool")
    assert 0 <= registered < published, log[-3000:]
