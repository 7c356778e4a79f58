"""The Helm chart in deploy/helm/gpuppetti, which tools/gen_chart.py renders from `gpuppetti manifests`.

The chart is no second source: its templates are the command's objects, written as Helm templates by the generator.
What is checked here is that the committed chart is what the generator writes, that Helm renders it into the
command's objects for a few sets of choices that take each of the generator's paths (the chart's values in each of
its places, each part a value takes out, both modes), and what the chart adds of its own: the values' schema and
checks, the notes, Helm's labels. Helm renders it with its own library (helm-python-sdk, Helm v4's library:
`helm template` without the binary). Three differences from the command's objects are expected, and taken out first:
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
    """Chart values, and the Options that `gpuppetti manifests` renders the same objects for."""

    id: str
    values: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    namespace: str = "gpuppetti"

    def expected(self) -> list[dict[str, Any]]:
        options = manifests.Options(**{"namespace": self.namespace, **self.options})
        return [o for o in yaml.safe_load_all(manifests.to_yaml(manifests.render(options))) if o]


CASES = [
    Case("default", {}),
    Case("dra", {"mode": "dra"}, {"mode": "dra"}),
    # Every value in its place, and every part a value can take out there.
    Case("plugin-everything",
         {"labelNode": True, "replicas": 3,
          "image": {"repository": "registry.example/gpuppetti", "tag": "0.1.0", "pullPolicy": "Always"},
          "nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "dedicated", "operator": "Exists"}],
          "resources": {"requests": {"cpu": "50m"}}, "vulkanLayerDir": "/opt/gpuppetti/vulkan"},
         {"label_node": True, "replicas": 3, "image": "registry.example/gpuppetti:0.1.0",
          "image_pull_policy": "Always", "extra_node_selector": {"pool": "gpu"},
          "tolerations": [{"key": "dedicated", "operator": "Exists"}],
          "resources": manifests.merged_resources({"requests": {"cpu": "50m"}}),
          "vulkan_layer_dir": "/opt/gpuppetti/vulkan"},
         namespace="gpus"),
    Case("dra-everything",
         {"mode": "dra", "config": DRA_CONFIG, "image": {"repository": "registry.example/gpuppetti", "tag": DIGEST,
                                                         "pullPolicy": "Never"},
          "nodeSelector": {"pool": "gpu"}, "vulkanLayerDir": "/opt/v"},
         {"mode": "dra", "config": yaml.safe_dump(DRA_CONFIG), "image": f"registry.example/gpuppetti@{DIGEST}",
          "image_pull_policy": "Never", "extra_node_selector": {"pool": "gpu"}, "vulkan_layer_dir": "/opt/v"},
         namespace="gpus"),
    # Every part a value takes out, gone.
    Case("dra-nothing", {"mode": "dra", "vulkanLayerDir": "", "tolerations": [], "resources": {"limits": None}},
         {"mode": "dra", "vulkan_layer_dir": "", "tolerations": [],
          "resources": manifests.merged_resources({"limits": None})}),
    Case("preset", {"preset": "minikube-krunkit", "replicas": 2, "vulkanLayerDir": ""},
         {"config": manifests.preset_config("minikube-krunkit", 2), "node_selector": False,
          "vulkan_layer_dir": ""}),
    Case("config", {"config": SIMULATED, "preset": "", "nodeSelector": {"pool": "gpu"}},
         {"config": yaml.safe_dump(SIMULATED), "extra_node_selector": {"pool": "gpu"}}),
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
    files = gen_chart.rendered()
    stale = [str(p.relative_to(ROOT)) for p, text in files.items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run `make deploy`: {stale}"
    # Every template is the generator's but the notes: none is written by hand, none left of an object gone.
    extra = {p.name for p in (CHART / "templates").iterdir()} - {p.name for p in files}
    assert extra == {"NOTES.txt"}, f"not written by tools/gen_chart.py: {sorted(extra - {'NOTES.txt'})}"


def test_make_deploy_removes_the_template_of_an_object_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "NOTES.txt").write_text("hand-written\n")
    (templates / "gone.yaml").write_text(f"{{{{- /* {gen_chart.NOTE} */}}}}\n")
    kept = templates / "kept.yaml"
    monkeypatch.setattr(gen_chart, "CHART", tmp_path)
    assert gen_chart.stale_templates({kept: ""}) == [templates / "gone.yaml"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_helm_renders_what_manifests_renders(chart: Any, case: Case) -> None:
    got = _comparable(objects(render(chart, case.values, case.namespace)), from_chart=True)
    want = _comparable(case.expected(), from_chart=False)
    assert sorted(got) == sorted(want)
    for key, obj in want.items():
        assert got[key] == obj, f"{key} differs"


def test_the_generator_takes_out_only_what_a_value_takes_out() -> None:
    full = {"env": [{"name": "A", "value": "@@vulkanLayerDir@@"}, {"name": "B", "value": "1"}], "x": 1, "y": 2}
    lacking = [(".Values.b", {"env": [{"name": "A", "value": ""}], "x": 1, "y": 2}),
               (".Values.y", {"env": full["env"], "x": 1})]
    merged = gen_chart._merge(full, lacking, "test")
    assert merged == {"env": [{"name": "A", "value": gen_chart.Expr(".Values.vulkanLayerDir | quote")},
                              gen_chart.Cond((".Values.b",), {"name": "B", "value": "1"})],
                      "x": 1, "y": gen_chart.Cond((".Values.y",), 2)}
    # A choice that adds a part, or changes one where no value of the chart stands, is no template's.
    with pytest.raises(ValueError, match="a value can only take parts out"):
        gen_chart._merge({"x": 1}, [(".Values.z", {"x": 1, "z": 2})], "test")
    with pytest.raises(ValueError, match="which no marker stands for"):
        gen_chart._merge({"x": 1}, [(".Values.z", {"x": 2})], "test")
    with pytest.raises(ValueError, match="a marker inside"):
        gen_chart._merge({"x": "a @@image@@"}, [], "test")


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
    """One object per file, named for its kind, as other device plugins' charts have them."""
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
    assert len(kinds) == 17


def test_chart_version_is_the_packages() -> None:
    import gpuppetti

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["version"], chart["appVersion"]) == ("v2", gpuppetti.__version__,
                                                                            gpuppetti.__version__)
