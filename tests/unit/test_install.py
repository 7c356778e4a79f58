"""`gpuppetti install` and `uninstall` without a cluster: what the cluster is from its nodes' facts, the commands each
kind of cluster gets its image with (run against fake `minikube`, `kind`, `docker`, `podman` and `k3s` on PATH that
record their arguments), what is applied, and one line for each thing a user can get wrong.

Installing for real, in both modes, is tests/cluster/test_install.py's."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gpuppetti.commands import install, manifests
from gpuppetti.commands.install import InstallError, applying, image, smoke, waiting
from gpuppetti.commands.install.cluster import Cluster, detect
from tests.helpers import run_cli
from tests.standins.apiserver import ApiStandIn

REPO = Path(__file__).resolve().parents[2]


def node(name: str, labels: dict[str, str] | None = None, provider: str = "",
         kubelet: str = "v1.36.2") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"providerID": provider} if provider else {},
            "status": {"nodeInfo": {
                "kubeletVersion": kubelet, "architecture": "arm64", "bootID": "b", "containerRuntimeVersion": "c",
                "kernelVersion": "6.1", "kubeProxyVersion": "", "machineID": "m", "operatingSystem": "linux",
                "osImage": "Debian", "systemUUID": "u"}}}


def minikube_home(tmp_path: Path, profile: str, driver: str) -> Path:
    home = tmp_path / ".minikube"
    (home / "profiles" / profile).mkdir(parents=True)
    (home / "profiles" / profile / "config.json").write_text(json.dumps({"Name": profile, "Driver": driver}))
    return home


# -- detection ------------------------------------------------------------------------------------------------

def test_minikube_is_known_by_its_node_label_and_its_driver_by_the_profile(tmp_path: Path) -> None:
    home = minikube_home(tmp_path, "gpus", "krunkit")
    nodes = [node("gpus", {"minikube.k8s.io/name": "gpus", "kubernetes.io/arch": "arm64"})]
    cluster = detect("gpus", "https://192.168.105.2:8443", nodes, home)
    assert cluster == Cluster("minikube", "gpus", ("gpus",), "krunkit", local=False)
    assert cluster.describe() == "minikube profile gpus (driver krunkit), 1 node: gpus"
    # A profile whose config cannot be read still is minikube, with its driver unknown.
    assert detect("other", "https://x:8443", [node("m", {"minikube.k8s.io/name": "other"})],
                  home).driver is None


def test_kind_by_its_provider_id_k3s_by_its_kubelet_and_any_other_node() -> None:
    home = Path("/nonexistent")
    kind = detect("kind-gp", "https://127.0.0.1:40123", [
        node("gp-control-plane", provider="kind://docker/gp/gp-control-plane"), node("gp-worker")], home)
    assert (kind.kind, kind.name, kind.nodes, kind.local) == ("kind", "gp", ("gp-control-plane", "gp-worker"), True)
    k3s = detect("default", "https://127.0.0.1:6443", [node("box", kubelet="v1.33.4+k3s1")], home)
    assert (k3s.kind, k3s.local) == ("k3s", True)
    labelled = detect("default", "https://10.0.0.5:6443",
                      [node("box", {"node.kubernetes.io/instance-type": "k3s"})], home)
    assert (labelled.kind, labelled.local) == ("k3s", False)
    plain = detect("prod", "https://api.example:6443", [node("gpu-1")], home)
    assert plain.kind == "node"


# -- the image, per cluster ------------------------------------------------------------------------------------

def fake_tools(directory: Path, record: Path, *names: str) -> dict[str, str]:
    """Executables ``names`` in ``directory`` that append their name and arguments to ``record``; PATH with only
    them and the system's own tools."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        tool = directory / name
        tool.write_text(f'#!/bin/sh\nprintf "%s" "{name}" >> "{record}"\n'
                        f'for a in "$@"; do printf " %s" "$a" >> "{record}"; done\necho >> "{record}"\n')
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{directory}:/usr/bin:/bin"}


