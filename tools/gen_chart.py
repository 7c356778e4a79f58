"""Render the Helm chart under deploy/helm/gpuppetti from `gpuppetti manifests`: its templates, one object per
file, values.yaml (with the command's defaults), values.schema.json (from the config model and the rules of
gpuppetti.base.syntax) and Chart.yaml.

The templates are the command's objects, rendered with a marker where a value goes: each marker becomes the Helm
expression of that value ({{ .Values.x }}, a toYaml block), and each part that a value can take out (the DaemonSet's
pull policy, the layer's mount, the RBAC of labelNode...) is found by rendering the objects without it, and wrapped in
{{- if }}. A mode's objects are its own files, each under {{- if }} of the mode. So the chart cannot differ from the
command: there is nothing in it to keep in step by hand. tests/unit/test_helm_chart.py fails when a file here is
stale (`make deploy`), and renders the chart with Helm to check what this writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from gen_deploy import write_rendered  # its neighbour in tools/, which is on sys.path when either runs
from pydantic import BaseModel, BeforeValidator, PlainValidator, WrapValidator
from pydantic.alias_generators import to_camel

import gpuppetti
from gpuppetti.base import nodepaths, syntax
from gpuppetti.commands import manifests
from gpuppetti.core.config import Config

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "gpuppetti"
NOTE = "Rendered by tools/gen_chart.py (`make deploy`). Edit the generator, not this."
# The chart's modes are `gpuppetti manifests --mode`'s, and the node label's values.
MODES: tuple[manifests.Mode, ...] = typing.get_args(manifests.Mode)
# The chart's first spelling of plugin: it still means plugin, and NOTES.txt asks for the new one.
OLD_PLUGIN_MODE = "deviceplugin"


# -- values, their schema, Chart.yaml ----------------------------------------------------------------------------

def default_image() -> tuple[str, str]:
    repository, _, tag = manifests.DEFAULT_IMAGE.rpartition(":")
    if not repository or "/" in tag:
        raise ValueError(f"the default image {manifests.DEFAULT_IMAGE} has no tag")
    return repository, tag


def _yaml(data: Any, indent: int = 0) -> str:
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120)
    return "".join(" " * indent + line for line in text.splitlines(keepends=True))


def values_yaml() -> str:
    repository, tag = default_image()
    default = manifests.Options()
    return f"""\
# {NOTE}
# The defaults are `gpuppetti manifests`' own: the same values render the same objects (docs/helm.md).

# plugin or dra: the device plugin or the DRA driver (`gpuppetti manifests --mode plugin|dra`). Each runs only on
# the nodes labelled {manifests.MODE_LABEL}=plugin or =dra; NOTES.txt prints the command. ({OLD_PLUGIN_MODE}, the
# chart's old spelling of plugin, still works.)
mode: {default.mode}

# The gpuppetti config (version: v1 ...), put in the ConfigMap as config.yaml (`--config`). Empty: `version: v1`,
# with replicas' time-slicing. Its keys are checked here; what they hold, by the daemon as it starts.
config: {{}}

# Device plugin, without config: time-slice every GPU into this many replicas, under every vendor's default
# resource name (`--replicas`). With the preset: its replicas ({manifests.PRESET_REPLICAS} when null).
replicas: null

# Device plugin: label each node with its GPU, with the RBAC to patch Nodes (`--label-node`).
labelNode: false

# A ready config in place of config (`--preset`): minikube-krunkit serves the VM's virtio-gpu as apple.com/gpu, on
# every node (the VM's one node has the GPU).
preset: ""

image:
  repository: {repository}
  tag: {tag}
  # Empty: Kubernetes' default (IfNotPresent; Always for the tag latest).
  pullPolicy: ""

# Labels a node must have besides {manifests.MODE_LABEL} (which the preset drops).
nodeSelector: {{}}

