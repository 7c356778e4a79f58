"""The Helm chart in deploy/helm/gpuppetti renders what `gpuppetti manifests` renders for the same choices.

Rendered by Helm itself (helm-python-sdk, Helm v4's library: `helm template` without the binary) and compared with
`gpuppetti manifests`' objects, parsed, object by object. Three differences are expected, and taken out first:
- the Namespace: `gpuppetti manifests` prints one; the chart leaves it to Helm (`helm install -n NS
  --create-namespace`), because a chart that rendered its release's own namespace could not be installed into it;
- HELM_LABELS, the labels Helm's conventions put on each object's metadata: removed from the chart's objects (after
  checking that every object has them), and nowhere else (the pod template's labels and the selectors are the same);
- the ConfigMap's config.yaml is compared as the YAML it holds: the chart writes the config value with toYaml, which
  keeps neither the comments nor the order of keys.
"""

from __future__ import annotations

import copy
import importlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuppetti.commands import manifests
from gpuppetti.core.config import ConfigError, parse_config
from tests.helpers import fenced_blocks, run_here

helm_python: Any = None
try:
    helm_python = importlib.import_module("helm_python")
except (ImportError, OSError) as exc:  # no wheel for this platform, or its native library does not load
    WHY_NO_HELM = f"the Helm SDK (helm-python-sdk, in the dev extra) cannot be imported here: {exc}"

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "gpuppetti"
sys.path.insert(0, str(ROOT / "tools"))
import gen_chart  # noqa: E402

HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version"}
RELEASE = "gpuppetti"
SIMULATED = {"version": "v1", "backend": "simulated",
             "simulated": {"gpus": [{"model": "Apple M3 Max", "vendor": "apple", "cores": 40, "memory": "48Gi",
                                     "count": 2}]},
             "sharing": {"timeSlicing": {"resources": [{"name": "apple.com/gpu", "replicas": 4,
                                                        "sliceMemory": "8Gi"}]},
                         "enforceCompute": True}}
DRA_CONFIG = {"version": "v1", "backend": "simulated", "simulated": SIMULATED["simulated"],
              "dra": {"slicing": "partitions", "partitions": [2, 4]}}
DIGEST = "sha256:" + "0123456789abcdef" * 4


@dataclass
class Case:
    """Chart values and the same choices for `gpuppetti manifests`: its flags where it has them, else Options."""

    id: str
    values: dict[str, Any]
    cli: list[str] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    namespace: str = "gpuppetti"

    def expected(self, tmp_path: Path) -> list[dict[str, Any]]:
        config = yaml.safe_dump(self.values["config"], sort_keys=False) if "config" in self.values else None
        if self.cli is not None:
            args = list(self.cli)
            if config is not None:
                (tmp_path / "config.yaml").write_text(config)
                args[args.index("CONFIG")] = str(tmp_path / "config.yaml")
            result = run_here("manifests", *args)
            assert result.returncode == 0, result.stderr
            text = result.stdout
        else:
            options = {"namespace": self.namespace, "config": config, **self.options}
            text = manifests.to_yaml(manifests.render(manifests.Options(**options)))
        return [o for o in yaml.safe_load_all(text) if o]