def recorded(record: Path) -> list[str]:
    return record.read_text().splitlines() if record.exists() else []


async def run_plan(plan: image.ImagePlan, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", path)
    await image.run_steps(plan.steps, lambda line: None)


MINIKUBE = Cluster("minikube", "gpus", ("gpus",), "krunkit")
KIND = Cluster("kind", "gp", ("gp-control-plane",))


async def test_minikube_builds_the_image_inside_its_vm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "calls"
    env = fake_tools(tmp_path / "bin", record, "minikube")
    plan = image.image_plan(MINIKUBE, None, REPO, None, tmp_path, root=False)
    assert (plan.image, plan.loaded) == (manifests.DEFAULT_IMAGE, True)
    await run_plan(plan, env["PATH"], monkeypatch)
    assert recorded(record) == [f"minikube -p gpus image build -t localhost/gpuppetti:dev {REPO}"]


async def test_kind_loads_what_docker_or_podman_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "calls"
    env = fake_tools(tmp_path / "bin", record, "kind", "docker", "podman")
    plan = image.image_plan(KIND, "localhost/gp:1", REPO, "docker", tmp_path, root=False)
    await run_plan(plan, env["PATH"], monkeypatch)
    assert recorded(record) == [f"docker build -t localhost/gp:1 {REPO}",
                                "kind load docker-image localhost/gp:1 --name gp"]
    record.unlink()
    plan = image.image_plan(KIND, None, REPO, "podman", tmp_path, root=False)
    await run_plan(plan, env["PATH"], monkeypatch)
    archive = tmp_path / "gpuppetti-image.tar"
    assert recorded(record) == [f"podman build -t localhost/gpuppetti:dev {REPO}",
                                f"podman save -o {archive} localhost/gpuppetti:dev",
                                f"kind load image-archive {archive} --name gp"]


async def test_k3s_imports_into_its_containerd_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "calls"
    env = fake_tools(tmp_path / "bin", record, "k3s", "podman", "sudo")
    k3s = Cluster("k3s", "", ("box",), local=True)
    archive = tmp_path / "gpuppetti-image.tar"
    await run_plan(image.image_plan(k3s, None, REPO, "podman", tmp_path, root=True), env["PATH"], monkeypatch)
    assert recorded(record)[-1] == f"k3s ctr images import {archive}"
    record.unlink()
    await run_plan(image.image_plan(k3s, None, REPO, "podman", tmp_path, root=False), env["PATH"], monkeypatch)
    assert recorded(record)[-1] == f"sudo k3s ctr images import {archive}"
    with pytest.raises(InstallError, match="k3s's containerd is on its node") as remote:
        image.image_plan(Cluster("k3s", "", ("box",), local=False), None, REPO, "podman", tmp_path, root=True)
    assert remote.value.bad_input


def test_a_registry_image_is_pulled_and_other_nodes_need_one(tmp_path: Path) -> None:
    plan = image.image_plan(Cluster("node", "", ("n",)), "registry.example/gpuppetti:1.0", None, None, tmp_path,
                            root=True)
    assert (plan.steps, plan.loaded) == ((), False)
    with pytest.raises(InstallError, match="not minikube, kind or k3s: its nodes pull"):
        image.image_plan(Cluster("node", "", ("n",)), None, REPO, "docker", tmp_path, root=True)
    with pytest.raises(InstallError, match="no image to run: give --image REF"):
        image.image_plan(MINIKUBE, None, None, None, tmp_path, root=True)
    with pytest.raises(InstallError, match="needs docker or podman"):
        image.image_plan(KIND, None, REPO, None, tmp_path, root=True)
    with pytest.raises(InstallError, match="no Dockerfile there"):
        image.image_plan(MINIKUBE, None, tmp_path, None, tmp_path, root=True)


async def test_a_missing_tool_is_the_users_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    plan = image.image_plan(MINIKUBE, None, REPO, None, tmp_path, root=True)
    with pytest.raises(InstallError) as missing:
        await image.run_steps(plan.steps, lambda line: None)
    assert str(missing.value) == ("minikube is not on PATH: install it, or give --image REF that the nodes can "
                                  "pull")
    assert missing.value.bad_input


async def test_a_failing_tool_is_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "minikube").write_text("#!/bin/sh\nexit 3\n")
    (tmp_path / "minikube").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    plan = image.image_plan(MINIKUBE, None, REPO, None, tmp_path, root=True)
    with pytest.raises(InstallError, match=r"failed \(exit 3\)") as failed:
        await image.run_steps(plan.steps, lambda line: None)
    assert not failed.value.bad_input


