"""deploy/ and `gpuppetti manifests`: they agree, kustomize renders them, and every object validates."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpuppetti.commands import manifests
from gpuppetti.core.config import DraSection, parse_config
from gpuppetti.dra import opaque
from tests.helpers import run_here

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
VERSIONS = ("1.34", "1.35", "1.36")
KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
sys.path.insert(0, str(ROOT / "tools"))
import gen_deploy  # noqa: E402

kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                             reason="kubectl is not installed, so `kubectl kustomize` cannot render deploy/")


def _validate(objects: list[dict[str, Any]]) -> None:
    assert objects
    for obj in objects:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=False,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return [o for o in yaml.safe_load_all(result.stdout) if o]


def _cli(*args: str) -> list[dict[str, Any]]:
    result = run_here("manifests", *args)
    assert result.returncode == 0, result.stderr
    return [o for o in yaml.safe_load_all(result.stdout) if o]


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def _same(left: list[dict[str, Any]], right: list[dict[str, Any]]) -> None:
    assert sorted(left, key=_key) == sorted(right, key=_key)


def test_bases_are_rendered_from_the_generator() -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in gen_deploy.rendered().items() if p.read_text() != text]
    assert not stale, f"run `make deploy`: {stale}"


@kubectl
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomize_renders_and_every_object_validates(directory: Path) -> None:
    _validate(_kustomize(directory))


@kubectl
@pytest.mark.parametrize(("directory", "args"), [
    ("base/plugin", ["--mode", "plugin"]),
    # The old name of base/plugin, kept for kustomizations that point at it.
    ("base/deviceplugin", ["--mode", "plugin"]),
    ("base/dra", ["--mode", "dra"]),
    ("overlays/minikube-krunkit", ["--mode", "plugin", "--preset", "minikube-krunkit"]),
])
def test_manifests_match_what_deploy_renders(directory: str, args: list[str]) -> None:
    _same(_cli(*args), _kustomize(DEPLOY / directory))


@pytest.mark.parametrize("args", [
    ["--mode", "plugin", "--replicas", "8", "--image", "registry.local/gpuppetti:dev", "--namespace", "gpus"],
    ["--mode", "dra", "--namespace", "gpus"],
    ["--preset", "minikube-krunkit", "--replicas", "2"],
])
def test_manifests_output_validates(args: list[str]) -> None:
    objects = _cli(*args)
    _validate(objects)
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap"]
    parse_config(config_map["data"]["config.yaml"], "configmap")
    [daemonset] = [o for o in objects if o["kind"] == "DaemonSet"]
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    if "--image" in args:
        assert container["image"] == "registry.local/gpuppetti:dev"
    if "--namespace" in args:
        assert {o["metadata"].get("namespace") for o in objects if "namespace" in o["metadata"]} == {"gpus"}


def test_replicas_apply_to_every_vendor() -> None:
    [config_map] = [o for o in _cli("--replicas", "3") if o["kind"] == "ConfigMap"]
    config = parse_config(config_map["data"]["config.yaml"], "configmap")
    resources = config.sharing.time_slicing.resources
    assert {r.name for r in resources} == set(manifests.ALL_RESOURCES)
    assert {r.replicas for r in resources} == {3}


def test_minikube_preset_serves_the_virtio_gpu_as_apple_with_4_replicas() -> None:
    config = parse_config(manifests.preset_config("minikube-krunkit", None), "preset")
    assert (config.backend, config.virtio.vendor) == ("drm", "apple")
    [resource] = config.sharing.time_slicing.resources
    assert (resource.name, resource.replicas) == ("apple.com/gpu", 4)


def test_daemonset_security_and_mounts() -> None:
    plugin = manifests.device_plugin(manifests.Options())[0]
    spec = plugin["spec"]["template"]["spec"]
    [container] = spec["containers"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]}
    assert mounts == {"/etc/gpuppetti": True, "/var/lib/kubelet/device-plugins": False, "/host": True,
                      "/var/run/cdi": False, "/var/run/secrets/gpuppetti-host-agent": True,
                      "/var/lib/gpuppetti/vulkan": False}
    [host] = [v for v in spec["volumes"] if v["name"] == "host-root"]
    assert host["hostPath"]["path"] == "/", "/proc and the NVML library come from the host too"
    [secret] = [v for v in spec["volumes"] if "secret" in v]
    assert secret["secret"] == {"secretName": "gpuppetti-host-agent", "optional": True}
    assert "serviceAccountName" not in spec, "without --label-node the plugin needs no API access"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUPPETTI_HTTP_ADDRESS"] == ":9400", "every address of the pod: IPv4, IPv6 and 127.0.0.1"
    # Settings as env, not flags: a command run in the pod (doctor, discover) sees what the daemon sees.
    assert (container["args"], env["GPUPPETTI_CONFIG"], env["GPUPPETTI_HOST_ROOT"], env["GPUPPETTI_MODE"]) == (
        ["plugin"], "/etc/gpuppetti/config.yaml", "/host", "plugin")
    assert spec["nodeSelector"] == {"gpuppetti.dev/mode": "plugin"}
    assert {"operator": "Exists"} not in spec["tolerations"], "not every taint"


@pytest.mark.parametrize("mode", ["plugin", "dra"])
def test_bound_allocation_dirs_is_accepted_and_said_to_do_nothing(mode: str) -> None:
    result = run_here("manifests", "--mode", mode, "--bound-allocation-dirs")
    assert result.returncode == 0, result.stderr
    assert list(yaml.safe_load_all(result.stdout)) == _cli("--mode", mode), "the same objects as without it"
    [notice] = [line for line in result.stderr.splitlines() if "--bound-allocation-dirs" in line]
    assert "no longer does anything" in notice
    [daemonset] = [o for o in _cli("--mode", mode) if o["kind"] == "DaemonSet"]
    [container] = daemonset["spec"]["template"]["spec"]["containers"]
    # Nothing privileged, no mount that reaches the node: the layer directory is the daemon's to write alone.
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not any("mountPropagation" in mount for mount in container["volumeMounts"])


def test_label_node_adds_only_get_and_patch_on_nodes() -> None:
    objects = _cli("--label-node")
    _validate(objects)
    [role] = [o for o in objects if o["kind"] == "ClusterRole"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    [daemonset] = [o for o in objects if o["kind"] == "DaemonSet"]
    env = {e["name"]: e.get("value") for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["GPUPPETTI_LABEL_NODE"] == "true"
    assert daemonset["spec"]["template"]["spec"]["serviceAccountName"] == "gpuppetti-device-plugin"


def test_broken_config_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\nsharing: {timeSlicing: {resources: [{name: x, replicas: 2}]}}\n")
    result = run_here("manifests", "--config", str(bad))
    assert result.returncode == 2
    assert f"{bad}: sharing.timeSlicing.resources[0].name" in result.stderr


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--image-pull-policy", "always", "'always': must be one of Always, IfNotPresent, Never"),
    ("--node-selector", "pool", "'pool': expected KEY=VALUE"),
    ("--node-selector", "pool=has space", "is not a label value"),
    ("--node-selector", "x_=y", "is not a label key"),
    ("--toleration", "dedicated=gpu:NoRun", "the effect after ':' must be one of NoSchedule, PreferNoSchedule"),
    ("--requests", "gpu=1", "expected cpu=QUANTITY and/or memory=QUANTITY"),
    ("--limits", "memory=lots", "memory=lots: expected a positive quantity"),
    ("--vulkan-layer-dir", "relative/dir", "must be an absolute path on the node"),
])
def test_a_bad_flag_is_one_line_naming_it(flag: str, value: str, message: str) -> None:
    result = run_here("manifests", flag, value)
    assert result.returncode == 2 and not result.stdout
    [line] = result.stderr.strip().splitlines()[-1:]
    assert flag in line and message in line, result.stderr


@pytest.mark.parametrize("path", sorted((DEPLOY / "examples").rglob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    _validate([o for o in yaml.safe_load_all(path.read_text()) if o])


def test_each_dra_claim_template_has_an_example_pod() -> None:
    def objects(pattern: str, kind: str) -> list[dict[str, Any]]:
        found = [o for path in sorted((DEPLOY / "examples" / "dra").glob(pattern))
                 for o in yaml.safe_load_all(path.read_text()) if o]
        assert found and all(o["kind"] == kind for o in found), pattern
        return found

    templates = {t["metadata"]["name"] for t in objects("*.yaml", "ResourceClaimTemplate")}
    pods = objects("pods/*.yaml", "Pod")
    used: set[str] = set()
    for pod in pods:
        spec = pod["spec"]
        claims = {c["name"]: c["resourceClaimTemplateName"] for c in spec["resourceClaims"]}
        used.update(claims.values())
        named = {c["name"] for container in spec["containers"] for c in container["resources"]["claims"]}
        assert named == set(claims), f"{pod['metadata']['name']}: its containers name every claim it makes"
    assert used == templates, "one example pod per claim template, and no pod naming a template that is not there"


def test_validation_really_rejects_bad_objects() -> None:
    device_class = manifests.dra_driver(manifests.Options())[3]
    assert device_class["kind"] == "DeviceClass"
    device_class["spec"]["selector"] = device_class["spec"].pop("selectors")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(device_class, "1.34", strict=True)


def test_device_classes_one_generic_and_one_per_vendor() -> None:
    classes = {o["metadata"]["name"]: o["spec"] for o in manifests.dra_driver(manifests.Options())
               if o["kind"] == "DeviceClass"}
    driver = DraSection().driver_name
    assert "extendedResourceName" not in classes[driver]
    bridged = {name: spec.get("extendedResourceName") for name, spec in classes.items()}
    assert bridged == {
        driver: None, f"partition.{driver}": None, f"apple.{driver}": "apple.com/gpu",
        f"nvidia.{driver}": "nvidia.com/gpu", f"amd.{driver}": "amd.com/gpu",
        f"intel.{driver}": "gpu.intel.com/i915", f"generic.{driver}": "gpuppetti.dev/gpu",
    }
    assert "vendor == 'apple'" in classes[f"apple.{driver}"]["selectors"][0]["cel"]["expression"]


def test_each_mode_has_its_own_config_and_node_label() -> None:
    objects = [*_cli("--mode", "plugin"), *_cli("--mode", "dra")]
    maps = [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"]
    assert maps == ["gpuppetti-device-plugin-config", "gpuppetti-dra-config"]
    daemonsets = [o["spec"]["template"]["spec"] for o in objects if o["kind"] == "DaemonSet"]
    assert [d["nodeSelector"] for d in daemonsets] == [{"gpuppetti.dev/mode": "plugin"}, {"gpuppetti.dev/mode": "dra"}]
    assert [d["volumes"][0]["configMap"]["name"] for d in daemonsets] == maps
    [preset] = [o for o in _cli("--preset", "minikube-krunkit") if o["kind"] == "DaemonSet"]
    assert "nodeSelector" not in preset["spec"]["template"]["spec"], "the one node of the VM has the GPU"


def test_example_gpu_config_decodes() -> None:
    [template] = yaml.safe_load_all((DEPLOY / "examples" / "dra" / "shared-gpu.yaml").read_text())
    [entry] = template["spec"]["spec"]["devices"]["config"]
    assert opaque.decode(entry["opaque"]["parameters"], "example").sharing.strategy == "TimeSlicing"


def test_a_time_slice_interval_is_refused_not_ignored() -> None:
    # NVIDIA's driver takes timeSlicing.interval; nothing here could honour it, so a config that sets one fails.
    parameters = {"apiVersion": opaque.API_VERSION, "kind": opaque.KIND,
                  "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}}
    with pytest.raises(opaque.OpaqueConfigError, match=r"sharing.timeSlicing: unknown key"):
        opaque.decode(parameters, "config[0]")


def test_the_old_mode_deviceplugin_renders_plugin_with_a_warning() -> None:
    old, new = run_here("manifests", "--mode", "deviceplugin"), run_here("manifests", "--mode", "plugin")
    assert (old.returncode, old.stdout) == (0, new.stdout)
    warning, *rest = old.stderr.splitlines()
    assert warning == ("gpuppetti: warning: mode 'deviceplugin' is the old spelling of 'plugin', which it means; "
                       "write plugin")
    assert rest == new.stderr.splitlines()
    assert "deviceplugin" not in new.stderr