CASES = [
    Case("default", {}, []),
    Case("dra", {"mode": "dra"}, ["--mode", "dra"]),
    Case("image", {"image": {"repository": "registry.example:5000/gpuppetti", "tag": "0.1.0"}},
         ["--image", "registry.example:5000/gpuppetti:0.1.0"]),
    Case("dra-image-pull-policy", {"mode": "dra", "image": {"repository": "registry.example/gpuppetti",
                                                            "tag": "0.1.0", "pullPolicy": "Always"}},
         ["--mode", "dra", "--image", "registry.example/gpuppetti:0.1.0", "--image-pull-policy", "Always"]),
    Case("image-digest", {"image": {"repository": "registry.example/gpuppetti", "tag": DIGEST}},
         ["--image", f"registry.example/gpuppetti@{DIGEST}"]),
    Case("namespace", {"mode": "dra"}, ["--mode", "dra", "--namespace", "gpus"], namespace="gpus"),
    Case("replicas", {"replicas": 4}, ["--replicas", "4"]),
    Case("label-node", {"labelNode": True, "replicas": 2}, ["--label-node", "--replicas", "2"]),
    Case("config", {"config": SIMULATED}, ["--config", "CONFIG"]),
    Case("dra-config", {"mode": "dra", "config": DRA_CONFIG}, ["--mode", "dra", "--config", "CONFIG"]),
    Case("preset", {"preset": "minikube-krunkit"}, ["--preset", "minikube-krunkit"]),
    Case("preset-replicas", {"preset": "minikube-krunkit", "replicas": 2},
         ["--preset", "minikube-krunkit", "--replicas", "2"]),
    Case("node-selector-tolerations", {"nodeSelector": {"kubernetes.io/arch": "amd64", "pool": "gpu"},
                                       "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu",
                                                        "effect": "NoSchedule"},
                                                       {"key": "maintenance", "operator": "Exists"}]},
         ["--node-selector", "kubernetes.io/arch=amd64", "--node-selector", "pool=gpu",
          "--toleration", "dedicated=gpu:NoSchedule", "--toleration", "maintenance"]),
    # No tolerations at all: a chart value only (the flag replaces the defaults with at least one).
    Case("dra-node-selector-tolerations", {"mode": "dra", "nodeSelector": {"pool": "gpu"}, "tolerations": []},
         options={"mode": "dra", "extra_node_selector": {"pool": "gpu"}, "tolerations": []}),
    Case("preset-node-selector", {"preset": "minikube-krunkit", "nodeSelector": {"pool": "gpu"}},
         ["--preset", "minikube-krunkit", "--node-selector", "pool=gpu"]),
    # A map given merges into the default one, as Helm's values do; null takes a key out.
    Case("resources", {"resources": {"requests": {"cpu": "50m"}, "limits": {"memory": "256Mi"}}},
         ["--requests", "cpu=50m", "--limits", "memory=256Mi"]),
    Case("dra-resources-no-limits", {"mode": "dra", "resources": {"limits": None}},
         ["--mode", "dra", "--limits", "none"]),
    Case("vulkan-layer-dir", {"vulkanLayerDir": "/opt/gpuppetti/vulkan"},
         ["--vulkan-layer-dir", "/opt/gpuppetti/vulkan"]),
    Case("dra-vulkan-layer-dir", {"mode": "dra", "vulkanLayerDir": "/opt/gpuppetti/vulkan"},
         ["--mode", "dra", "--vulkan-layer-dir", "/opt/gpuppetti/vulkan"]),
    Case("no-enforcement", {"vulkanLayerDir": ""}, ["--vulkan-layer-dir", ""]),
    Case("dra-no-enforcement", {"mode": "dra", "vulkanLayerDir": ""}, ["--mode", "dra", "--vulkan-layer-dir", ""]),
    # Accepted for one more release, and doing nothing either way.
    Case("bound-allocation-dirs", {"boundAllocationDirs": True}, ["--bound-allocation-dirs"]),
    Case("dra-bound-allocation-dirs", {"mode": "dra", "boundAllocationDirs": True, "vulkanLayerDir": "/opt/v"},
         ["--mode", "dra", "--bound-allocation-dirs", "--vulkan-layer-dir", "/opt/v"]),
]


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    if helm_python is None:
        pytest.skip(WHY_NO_HELM)
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any], namespace: str = "gpuppetti") -> dict[str, str]:
    """`helm template RELEASE deploy/helm/gpuppetti -n NAMESPACE`: each template's text, NOTES.txt included."""
    rendered: dict[str, str] = chart.render(values, name=RELEASE, namespace=namespace, is_install=True)
    return rendered


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    return [o for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt")
            for o in yaml.safe_load_all(text) if o]


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _comparable(objs: list[dict[str, Any]], from_chart: bool) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for obj in copy.deepcopy(objs):
        if obj["kind"] == "Namespace":
            assert not from_chart, "the chart leaves the namespace to Helm"
            continue
        if from_chart:
            labels = obj["metadata"]["labels"]
            assert set(labels) >= HELM_LABELS, f"{_key(obj)} lacks Helm's labels"
            obj["metadata"]["labels"] = {k: v for k, v in labels.items() if k not in HELM_LABELS}
        if obj["kind"] == "ConfigMap":
            obj["data"]["config.yaml"] = yaml.safe_load(obj["data"]["config.yaml"])
        out[_key(obj)] = obj
    return out