# -- what is applied -------------------------------------------------------------------------------------------

def test_the_cluster_chooses_the_config() -> None:
    settings = install.Settings(kubeconfig=None, context=None)
    config, source = applying.choose_config(MINIKUBE, settings)
    assert config == manifests.preset_config("minikube-krunkit", None) and source == "the minikube-krunkit preset"
    assert applying.choose_config(Cluster("node", "", ("n",)), settings)[0] is None
    with pytest.raises(InstallError, match="kind's nodes have no GPUs: give --config"):
        applying.choose_config(KIND, settings)
    given = install.Settings(kubeconfig=None, context=None, config="version: v1\n", config_source="sim.yaml")
    assert applying.choose_config(KIND, given) == ("version: v1\n", "sim.yaml")


def test_the_objects_are_gpuppetti_manifests_own() -> None:
    settings = install.Settings(kubeconfig=None, context=None, mode="dra")
    objects = applying.render(settings, None, "localhost/gpuppetti:dev", True, "https://127.0.0.1:16443")
    expected = manifests.render(manifests.Options(mode="dra", image_pull_policy="IfNotPresent"))
    assert objects == expected
    on_host = applying.render(install.Settings(kubeconfig=None, context=None, mode="dra", host_network=True),
                              None, "r/g:1", False, "https://127.0.0.1:16443")
    [daemonset] = [obj for obj in on_host if obj["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert "imagePullPolicy" not in spec["containers"][0]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", "16443")


def test_uninstall_knows_every_object_of_both_modes() -> None:
    objects = applying.all_objects("gpuppetti")
    names = {(obj["kind"], obj["metadata"]["name"]) for obj in objects}
    for mode in ("plugin", "dra"):
        for obj in manifests.render(manifests.Options(mode=mode, label_node=True)):
            assert (obj["kind"], obj["metadata"]["name"]) in names
    assert [obj["kind"] for obj in objects[:2]] == ["DaemonSet", "DaemonSet"]
    assert objects[-1]["kind"] == "Namespace"


def test_the_smoke_pod_asks_for_one_slice() -> None:
    plugin = smoke.smoke_objects(install.Settings(kubeconfig=None, context=None), "apple.com/gpu", "busybox:1.36")
    [pod] = plugin
    assert pod["spec"]["containers"][0]["resources"] == {"limits": {"apple.com/gpu": 1}}
    assert smoke.VKINFO in pod["spec"]["containers"][0]["command"][2]
    template, pod = smoke.smoke_objects(install.Settings(kubeconfig=None, context=None, mode="dra"), None, "i")
    assert template["kind"] == "ResourceClaimTemplate"
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": smoke.SMOKE_POD}]


def test_what_serves_is_read_from_the_node_and_the_slices() -> None:
    node_status = {"status": {"allocatable": {"cpu": "2", "memory": "1Gi", "hugepages-2Mi": "0", "pods": "110",
                                              "apple.com/gpu": "4", "amd.com/gpu": "0", "example.com/fpga": "2",
                                              "example.com/gpu": "8", "nvidia.com/gpu.shared": "2"}}}
    names = waiting.served_names(None)
    assert waiting.extended_resources(node_status, names) == {"apple.com/gpu": 4, "nvidia.com/gpu.shared": 2}
    renamed = waiting.served_names("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                                   "      - {name: apple.com/gpu, replicas: 2, rename: example.com/gpu}\n")
    assert waiting.extended_resources(node_status, renamed)["example.com/gpu"] == 8
    ready = {"spec": {"nodeName": "a"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    starting = {"spec": {"nodeName": "b"}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    assert waiting.ready_nodes([ready, starting, {"spec": {"nodeName": "c"}}]) == {"a"}
    slices: list[dict[str, Any]] = [{"spec": {"nodeName": "a", "devices": [{"name": "gpu-0"}, {"name": "gpu-1"}]}},
              {"spec": {"nodeName": "b", "devices": []}}, {"spec": {"nodeName": "c", "devices": [{}]}}]
    assert waiting.slice_devices(slices, ["a", "b"]) == {"a": 2}


def test_a_daemon_that_finds_no_gpus_is_one_line() -> None:
    pod = {"spec": {"nodeName": "box"}, "status": {"phase": "Running"}}
    log = ("2026-01-01 10:00:00,000 WARNING gpuppetti.node.daemon: no GPUs found; looked at:\n"
           "  drm: /host/sys/class/drm: no render nodes\n  nvml: libnvidia-ml.so.1 not found\n"
           "serving nothing until a GPU appears\n")
    assert waiting.daemon_problem(pod, log) == ("the daemon on node box found no GPUs (looked at: drm: "
                                                "/host/sys/class/drm: no render nodes; nvml: libnvidia-ml.so.1 "
                                                "not found)")
    assert waiting.daemon_problem(pod, "registered\n") is None
    pulling = {"spec": {"nodeName": "box"}, "status": {"containerStatuses": [
        {"image": "localhost/gpuppetti:dev", "state": {"waiting": {"reason": "ErrImageNeverPull",
                                                                   "message": "not present"}}}]}}
    assert waiting.daemon_problem(pulling, None) == ("node box cannot get the image localhost/gpuppetti:dev: "
                                                     "ErrImageNeverPull: not present")


# -- the command, against the API stand-in ----------------------------------------------------------------------

@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[ApiStandIn, Path]]:
    standin = ApiStandIn()
    await standin.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(standin.kubeconfig())
    yield standin, kubeconfig
    await standin.stop()


def one_line(result: Any) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return str(lines[0])


async def test_on_minikube_without_minikube_the_command_says_so(
        api: tuple[ApiStandIn, Path], tmp_path: Path) -> None:
    standin, kubeconfig = api
    await standin.create("nodes", node("gpus", {"minikube.k8s.io/name": "gpus"}))
    home = minikube_home(tmp_path, "gpus", "krunkit")
    env = {"PATH": f"{tmp_path / 'empty'}:/usr/bin:/bin", "MINIKUBE_HOME": str(home), "HOME": str(tmp_path)}
    result = await asyncio.to_thread(run_cli, "install", "--kubeconfig", str(kubeconfig), "--build", str(REPO),
                                     env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert one_line(result) == ("gpuppetti: minikube is not on PATH: install it, or give --image REF that the nodes "
                                "can pull")
    assert "minikube profile gpus (driver krunkit), 1 node: gpus" in result.stdout


async def test_on_minikube_the_image_is_built_by_minikube_before_anything_is_applied(
        api: tuple[ApiStandIn, Path], tmp_path: Path) -> None:
    standin, kubeconfig = api
    await standin.create("nodes", node("gpus", {"minikube.k8s.io/name": "gpus"}))
    record = tmp_path / "calls"
    env = fake_tools(tmp_path / "bin", record, "minikube")
    env |= {"MINIKUBE_HOME": str(minikube_home(tmp_path, "gpus", "krunkit")), "HOME": str(tmp_path)}
    result = await asyncio.to_thread(run_cli, "install", "--kubeconfig", str(kubeconfig), "--build", str(REPO),
                                     env=env)
    assert recorded(record) == [f"minikube -p gpus image build -t localhost/gpuppetti:dev {REPO}"]
    assert result.stdout.index("2. getting the image") < result.stdout.index("3. applying")
    # The stand-in takes no server-side apply: the first object it refuses ends the command, in one line.
    assert result.returncode == 1
    assert one_line(result).startswith("gpuppetti: applying Namespace gpuppetti: 404"), result.stderr


async def test_on_kind_without_a_config_the_command_says_to_give_one(api: tuple[ApiStandIn, Path]) -> None:
    standin, kubeconfig = api
    await standin.create("nodes", node("gp-control-plane", provider="kind://docker/gp/gp-control-plane"))
    result = await asyncio.to_thread(run_cli, "install", "--kubeconfig", str(kubeconfig), "--image", "r/g:1")
    assert result.returncode == 2
    assert one_line(result) == ("gpuppetti: kind's nodes have no GPUs: give --config with simulated GPUs (see "
                                "docs/kind.md)")


async def test_an_unknown_node_or_context_is_one_line(api: tuple[ApiStandIn, Path]) -> None:
    standin, kubeconfig = api
    await standin.create("nodes", node("a"))
    result = await asyncio.to_thread(run_cli, "install", "--kubeconfig", str(kubeconfig), "--image", "r/g:1",
                                     "--node", "b")
    assert result.returncode == 2
    assert one_line(result) == "gpuppetti: --node b: the cluster has no such node (it has a)"
    result = await asyncio.to_thread(run_cli, "uninstall", "--kubeconfig", str(kubeconfig), "--context", "prod")
    assert result.returncode == 2
    assert one_line(result).startswith(f"gpuppetti: kubeconfig {kubeconfig}: ")
    assert "prod" in result.stderr


def test_no_kubeconfig_is_one_line(tmp_path: Path) -> None:
    result = run_cli("install", "--image", "r/g:1", env={"HOME": str(tmp_path)})
    assert result.returncode == 2
    assert one_line(result) == ("gpuppetti: no kubeconfig: ~/.kube/config does not exist (start a cluster, or give "
                                "--kubeconfig)")
    result = run_cli("uninstall", env={"KUBECONFIG": str(tmp_path / "missing")})
    assert result.returncode == 2
    assert one_line(result).startswith("gpuppetti: KUBECONFIG=")


def test_an_unreachable_cluster_is_one_line(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": "https://127.0.0.1:9"}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "gone"}}],
        "users": [{"name": "gone", "user": {}}]}))
    for command in ("install", "uninstall"):
        result = run_cli(command, "--kubeconfig", str(kubeconfig), "--timeout", "5", env={"HOME": str(tmp_path)})
        assert result.returncode == 1, result.stderr
        assert one_line(result).startswith("gpuppetti: cannot reach the cluster of context gone at "
                                           "https://127.0.0.1:9: listing Nodes: "), result.stderr


def test_bad_flags_are_one_line(tmp_path: Path) -> None:
    result = run_cli("install", "--mode", "dra", "--replicas", "4", env={"HOME": str(tmp_path)})
    assert result.returncode == 2
    assert "--replicas is for the device plugin" in one_line(result)


def test_the_smoke_script_says_why_it_cannot_show_the_slice(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "GPUPPETTI_LIMITS": "cooperative", "OTHER": "x"}
    script = smoke.SMOKE_SCRIPT.replace(smoke.VKINFO, str(tmp_path / "gpuppetti-vkinfo"))
    out = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["GPUPPETTI_LIMITS=cooperative", "--- gpuppetti-vkinfo",
                                "gpuppetti-vkinfo is not mounted: this slice is not held by the layer (a whole GPU, "
                                "or enforcement off: see GPUPPETTI_LIMITS)"]
    (tmp_path / "gpuppetti-vkinfo").write_text("#!/bin/sh\necho 'heap 0: 512 MiB'\n")
    (tmp_path / "gpuppetti-vkinfo").chmod(0o755)
    out = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "heap 0: 512 MiB"