# The GPU taints and CriticalAddonsOnly, not every taint.
tolerations:
{_yaml(default.tolerations)}
resources:
{_yaml(default.resources, 2)}
# Where the Vulkan layer that enforces slices is installed on each node, and each allocation's ledger served
# (docs/enforced-slices.md); empty turns enforcement off.
vulkanLayerDir: {default.vulkan_layer_dir}
"""


def _type_schema(annotation: Any) -> dict[str, Any]:
    """What a config key takes, as far as JSON Schema can say without the validators: unknown keys, enumerations,
    the plain types. A key with its own parsing (quantities, durations) takes anything here."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        return {} if _parses(metadata) else _type_schema(base)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            return {}
        inner = _type_schema(args[0])
        if "enum" in inner:
            return {**inner, "enum": [*inner["enum"], None]}
        if "type" in inner:
            return {**inner, "type": [inner["type"], "null"]}
        return inner
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    if origin is list:
        [item] = typing.get_args(annotation)
        return {"type": "array", "items": _type_schema(item)}
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return _model_schema(annotation)
        if issubclass(annotation, enum.Enum):
            return {"enum": [member.value for member in annotation]}
        for python, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string")):
            if annotation is python:
                return {"type": name}
    return {}


def _parses(metadata: list[Any]) -> bool:
    """Whether a validator of its own reads the value first (a quantity, a duration, a shorthand)."""
    return any(isinstance(m, BeforeValidator | PlainValidator | WrapValidator) for m in metadata)


def _model_schema(model: type[BaseModel]) -> dict[str, Any]:
    # pydantic keeps a field's own Annotated metadata apart from its annotation.
    properties = {(field.alias or to_camel(name)): {} if _parses(field.metadata) else _type_schema(field.annotation)
                  for name, field in model.model_fields.items() if not field.exclude}
    return {"type": "object", "properties": properties, "additionalProperties": False}


def config_schema() -> dict[str, Any]:
    schema = _model_schema(Config)
    schema["description"] = "the gpuppetti config; empty for the default"
    # Empty is the default config; otherwise the config says its version, as the daemon requires.
    schema["if"] = {"minProperties": 1}
    schema["then"] = {"required": ["version"]}
    return schema


# An image's tag, and its digest, as container tools take them (gpuppetti.base.syntax's image reference).
TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
DIGEST = r"[a-z0-9]+([+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}"


def _body(pattern: re.Pattern[str]) -> str:
    """A pattern of gpuppetti.base.syntax without its anchors, to build a schema's pattern from."""
    return pattern.pattern.removeprefix("^").removesuffix("$")