def test_chart_is_rendered_from_the_generator() -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in gen_chart.rendered().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"run `make deploy`: {stale}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_chart_renders_what_manifests_renders(chart: Any, case: Case, tmp_path: Path) -> None:
    got = _comparable(objects(render(chart, case.values, case.namespace)), from_chart=True)
    want = _comparable(case.expected(tmp_path), from_chart=False)
    assert sorted(got) == sorted(want)
    for key, obj in want.items():
        assert got[key] == obj, f"{key} differs"


def test_the_helm_labels_are_only_on_the_objects(chart: Any) -> None:
    for obj in objects(render(chart, {"mode": "dra"})):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        if obj["kind"] == "DaemonSet":
            assert not HELM_LABELS & set(obj["spec"]["template"]["metadata"]["labels"]), \
                "the pods' labels are manifests' own: an upgrade that changes nothing rolls no pod"


@pytest.mark.parametrize("values", [{}, {"mode": "dra"}, {"labelNode": True, "config": SIMULATED}],
                         ids=["plugin", "dra", "label-node-config"])
def test_helm_lint_passes(values: dict[str, Any]) -> None:
    if helm_python is None:
        pytest.skip(WHY_NO_HELM)
    report = helm_python.lint(CHART, values, strict=True)
    # Severity 1 is information (Helm recommends an icon, which the chart has not got).
    findings = [m for m in report["messages"] if m["severity"] > 1]
    assert (findings, report["errors"]) == ([], [])


