"""The device plugin against the real kubelet, API server and scheduler: asserted through the API and the pods."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path

import yaml

from tests.cluster.realnode import BUSYBOX, CDI_DIR, Daemon, RealNode, clean_cdi, pod, wait_for, write_config
from tests.helpers import fenced_blocks

APPLE = "apple.com/gpu"


def config(policy: str = "distributed", health: tuple[str, str] = ("Healthy", "Healthy"), extra: str = "") -> str:
    gpus = "\n".join(
        f"    - {{model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, health: {h}}}" for h in health)
    return (f"version: v1\nbackend: simulated\nsimulated:\n  gpus:\n{gpus}\n"
            f"sharing:\n  timeSlicing:\n    resources: [{{name: {APPLE}, replicas: 4}}]\n"
            f"plugin:\n  allocationPolicy: {policy}\n{extra}")


def start(node: RealNode, workdir: Path, text: str, name: str = "gpuppetti-plugin", ready: bool = True) -> Daemon:
    path = write_config(workdir, f"{name}.yaml", text)
    daemon = node.gpuppetti(name, "plugin", "--config", str(path), "--http-address", "127.0.0.1:0")
    if ready:
        daemon.wait_ready()
    return daemon


def reload(daemon: Daemon, workdir: Path, text: str) -> None:
    write_config(workdir, f"{daemon.name}.yaml", text)
    mark = len(daemon.log())
    daemon.signal(signal.SIGHUP)
    daemon.wait_log("config reloaded", after=mark)


def slices_of(node: RealNode, name: str) -> list[str]:
    return node.env_of(name)["GPUPPETTI_SLICES"].split(",")


def gpus_of(node: RealNode, name: str) -> set[str]:
    return {unit.split("::")[0] for unit in slices_of(node, name)}


def test_capacity_pods_and_their_env(node: RealNode, workdir: Path) -> None:
    start(node, workdir, config())
    node.wait_allocatable(APPLE, 8)
    assert node.node_status()["capacity"][APPLE] == "8"
    node.apply([pod("one", limits={APPLE: 1}), pod("two", limits={APPLE: 2})])
    node.wait_running("one", "two")
    one, two = node.env_of("one"), node.env_of("two")
    assert re.fullmatch(r"sim-apple-[01]::[0-3]", one["GPUPPETTI_SLICES"])
    assert one["GPUPPETTI_SHARING"] == "time-slicing"
    assert one["GPUPPETTI_REPLICAS"] == "4"
    assert one["GPUPPETTI_VISIBLE_DEVICES"] == one["GPUPPETTI_SLICES"].split("::")[0]
    assert len(two["GPUPPETTI_SLICES"].split(",")) == 2
    taken = set(slices_of(node, "one")) | set(slices_of(node, "two"))
    assert len(taken) == 3, "no slice is handed out twice"


def test_distributed_and_packed_policies(node: RealNode, workdir: Path) -> None:
    daemon = start(node, workdir, config("distributed"))
    node.wait_allocatable(APPLE, 8)
    node.apply([pod("spread", limits={APPLE: 2})])
    node.wait_running("spread")
    assert gpus_of(node, "spread") == {"sim-apple-0", "sim-apple-1"}, "distributed: one slice on each GPU"
    node.delete("pod", "spread", "--grace-period=0", "--force")
    reload(daemon, workdir, config("packed"))
    node.apply([pod("packed", limits={APPLE: 2})])
    node.wait_running("packed")
    assert len(gpus_of(node, "packed")) == 1, "packed: both slices on one GPU"


def test_kubelet_restart_keeps_allocatable_and_running_pods(node: RealNode, workdir: Path) -> None:
    daemon = start(node, workdir, config())
    node.wait_allocatable(APPLE, 8)
    node.apply([pod("survivor", limits={APPLE: 1})])
    node.wait_running("survivor")
    before = node.pod("survivor")["status"]["containerStatuses"][0]["containerID"]
    registrations = daemon.log().count("registered with the kubelet")
    node.ctl("restart", "kubelet")
    wait_for("the plugin to register again", lambda: daemon.log().count("registered with the kubelet") > registrations)
    node.wait_allocatable(APPLE, 8)
    status = node.pod("survivor")["status"]
    assert status["phase"] == "Running"
    assert status["containerStatuses"][0]["containerID"] == before
    assert status["containerStatuses"][0]["restartCount"] == 0


def test_killed_plugin_drops_allocatable_and_a_new_one_brings_it_back(node: RealNode, workdir: Path) -> None:
    daemon = start(node, workdir, config())
    node.wait_allocatable(APPLE, 8)
    daemon.kill9()
    node.wait_allocatable(APPLE, 0)
    daemon.start()
    daemon.wait_ready()
    node.wait_allocatable(APPLE, 8)


def test_unhealthy_gpu_lowers_allocatable_and_shows_in_the_pod(node: RealNode, workdir: Path) -> None:
    daemon = start(node, workdir, config())
    node.wait_allocatable(APPLE, 8)
    node.apply([pod("patient", limits={APPLE: 1})])
    node.wait_running("patient")
    [unit] = slices_of(node, "patient")
    gpu = unit.split("::")[0]
    health = ("Unhealthy", "Healthy") if gpu == "sim-apple-0" else ("Healthy", "Unhealthy")
    reload(daemon, workdir, config(health=health))
    node.wait_allocatable(APPLE, 4)

    def reported() -> dict[str, str] | None:
        statuses = node.pod("patient")["status"]["containerStatuses"][0].get("allocatedResourcesStatus") or []
        found = {r["resourceID"]: r.get("health", "") for s in statuses if s["name"] == APPLE
                 for r in s.get("resources", [])}
        return found if found.get(unit) == "Unhealthy" else None

    wait_for(f"{unit} Unhealthy in the pod's allocatedResourcesStatus", reported)


def test_fail_requests_greater_than_one_refuses_with_its_message(node: RealNode, workdir: Path) -> None:
    start(node, workdir, config().replace("timeSlicing:\n", "timeSlicing:\n    failRequestsGreaterThanOne: true\n"))
    node.wait_allocatable(APPLE, 8)
    node.apply([pod("greedy", limits={APPLE: 2})])

    def failed() -> str | None:
        status = node.pod("greedy")["status"]
        return str(status.get("message", "")) if status.get("phase") == "Failed" else None

    message = wait_for("pod greedy to fail admission", failed)
    assert "failRequestsGreaterThanOne" in message, message
    assert node.pod("greedy")["status"]["reason"] == "UnexpectedAdmissionError"


def test_cdi_device_list_strategies_reach_the_container(node: RealNode, workdir: Path) -> None:
    for strategy in ("cdi-cri", "cdi-annotations"):
        clean_cdi("gpu.gpuppetti.dev-gpu")
        daemon = start(node, workdir, config(extra=f"  deviceListStrategy: {strategy}\n"))
        node.wait_allocatable(APPLE, 8)
        assert (CDI_DIR / "gpu.gpuppetti.dev-gpu.json").exists()
        name = f"cdi-{strategy}"
        node.apply([pod(name, limits={APPLE: 1})])
        node.wait_running(name)
        env = node.env_of(name)
        [unit] = env["GPUPPETTI_SLICES"].split(",")
        gpu = unit.split("::")[0]
        # The marker exists only in the CDI spec: the runtime applied it.
        assert env[f"GPUPPETTI_CDI_{gpu.upper().replace('-', '_')}"] == gpu, (strategy, env)
        node.delete("pod", name, "--grace-period=0", "--force")
        daemon.stop()
        node.wait_allocatable(APPLE, 0)


def test_a_node_without_gpus_keeps_the_plugin_up_serving_nothing(node: RealNode, workdir: Path) -> None:
    daemon = start(node, workdir, "version: v1\nbackend: simulated\n", ready=False)
    url = daemon.http_url()
    with urllib.request.urlopen(url + "/healthz", timeout=5) as answer:
        body = answer.read().decode()
    assert "no GPUs" in body, body
    assert daemon.alive()
    with urllib.request.urlopen(url + "/v1/gpus", timeout=5) as answer:
        assert json.loads(answer.read()) == []


def test_http_endpoint_on_ipv6(node: RealNode, workdir: Path) -> None:
    path = write_config(workdir, "v6.yaml", config())
    daemon = node.gpuppetti("gpuppetti-plugin", "plugin", "--config", str(path), "--http-address", "[::1]:0")
    daemon.wait_ready()
    assert daemon.http_url().startswith("http://[::1]:")


def test_node_labels_go_when_the_plugin_stops(node: RealNode, workdir: Path) -> None:
    path = write_config(workdir, "labels.yaml", config())
    daemon = node.gpuppetti("gpuppetti-plugin", "plugin", "--config", str(path), "--http-address", "127.0.0.1:0",
                            "--label-node", "--node-name", node.name, "--kubeconfig", str(node.kubeconfig))
    daemon.wait_ready()

    def labels() -> dict[str, str]:
        return {k: v for k, v in node.get("node", node.name)["metadata"].get("labels", {}).items()
                if k.startswith("gpuppetti.dev/gpu.")}

    found = wait_for("gpu labels", lambda: labels() or None)
    assert found["gpuppetti.dev/gpu.vendor"] == "apple"
    daemon.stop()
    assert labels() == {}, "the plugin removes its labels when it stops"


def _fenced_blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in fenced_blocks(path.read_text()) if lang == language]


def test_the_demo_pod_prints_what_its_guide_says(node: RealNode, workdir: Path) -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    # The kind guide's config, as a user copies it.
    kind_config = next(block for block in _fenced_blocks(docs / "kind.md", "yaml") if "simulated:" in block)
    start(node, workdir, kind_config)
    node.wait_allocatable(APPLE, 8)
    example = yaml.safe_load((docs.parent / "deploy/examples/slice-demo-pod.yaml").read_text())
    # The one change: no registry is reachable here, so the same busybox comes from the node's own images.
    example["spec"]["containers"][0].update(image=BUSYBOX, imagePullPolicy="Never")
    node.apply([example])
    wait_for("slice-demo Succeeded", lambda: node.phase("slice-demo") == "Succeeded", 90)
    expected = _fenced_blocks(docs / "demo-pod.md", "")[0]
    assert node.logs("slice-demo") == expected