# What the API server takes, as Kubernetes checks it: a label key ([DNS subdomain/]name), a label value, and a
# quantity (its OpenAPI pattern, without the sign: a container's resources are never negative).
LABEL_NAME = _body(syntax.LABEL_NAME)
LABEL_KEY = f"({_body(syntax.DNS_SUBDOMAIN)}/)?{LABEL_NAME}"
QUANTITY = (r"\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
            r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?")
# The longest label key: a 253-character prefix, '/', a 63-character name.
LABEL_KEY_LENGTH = 253 + 1 + 63


def values_schema() -> dict[str, Any]:
    label_key = {"type": "string", "pattern": f"^{LABEL_KEY}$", "maxLength": LABEL_KEY_LENGTH}
    label_value = {"type": "string", "pattern": f"^({LABEL_NAME})?$", "maxLength": 63}
    toleration = {
        "type": "object",
        "properties": {"key": {**label_key, "pattern": f"^({LABEL_KEY})?$"},
                       "operator": {"enum": ["Exists", "Equal"]},
                       "value": label_value,
                       "effect": {"enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]},
                       "tolerationSeconds": {"type": "integer"}},
        "additionalProperties": False,
        # The API server's rules: no key tolerates every taint, and needs Exists; Exists takes no value;
        # tolerationSeconds is for NoExecute.
        "allOf": [
            {"if": {"not": {"required": ["key"], "properties": {"key": {"minLength": 1}}}},
             "then": {"required": ["operator"], "properties": {"operator": {"const": "Exists"}}}},
            {"if": {"required": ["operator"], "properties": {"operator": {"const": "Exists"}}},
             "then": {"properties": {"value": {"maxLength": 0}}}},
            {"if": {"required": ["tolerationSeconds"]},
             "then": {"required": ["effect"], "properties": {"effect": {"const": "NoExecute"}}}},
        ],
    }
    quantity = {"oneOf": [{"type": "string", "pattern": f"^{QUANTITY}$"}, {"type": "number", "minimum": 0}]}
    quantities = {"type": "object", "additionalProperties": quantity}
    return {
        # Draft 7, which older Helm 3 releases read too (their JSON Schema library knows no newer draft).
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "gpuppetti",
        "description": NOTE,
        "type": "object",
        "properties": {
            "global": {"type": "object"},
            "mode": {"enum": [*MODES, OLD_PLUGIN_MODE],
                     "description": f"plugin (the device plugin) or dra (the DRA driver); {OLD_PLUGIN_MODE} is the "
                                    "old spelling of plugin"},
            "config": config_schema(),
            "replicas": {"type": ["integer", "null"], "minimum": 1, "maximum": 1024},
            "labelNode": {"type": "boolean"},
            "preset": {"enum": ["", *manifests.PRESETS]},
            "image": {
                "type": "object",
                "properties": {
                    "repository": {"type": "string", "pattern": r"^[a-zA-Z0-9][a-zA-Z0-9._/:-]*$"},
                    # A tag, or a digest (sha256:...).
                    "tag": {"type": "string", "pattern": f"^({TAG}|{DIGEST})?$"},
                    "pullPolicy": {"enum": ["", "Always", "IfNotPresent", "Never"]},
                },
                "required": ["repository", "tag"],
                "additionalProperties": False,
            },
            "nodeSelector": {"type": "object", "propertyNames": label_key, "additionalProperties": label_value},
            "tolerations": {"type": "array", "items": toleration},
            "resources": {
                "type": "object",
                "properties": {"requests": quantities, "limits": quantities},
                "additionalProperties": False,
            },
            # gpuppetti.base.syntax's host path: absolute, no control character, no '..' part.
            "vulkanLayerDir": {"type": "string", "pattern": r"^(/[^\x00-\x1f\x7f]*)?$",
                               "not": {"pattern": r"(^|/)\.\.(/|$)"},
                               "description": "an absolute path on the node, or empty to turn enforcement off"},
            # Accepted for one more release; NOTES.txt says it no longer does anything.
            "boundAllocationDirs": {"type": "boolean"},
        },
        "required": ["mode", "image"],
        "additionalProperties": False,
    }


def chart_yaml() -> str:
    version = gpuppetti.__version__
    return f"""\
# {NOTE}
apiVersion: v2
name: gpuppetti
description: GPU sharing for Kubernetes that does not assume NVIDIA, as a device plugin or a DRA driver
type: application
version: {version}
appVersion: "{version}"
keywords: [gpu, device-plugin, dra, kubernetes]
"""


def layer_dir_template() -> str:
    """The check of vulkanLayerDir that `--vulkan-layer-dir` makes (gpuppetti.cli.values.layer_directory_problem),
    from the same lists: a directory of its own, neither a system directory nor one the DaemonSets mount."""
    advice = (f": give a directory of its own, such as {nodepaths.DEFAULT_VULKAN_LAYER_DIR}, or '' to turn "
              "enforcement off")
    lines = [
        f"{{{{/* {NOTE} From gpuppetti.base.nodepaths. */}}}}",
        '{{- define "gpuppetti.layerDir" -}}',
        "{{- with .Values.vulkanLayerDir -}}",
        "{{- $path := clean . -}}",
    ]
    for mount, what in nodepaths.DAEMONSET_MOUNTS.items():
        lines += [
            f'{{{{- if eq $path "{mount}" -}}}}',
            f'{{{{- fail (printf "vulkanLayerDir: %s is where the DaemonSets mount {what}{advice}" $path) -}}}}',
            f'{{{{- else if hasPrefix "{mount}/" $path -}}}}',
            f'{{{{- fail (printf "vulkanLayerDir: %s is inside {mount}, where the DaemonSets mount {what}{advice}" '
            "$path) -}}",
            f'{{{{- else if hasPrefix (printf "%s/" (trimSuffix "/" $path)) "{mount}" -}}}}',
            f'{{{{- fail (printf "vulkanLayerDir: %s holds {mount}, where the DaemonSets mount {what}{advice}" '
            "$path) -}}",
            "{{- end -}}",
        ]
    directories = " ".join(f'"{d}"' for d in nodepaths.SYSTEM_DIRECTORIES)
    lines += [
        f"{{{{- if has $path (list {directories}) -}}}}",
        f'{{{{- fail (printf "vulkanLayerDir: %s is a system directory{advice}" $path) -}}}}',
        "{{- end -}}",
    ]
    for tree in nodepaths.SYSTEM_TREES:
        lines += [
            f'{{{{- if or (eq $path "{tree}") (hasPrefix "{tree}/" $path) -}}}}',
            f'{{{{- fail (printf "vulkanLayerDir: %s is in {tree}, the system\'s own{advice}" $path) -}}}}',
            "{{- end -}}",
        ]
    lines += ["{{- end -}}", "{{- end }}"]
    return "\n".join(lines) + "\n"


# -- the templates, from `gpuppetti manifests`' objects ----------------------------------------------------------

def _marker(name: str) -> str:
    return f"@@{name}@@"


# A value of the chart put into the Options as a marker, and the Helm expression that takes the marker's place.
SCALARS = {
    _marker("namespace"): ".Release.Namespace | quote",
    _marker("image"): 'include "gpuppetti.image" . | quote',
    _marker("pullPolicy"): ".Values.image.pullPolicy",
    _marker("vulkanLayerDir"): ".Values.vulkanLayerDir | quote",
}
# A map or list of the chart's: given to the Options as a map holding BLOCK_KEY (a list: such a map its only item).
# The expression writes the whole map, whatever else the command put beside the marker (the node selector's mode
# label, which gpuppetti.nodeSelector writes too).
BLOCK_KEY = _marker("block")
BLOCKS = {
    "tolerations": "toYaml .Values.tolerations",
    "resources": "toYaml .Values.resources",
    # The mode label (unless a preset's one node is the GPU node) and nodeSelector's labels over it.
    "nodeSelector": 'include "gpuppetti.nodeSelector" .',
}
CONFIG_MARKER = _marker("config")
CONFIG_BLOCK = 'include "gpuppetti.config" .'
MODE_TEST = 'eq (include "gpuppetti.mode" .) "{mode}"'


def marked_options(mode: manifests.Mode) -> manifests.Options:
    """Every part of the objects there: each value a marker, each choice that adds something made."""
    return manifests.Options(
        mode=mode, namespace=_marker("namespace"), image=_marker("image"), image_pull_policy=_marker("pullPolicy"),
        # Parsed as a config, and then only the marker in it counts.
        config=f"# {CONFIG_MARKER}\nversion: v1\n",
        label_node=True, node_selector=True, extra_node_selector={BLOCK_KEY: "nodeSelector"},
        tolerations=[{BLOCK_KEY: "tolerations"}], resources={BLOCK_KEY: "resources"},
        vulkan_layer_dir=_marker("vulkanLayerDir"),
    )


# What each value of the chart that can take a part out takes out, as the Options say it, and the test the part is
# rendered under.
OPTIONAL: tuple[tuple[dict[str, Any], str], ...] = (
    ({"label_node": False}, ".Values.labelNode"),
    ({"image_pull_policy": None}, ".Values.image.pullPolicy"),
    ({"vulkan_layer_dir": ""}, ".Values.vulkanLayerDir"),
    ({"node_selector": False, "extra_node_selector": {}}, BLOCKS["nodeSelector"]),
)


@dataclasses.dataclass(frozen=True)
class Expr:
    """A scalar that a Helm expression writes."""

    text: str


@dataclasses.dataclass(frozen=True)
class Block:
    """A map or list that a Helm expression writes under its key; literal: a string, as a YAML literal block."""

    text: str
    literal: bool = False


@dataclasses.dataclass(frozen=True)
class Labels:
    """An object's labels: the command's, then those Helm's conventions add."""

    own: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Cond:
    """A map entry or a list item that is there only where each of tests holds."""

    tests: tuple[str, ...]
    value: Any


def _marked(value: Any, where: str) -> Any:
    """The Helm expression a marker stands for, or None for what is no marker."""
    if isinstance(value, str):
        if value in SCALARS:
            return Expr(SCALARS[value])
        if CONFIG_MARKER in value:
            return Block(CONFIG_BLOCK, literal=True)
        if "@@" in value:
            raise ValueError(f"{where}: a marker inside {value!r}, which no template expression can stand for")
    if isinstance(value, dict) and BLOCK_KEY in value:
        return Block(BLOCKS[value[BLOCK_KEY]])
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) and BLOCK_KEY in value[0]:
        return Block(BLOCKS[value[0][BLOCK_KEY]])
    return None


def _same_item(left: Any, right: Any) -> bool:
    """Whether two list items are one (a container, a mount, a volume, an env var: by name), maybe differing within."""
    if isinstance(left, dict) and isinstance(right, dict) and "name" in left:
        return bool(left.get("name") == right.get("name"))
    return bool(left == right)


def _merge(full: Any, lacking: list[tuple[str, Any]], where: str) -> Any:
    """full with its markers made Helm expressions, and each map entry or list item that one of lacking (test, the
    same part rendered without something) has not got made a Cond of that test."""
    marked = _marked(full, where)
    if marked is not None:
        return marked
    if isinstance(full, dict):
        out: dict[str, Any] = {}
        for test, other in lacking:
            if extra := set(other) - set(full):
                raise ValueError(f"{where}: {sorted(extra)} only without {test}: a value can only take parts out")
        for key, value in full.items():
            tests = tuple(test for test, other in lacking if key not in other)
            merged = _merge(value, [(test, other[key]) for test, other in lacking if key in other], f"{where}.{key}")
            out[key] = Cond(tests, merged) if tests else merged
        return out
    if isinstance(full, list):
        pairs: list[list[tuple[str, Any]]] = [[] for _ in full]
        missing: list[list[str]] = [[] for _ in full]
        for test, other in lacking:
            j = 0
            for i, item in enumerate(full):
                if j < len(other) and _same_item(item, other[j]):
                    pairs[i].append((test, other[j]))
                    j += 1
                else:
                    missing[i].append(test)
            if j != len(other):
                raise ValueError(f"{where}: {other[j:]} only without {test}: a value can only take parts out")
        items = [_merge(item, pairs[i], f"{where}[{i}]") for i, item in enumerate(full)]
        return [Cond(tuple(missing[i]), item) if missing[i] else item for i, item in enumerate(items)]
    for test, other in lacking:
        if other != full:
            raise ValueError(f"{where}: {full!r} is {other!r} without {test}, which no marker stands for")
    return full


def _scalar(value: Any) -> str:
    text = str(yaml.safe_dump(value, default_flow_style=True, width=1 << 20)).removesuffix("\n...\n").strip()
    # Double quotes, as Helm's own quote writes them, rather than YAML's single quotes that double each quote within
    # (the DeviceClasses' CEL is full of them); JSON's string is one of YAML's.
    return json.dumps(value) if isinstance(value, str) and text.startswith("'") else text


def _test(tests: tuple[str, ...]) -> str:
    if len(tests) == 1:
        return tests[0]
    return "and " + " ".join(f"({t})" if " " in t else t for t in tests)


def _is_plain(value: Any) -> bool:
    return not isinstance(value, dict | list | Expr | Block | Labels | Cond)


def _entry(key: str, value: Any, indent: int) -> list[str]:
    pad, head = " " * indent, f"{' ' * indent}{_scalar(key)}:"
    if isinstance(value, Cond):
        if isinstance(value.value, Block) and value.tests == (value.value.text,):
            # The value is the test's own: written once, as `with` gives it.
            return [f"{pad}{{{{- with {value.tests[0]} }}}}", head, f"{pad}  {{{{- . | nindent {indent + 2} }}}}",
                    f"{pad}{{{{- end }}}}"]
        return [f"{pad}{{{{- if {_test(value.tests)} }}}}", *_entry(key, value.value, indent), f"{pad}{{{{- end }}}}"]
    if isinstance(value, Expr):
        return [f"{head} {{{{ {value.text} }}}}"]
    if isinstance(value, Block):
        return [f"{head} |" if value.literal else head, f"{pad}  {{{{- {value.text} | nindent {indent + 2} }}}}"]
    if isinstance(value, Labels):
        return [head, *_map(value.own, indent + 2),
                f'{pad}  {{{{- include "gpuppetti.helmLabels" . | nindent {indent + 2} }}}}']
    if isinstance(value, dict):
        return [head, *_map(value, indent + 2)] if value else [f"{head} {{}}"]
    if isinstance(value, list):
        if all(_is_plain(item) for item in value):
            return [f"{head} {_scalar(value)}"]
        return [head, *_list(value, indent + 2)]
    return [f"{head} {_scalar(value)}"]


def _map(mapping: dict[str, Any], indent: int) -> list[str]:
    return [line for key, value in mapping.items() for line in _entry(key, value, indent)]


def _list(items: list[Any], indent: int) -> list[str]:
    lines: list[str] = []
    pad = " " * indent
    for item in items:
        tests: tuple[str, ...] = ()
        if isinstance(item, Cond):
            tests, item = item.tests, item.value
        if isinstance(item, dict) and item and not isinstance(next(iter(item.values())), Cond):
            first, *rest = _map(item, indent + 2)
            body = [f"{pad}- {first.lstrip()}", *rest]
        elif isinstance(item, Expr):
            body = [f"{pad}- {{{{ {item.text} }}}}"]
        elif _is_plain(item):
            body = [f"{pad}- {_scalar(item)}"]
        else:
            raise ValueError(f"a list item the templates cannot write: {item!r}")
        lines += [f"{pad}{{{{- if {_test(tests)} }}}}", *body, f"{pad}{{{{- end }}}}"] if tests else body
    return lines


def _object_file(obj: dict[str, Any]) -> str:
    """deviceclass[-PREFIX].yaml for a DeviceClass named PREFIX.DRIVER; KIND-COMPONENT.yaml for the others."""
    kind, name = obj["kind"].lower(), obj["metadata"]["name"]
    if obj["kind"] == "DeviceClass":
        prefix = name.removesuffix(manifests.DRIVER).rstrip(".")
        return f"{kind}-{prefix}.yaml" if prefix else f"{kind}.yaml"
    return f"{kind}-{obj['metadata']['labels']['app.kubernetes.io/component']}.yaml"


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _objects(options: manifests.Options) -> dict[tuple[str, str], dict[str, Any]]:
    # The chart leaves the namespace to Helm (`helm install -n NS --create-namespace`): a chart that rendered its
    # release's namespace could not be installed into it.
    return {_key(obj): obj for obj in manifests.render(options) if obj["kind"] != "Namespace"}


def object_templates() -> dict[str, str]:
    """Each object of each mode, as the template of its own file."""
    files: dict[str, str] = {}
    for mode in MODES:
        full = marked_options(mode)
        variants = [(test, _objects(dataclasses.replace(full, **change))) for change, test in OPTIONAL]
        for key, obj in _objects(full).items():
            tests = (MODE_TEST.format(mode=mode), *(test for test, objs in variants if key not in objs))
            merged = _merge(obj, [(test, objs[key]) for test, objs in variants if key in objs], f"{mode} {key}")
            merged["metadata"]["labels"] = Labels(merged["metadata"]["labels"])
            lines = [f"{{{{- /* {NOTE} */}}}}", f"{{{{- if {_test(tests)} }}}}", *_map(merged, 0), "{{- end }}"]
            name = _object_file(obj)
            if name in files:
                raise ValueError(f"two objects would be templates/{name}")
            files[name] = "\n".join(lines) + "\n"
    return files


NAMESPACE = "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# What values.schema.json cannot say, in order: each test, and the failure (a printf format) it gives.
CHECKS = (
    (f'not (regexMatch "{NAMESPACE}" .Release.Namespace)',
     "the release's namespace %q is not a namespace name: at most 63 lower-case letters, digits and '-', starting "
     "and ending with a letter or digit", ".Release.Namespace"),
    # The values that do not go together, refused as `gpuppetti manifests` refuses the same flags.
    ('and (eq .Values.mode "dra") $replicas',
     "replicas is for the device plugin (mode: plugin); with mode: dra, choose the slicing in the config's dra "
     "section (config)", None),
    ('and (eq .Values.mode "dra") .Values.labelNode',
     "labelNode is for the device plugin (mode: plugin); with mode: dra, the DRA driver publishes each GPU's "
     "attributes in its ResourceSlice", None),
    ("and .Values.config .Values.preset", "config and preset are two configs: give one of them", None),
    ("and .Values.config $replicas", "replicas applies to the generated config; set the replicas in config instead",
     None),
)


def _checks() -> str:
    lines = []
    for test, failure, argument in CHECKS:
        # A Go string literal, as JSON writes one.
        message = f"(printf {json.dumps(failure)} {argument})" if argument else json.dumps(failure)
        lines += [f"{{{{- if {test} -}}}}", f"{{{{- fail {message} -}}}}", "{{- end -}}"]
    return "\n".join(lines) + "\n"


def helpers_template() -> str:
    """The named templates the objects' templates include."""
    checks = _checks()
    names = {mode: next(name for kind, name in _objects(manifests.Options(mode=mode)) if kind == "DaemonSet")
             for mode in MODES}
    resources = " ".join(f'"{name}"' for name in manifests.ALL_RESOURCES)
    presets = "".join(
        f'\n{{{{- define "gpuppetti.preset.{name}" -}}}}\n'
        + manifests.PRESETS[name].format(
            replicas=f"{{{{ .Values.replicas | default {manifests.PRESET_REPLICAS} }}}}").rstrip("\n")
        + "\n{{- end }}\n"
        for name in manifests.PRESETS)
    return f"""\
{{{{/* {NOTE} */}}}}

{{{{/* plugin or dra. {OLD_PLUGIN_MODE}, the chart's old spelling of plugin, still means plugin (NOTES.txt says
so). */}}}}
{{{{- define "gpuppetti.mode" -}}}}
{{{{- if eq .Values.mode "{OLD_PLUGIN_MODE}" -}}}}plugin{{{{- else -}}}}{{{{ .Values.mode }}}}{{{{- end -}}}}
{{{{- end }}}}

{{{{/* The mode's DaemonSet. */}}}}
{{{{- define "gpuppetti.name" -}}}}
{{{{- if eq (include "gpuppetti.mode" .) "dra" -}}}}{names["dra"]}{{{{- else -}}}}{names["plugin"]}{{{{- end -}}}}
{{{{- end }}}}

{{{{/* The node label that says which mode a node runs. */}}}}
{{{{- define "gpuppetti.modeLabel" -}}}}{manifests.MODE_LABEL}{{{{- end }}}}

{{{{/* The labels Helm's conventions add to each object's own (not to the pods': an upgrade that changes nothing
rolls no pod). */}}}}
{{{{- define "gpuppetti.helmLabels" -}}}}
helm.sh/chart: {{{{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}}}
app.kubernetes.io/managed-by: {{{{ .Release.Service }}}}
app.kubernetes.io/instance: {{{{ .Release.Name }}}}
app.kubernetes.io/version: {{{{ .Chart.AppVersion | quote }}}}
{{{{- end }}}}

{{{{/* repository:tag, repository@digest for a tag that is a digest (sha256:...), or the repository alone. */}}}}
{{{{- define "gpuppetti.image" -}}}}
{{{{- $tag := .Values.image.tag | toString -}}}}
{{{{- if not $tag -}}}}
{{{{ .Values.image.repository }}}}
{{{{- else if contains ":" $tag -}}}}
{{{{ .Values.image.repository }}}}@{{{{ $tag }}}}
{{{{- else -}}}}
{{{{ .Values.image.repository }}}}:{{{{ $tag }}}}
{{{{- end -}}}}
{{{{- end }}}}

{{{{/* The mode label (but with a preset: its one node is the GPU node), and nodeSelector's labels over it. */}}}}
{{{{- define "gpuppetti.nodeSelector" -}}}}
{{{{- $selector := dict -}}}}
{{{{- if not .Values.preset -}}}}
{{{{- $_ := set $selector (include "gpuppetti.modeLabel" .) (include "gpuppetti.mode" .) -}}}}
{{{{- end -}}}}
{{{{- range $key, $value := .Values.nodeSelector -}}}}
{{{{- $_ := set $selector $key $value -}}}}
{{{{- end -}}}}
{{{{- if $selector -}}}}
{{{{ toYaml $selector }}}}
{{{{- end -}}}}
{{{{- end }}}}

{{{{/* config.yaml: the preset's, else the config value, else the default (with replicas' time-slicing). */}}}}
{{{{- define "gpuppetti.config" -}}}}
{{{{- if .Values.preset -}}}}
{{{{ include (printf "gpuppetti.preset.%s" .Values.preset) . }}}}
{{{{- else if .Values.config -}}}}
{{{{ toYaml .Values.config }}}}
{{{{- else -}}}}
{{{{ include "gpuppetti.defaultConfig" . }}}}
{{{{- end -}}}}
{{{{- end }}}}

{{{{/* The config when none is given: whole GPUs; with replicas above 1, that many time-sliced replicas of every
GPU, under each vendor's resource name (`gpuppetti manifests --replicas`). */}}}}
{{{{- define "gpuppetti.defaultConfig" -}}}}
version: v1
{{{{- if gt (int (.Values.replicas | default 0)) 1 }}}}
sharing:
  timeSlicing:
    resources:
{{{{- range list {resources} }}}}
      - name: {{{{ . }}}}
        replicas: {{{{ $.Values.replicas }}}}
{{{{- end }}}}
{{{{- end }}}}
{{{{- end }}}}
{presets}
{{{{/* What values.schema.json cannot say: the values that do not go together, refused as `gpuppetti manifests`
refuses the same flags, and a release namespace that is no namespace name. */}}}}
{{{{- define "gpuppetti.validate" -}}}}
{{{{- $replicas := not (kindIs "invalid" .Values.replicas) -}}}}
{checks}{{{{- include "gpuppetti.layerDir" . -}}}}
{{{{- end }}}}
"""


def rendered() -> dict[Path, str]:
    files = {
        **{CHART / "templates" / name: text for name, text in object_templates().items()},
        CHART / "templates" / "_helpers.tpl": helpers_template(),
        # What the schema cannot check, in either mode: no object, or a failure that names the value.
        CHART / "templates" / "validate.yaml": f'{{{{- /* {NOTE} */}}}}\n{{{{- include "gpuppetti.validate" . }}}}\n',
        CHART / "templates" / "_layerdir.tpl": layer_dir_template(),
        CHART / "Chart.yaml": chart_yaml(),
        CHART / "values.yaml": values_yaml(),
        CHART / "values.schema.json": json.dumps(values_schema(), indent=2) + "\n",
    }
    return files


def stale_templates(files: dict[Path, str]) -> list[Path]:
    """The templates this wrote before that it writes no more (an object gone from `gpuppetti manifests`)."""
    return sorted(path for path in (CHART / "templates").iterdir()
                  if path not in files and NOTE in path.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    files = rendered()
    write_rendered(files)
    for path in stale_templates(files):
        path.unlink()
        print(f"removed {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