@pytest.mark.parametrize(("values", "message"), [
    ({"mode": "bogus"}, "at '/mode': value must be one of 'plugin', 'dra', 'deviceplugin'"),
    ({"mode": "both"}, "at '/mode': value must be one of 'plugin', 'dra', 'deviceplugin'"),
    ({"nodeSelectors": {"a": "b"}}, "additional properties 'nodeSelectors' not allowed"),
    ({"image": {"repository": "x", "tag": "has space"}}, "at '/image/tag'"),
    ({"image": {"repository": "x", "tag": "dev", "pullPolicy": "always"}}, "at '/image/pullPolicy': value must be"),
    ({"replicas": 0}, "at '/replicas': minimum: got 0, want 1"),
    ({"tolerations": {"key": "x"}}, "at '/tolerations': got object, want array"),
    ({"vulkanLayerDir": "relative/dir"}, "at '/vulkanLayerDir'"),
    ({"preset": "kind"}, "at '/preset': value must be one of '', 'minikube-krunkit'"),
    ({"config": {"backend": "drm"}}, "at '/config': missing property 'version'"),
    ({"config": {"version": "v2"}}, "at '/config/version': value must be 'v1'"),
    ({"config": {"version": "v1", "sharing": {"timeSlicng": {}}}},
     "at '/config/sharing': additional properties 'timeSlicng' not allowed"),
    ({"config": {"version": "v1", "dra": {"slicing": "halves"}}}, "at '/config/dra/slicing': value must be one of"),
])
def test_a_bad_value_fails_naming_it(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as failure:
        render(chart, values)
    assert message in str(failure.value)


# What the chart rendered and the API server then refused: each is refused by the values' schema, naming it.
@pytest.mark.parametrize(("values", "says"), [
    # A key is named by the schema's library as a property name, at the root.
    ({"nodeSelector": {"pool\nx": "gpu"}}, "invalid propertyName 'pool"),
    ({"nodeSelector": {"-pool": "gpu"}}, "invalid propertyName '-pool'"),
    ({"nodeSelector": {"Example.com/pool": "gpu"}}, "invalid propertyName 'Example.com/pool'"),
    ({"nodeSelector": {"pool": "gpu\n"}}, "at '/nodeSelector/pool'"),
    ({"nodeSelector": {"pool": "a" * 64}}, "at '/nodeSelector/pool'"),
    ({"tolerations": [{"key": "bad key", "operator": "Exists"}]}, "at '/tolerations/0/key'"),
    ({"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu\n"}]}, "at '/tolerations/0/value'"),
    ({"tolerations": [{"key": "dedicated", "effect": "NoScheduling"}]}, "at '/tolerations/0/effect'"),
    ({"tolerations": [{"operator": "Equal", "value": "gpu"}]}, "at '/tolerations/0'"),
    ({"tolerations": [{"key": "dedicated", "operator": "Exists", "value": "gpu"}]}, "at '/tolerations/0'"),
    ({"tolerations": [{"key": "dedicated", "effect": "NoSchedule", "tolerationSeconds": 30}]}, "at '/tolerations/0'"),
    ({"resources": {"requests": {"cpu": "50 m"}}}, "at '/resources/requests/cpu'"),
    ({"resources": {"limits": {"memory": "128MB"}}}, "at '/resources/limits/memory'"),
    ({"resources": {"limits": {"memory": "-128Mi"}}}, "at '/resources/limits/memory'"),
    ({"resources": {"limits": {"memory": "128Mi\n"}}}, "at '/resources/limits/memory'"),
    ({"resources": {"limits": {"cpu": -1}}}, "at '/resources/limits/cpu'"),
    ({"vulkanLayerDir": "/var/lib/gpuppetti\n"}, "at '/vulkanLayerDir'"),
    ({"vulkanLayerDir": "/var/lib/../../etc"}, "at '/vulkanLayerDir'"),
])
def test_what_the_api_server_would_refuse_fails_the_schema(chart: Any, values: dict[str, Any], says: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as failure:
        render(chart, values)
    assert says in str(failure.value)


@pytest.mark.parametrize("values", [
    {"nodeSelector": {"kubernetes.io/arch": "amd64", "example.com/pool": "", "a_b.c": "A-1"}},
    {"tolerations": [{"operator": "Exists"}, {"key": "k", "operator": "Exists", "effect": "NoExecute",
                                              "tolerationSeconds": 60}]},
    {"resources": {"requests": {"cpu": "0.5", "memory": "1e9"}, "limits": {"cpu": 2, "memory": "+1.5Gi"}}},
])
def test_what_the_api_server_takes_passes_the_schema(chart: Any, values: dict[str, Any]) -> None:
    render(chart, values)


def test_a_namespace_that_is_no_namespace_name_fails_and_injects_nothing(chart: Any) -> None:
    with pytest.raises(helm_python.HelmRenderError, match="is not a namespace name"):
        render(chart, {}, namespace="gpuppetti\n  injected: true")
    # Quoted wherever it is written, besides.
    for template in (CHART / "templates").glob("*.yaml"):
        assert "{{ .Release.Namespace }}" not in template.read_text(), template.name


@pytest.mark.parametrize(("values", "message"), [
    ({"mode": "dra", "replicas": 4}, "replicas is for the device plugin (mode: plugin)"),
    ({"mode": "dra", "labelNode": True}, "labelNode is for the device plugin (mode: plugin)"),
    ({"config": SIMULATED, "replicas": 4}, "replicas applies to the generated config; set the replicas in config"),
    ({"config": SIMULATED, "preset": "minikube-krunkit"}, "config and preset are two configs: give one of them"),
])
def test_values_that_do_not_go_together_fail_as_the_flags_do(
        chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmRenderError) as failure:
        render(chart, values)
    assert message in str(failure.value)


@pytest.mark.parametrize(("directory", "says"), [
    ("/host", "vulkanLayerDir: /host is where the DaemonSets mount the node's root"),
    ("//host/", "vulkanLayerDir: /host is where the DaemonSets mount the node's root"),
    ("/", "vulkanLayerDir: / holds /host"),
    ("/var/lib/kubelet/plugins/x", "vulkanLayerDir: /var/lib/kubelet/plugins/x is inside /var/lib/kubelet/plugins"),
    ("/var/lib/kubelet", "vulkanLayerDir: /var/lib/kubelet holds /var/lib/kubelet/device-plugins"),
    ("/usr/local/lib", "vulkanLayerDir: /usr/local/lib is in /usr, the system's own"),
    ("/tmp", "vulkanLayerDir: /tmp is a system directory"),
])
def test_a_layer_dir_over_another_mount_or_a_system_directory_fails_as_the_flag_does(
        chart: Any, directory: str, says: str) -> None:
    with pytest.raises(helm_python.HelmRenderError) as failure:
        render(chart, {"vulkanLayerDir": directory})
    assert says in str(failure.value) and "give a directory of its own" in str(failure.value)
    render(chart, {"vulkanLayerDir": "/opt/gpuppetti/vulkan"})


def _configs_shown() -> list[tuple[str, dict[str, Any]]]:
    """Every config the README and the guides show that the daemon takes, and the presets'."""
    found = [(f"preset {name}", yaml.safe_load(manifests.preset_config(name, None))) for name in manifests.PRESETS]
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for language, body in fenced_blocks(doc.read_text()):
            if language != "yaml" or "version: v1" not in body:
                continue
            try:
                parse_config(body, doc.name)
            except ConfigError:
                continue
            found.append((doc.name, yaml.safe_load(body)))
    return found


def test_every_config_the_docs_show_passes_the_charts_schema(chart: Any) -> None:
    shown = _configs_shown()
    assert len(shown) > 3
    for where, config in shown:
        try:
            chart.validate_schema({"config": config})
        except helm_python.HelmValuesError as exc:
            pytest.fail(f"a config in {where} fails the chart's schema, which the daemon takes:\n{exc}")


@pytest.mark.parametrize(("values", "args"), [({}, []), ({"mode": "dra"}, ["--mode", "dra"])])
def test_notes_print_the_node_labelling_command_as_manifests_does(
        chart: Any, values: dict[str, Any], args: list[str]) -> None:
    result = run_here("manifests", *args)
    command = result.stderr.split(": ")[-1].strip()
    assert command.startswith("kubectl label node NODE gpuppetti.dev/mode=")
    notes = render(chart, values)[f"{RELEASE}/templates/NOTES.txt"]
    assert command in notes


def test_notes_with_a_preset_label_nothing(chart: Any) -> None:
    notes = render(chart, {"preset": "minikube-krunkit"})[f"{RELEASE}/templates/NOTES.txt"]
    assert "kubectl label" not in notes
    assert "runs on every node" in notes
    # No "Then": there is nothing before it to do.
    assert not any(line.startswith("Then") for line in notes.splitlines()), notes


# -- one spelling of the mode: plugin, as `gpuppetti manifests --mode` and the node label spell it -----------------

def test_the_default_mode_is_plugin() -> None:
    assert yaml.safe_load((CHART / "values.yaml").read_text())["mode"] == "plugin"


def test_the_old_spelling_deviceplugin_renders_plugin_and_says_so(chart: Any) -> None:
    old = render(chart, {"mode": "deviceplugin", "labelNode": True})
    new = render(chart, {"mode": "plugin", "labelNode": True})
    notes = old.pop(f"{RELEASE}/templates/NOTES.txt")
    assert notes.startswith("mode: deviceplugin is the chart's old spelling of mode: plugin")
    assert "kubectl label node NODE gpuppetti.dev/mode=plugin" in notes
    new_notes = new.pop(f"{RELEASE}/templates/NOTES.txt")
    assert "deviceplugin" not in new_notes
    assert objects(old) == objects(new)


# -- a chart a Helm user can read ---------------------------------------------------------------------------------

def test_each_template_holds_one_object(chart: Any) -> None:
    """One object per file, named for its kind, as other device plugins' charts have them; each a Helm template
    rather than a generated blob."""
    kinds: dict[str, set[str]] = {}
    for values in ({}, {"mode": "dra"}, {"labelNode": True}):
        for path, text in render(chart, values).items():
            if path.endswith("NOTES.txt"):
                continue
            found = [obj for obj in yaml.safe_load_all(text) if obj]
            assert len(found) <= 1, f"{path}: {len(found)} objects"
            for obj in found:
                kinds.setdefault(path.rsplit("/", 1)[-1], set()).add(obj["kind"])
    assert all(len(each) == 1 for each in kinds.values()), kinds
    for name, each in kinds.items():
        assert name.split("-")[0].removesuffix(".yaml") == each.pop().lower(), name
    assert len(kinds) == 12
    for template in (CHART / "templates").iterdir():
        assert "Rendered by" not in template.read_text(), f"{template.name} is generated"


def test_chart_version_is_the_packages() -> None:
    import gpuppetti

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["version"], chart["appVersion"]) == ("v2", gpuppetti.__version__,
                                                                            gpuppetti.__version__)
