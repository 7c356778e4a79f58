"""Render the Helm chart's generated files under deploy/helm/gpuppetti from the code behind `gpuppetti manifests`.

The chart's object templates are `gpuppetti manifests`' own objects: rendered once with a marker in place of each
thing a value sets (the image, the namespace, the config, the tolerations...), dumped as YAML, and each marker put
back as the Helm expression that sets it. What a value can take away (the label-node RBAC, the Vulkan layer's
mounts, the pull policy) is found by rendering again without it: what is then missing is wrapped in an `if`. So
everything that is not a value comes from manifests.py alone, and `make deploy` brings the chart along with it.

Hand-written: templates/_helpers.tpl (how the values become those expressions), templates/NOTES.txt, .helmignore.
tests/unit/test_helm_chart.py renders the chart with Helm and compares it with `gpuppetti manifests`, and fails when
a file here is stale.
"""

from __future__ import annotations

import argparse
import copy
import enum
import json
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from gen_deploy import write_rendered  # its neighbour in tools/, which is on sys.path when either runs
from pydantic import BaseModel, BeforeValidator, PlainValidator, WrapValidator
from pydantic.alias_generators import to_camel

import gpuppetti
from gpuppetti.base import syntax
from gpuppetti.commands import manifests
from gpuppetti.core.config import Config

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "gpuppetti"
NOTE = "Rendered by tools/gen_chart.py from gpuppetti.commands.manifests (`make deploy`). Edit the generator, not this."
# The chart's modes, named like deploy/base's directories, and the modes of `gpuppetti manifests --mode` they are.
MODES: dict[str, manifests.Mode] = {"deviceplugin": "plugin", "dra": "dra"}

# The markers: values no real choice takes, each standing for what one chart value sets.
NAMESPACE = "chart-namespace"
IMAGE = "chart-image"
PULL_POLICY = "chart-pull-policy"
LAYER_DIR = "/chart-vulkan-layer-dir"
CONFIG = "version: v1\n# chart-config\n"
NODE_SELECTOR = "chart-node-selector"
TOLERATIONS = [{"key": "chart-tolerations"}]
RESOURCES: dict[str, dict[str, str]] = {"chart-resources": {}}
REPLICAS = 1023  # the default config's and the preset's replica count, a number nothing else there is
MARKERS = (NAMESPACE, IMAGE, PULL_POLICY, LAYER_DIR, "chart-config", NODE_SELECTOR, "chart-tolerations",
           "chart-resources", str(REPLICAS))

# A scalar marker -> the expression that computes it.
SCALARS = {
    NAMESPACE: ".Release.Namespace | quote",
    IMAGE: 'include "gpuppetti.image" . | quote',
    PULL_POLICY: ".Values.image.pullPolicy | quote",
    LAYER_DIR: ".Values.vulkanLayerDir | quote",
}
# What a value can take away: the condition, and the options without it.
TOGGLES: tuple[tuple[str, dict[str, Any]], ...] = (
    (".Values.labelNode", {"label_node": False}),
    (".Values.vulkanLayerDir", {"vulkan_layer_dir": ""}),
    (".Values.image.pullPolicy", {"image_pull_policy": None}),
)


def _entry_block(key: str, value: object) -> list[str] | None:
    """The template lines for ``key: value`` where the value is a marker for a whole subtree."""
    if value == CONFIG:
        return [f"{key}: |", '  {{- include "gpuppetti.config" . | nindent @child@ }}']
    if value == TOLERATIONS:
        return [f"{key}:", "  {{- toYaml .Values.tolerations | nindent @child@ }}"]
    if value == RESOURCES:
        return [f"{key}:", "  {{- toYaml .Values.resources | nindent @child@ }}"]
    if isinstance(value, dict) and NODE_SELECTOR in value:
        return ['{{- with include "gpuppetti.nodeSelector" . }}', f"{key}:", "  {{- . | nindent @child@ }}",
                "{{- end }}"]
    return None


@dataclass(frozen=True, eq=False)
class Expr:
    """A scalar Helm computes."""

    text: str


@dataclass(frozen=True, eq=False)
class Block:
    """Template lines in place of a mapping entry or a list item, at its indentation. For nindent, `@here@` is that
    indentation and `@child@` the indentation of what is nested in it."""

    lines: tuple[str, ...]


MISSING = object()


class Template:
    """Dumps objects holding Expr and Block as YAML, then puts the template text in their place."""

    TOKEN = re.compile(r"__helm_(\d+)__")

    def __init__(self) -> None:
        self.parts: list[Expr | Block] = []
        parts = self.parts

        class Dumper(yaml.SafeDumper):
            def ignore_aliases(self, data: Any) -> bool:
                return True

        def token(dumper: yaml.SafeDumper, part: Expr | Block) -> yaml.Node:
            parts.append(part)
            return dumper.represent_str(f"__helm_{len(parts) - 1}__")

        Dumper.add_representer(Expr, token)
        Dumper.add_representer(Block, token)
        self.dumper = Dumper

    def dump(self, data: Any) -> str:
        text: str = yaml.dump(data, Dumper=self.dumper, sort_keys=False, default_flow_style=False, width=120)
        return "\n".join(self._expand(text.splitlines())) + "\n"

    def _expand(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        for line in lines:
            whole = re.fullmatch(r"( *)(- )?__helm_(\d+)__(: null)?", line)
            part = self.parts[int(whole.group(3))] if whole else None
            if whole and isinstance(part, Block):
                if bool(whole.group(2)) == bool(whole.group(4)):
                    raise ValueError(f"a block must be a whole list item or mapping entry: {line!r}")
                indent = len(whole.group(1))
                block = [" " * indent + text.replace("@here@", str(indent)).replace("@child@", str(indent + 2))
                         for text in part.lines]
                out += self._expand(block)
                continue

            out.append(self.TOKEN.sub(self._inline, line))
        return out

    def _inline(self, match: re.Match[str]) -> str:
        expr = self.parts[int(match.group(1))]
        if not isinstance(expr, Expr):
            raise ValueError(f"a block inside a line, where only a scalar can go: {match.group(0)}")
        return "{{ " + expr.text + " }}"

    # -- from manifests' objects to templates ---------------------------------------------------------------------

    def build(self, node: Any, offs: list[tuple[str, Any]]) -> Any:
        """``node`` with markers as expressions; what is missing from an ``off`` rendering is under its condition."""
        if isinstance(node, dict):
            out: dict[Any, Any] = {}
            for key, value in node.items():
                conditions = [condition for condition, off in offs if key not in off]
                entry: dict[Any, Any]
                if (lines := _entry_block(key, value)) is not None:
                    entry = {Block(tuple(lines)): None}
                else:
                    entry = {key: self.build(value, [(c, off[key]) for c, off in offs if key in off])}
                if conditions:
                    entry = {self._under(conditions, entry): None}
                out.update(entry)
            return out
        if isinstance(node, list):
            items = []
            for index, item in enumerate(node):
                matched = [(condition, _same_item(off, node, index)) for condition, off in offs]
                built = self.build(item, [(c, found) for c, found in matched if found is not MISSING])
                conditions = [c for c, found in matched if found is MISSING]
                items.append(self._under(conditions, [built]) if conditions else built)
            return items
        if isinstance(node, str) and node in SCALARS:
            return Expr(SCALARS[node])
        return node

    def _under(self, conditions: list[str], data: Any) -> Block:
        return Block((_if(conditions), *self.dump(data).splitlines(), "{{- end }}"))


def _if(conditions: list[str]) -> str:
    test = f"and {' '.join(conditions)}" if len(conditions) > 1 else conditions[0]
    return f"{{{{- if {test} }}}}"


def _same_item(others: list[Any], items: list[Any], index: int) -> Any:
    """The item of another rendering that is ``items[index]``: by name where items have one, else by place."""
    item = items[index]
    if isinstance(item, dict) and "name" in item:
        return next((other for other in others if isinstance(other, dict) and other.get("name") == item["name"]),
                    MISSING)
    if len(others) != len(items):
        raise ValueError(f"cannot tell which item of {others!r} is {item!r}: they have no names")
    return others[index]


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def objects_template(chart_mode: str) -> str:
    mode = MODES[chart_mode]
    options = manifests.Options(
        mode=mode, namespace=NAMESPACE, image=IMAGE, image_pull_policy=PULL_POLICY, config=CONFIG,
        label_node=True, extra_node_selector={NODE_SELECTOR: "x"}, tolerations=copy.deepcopy(TOLERATIONS),
        resources=copy.deepcopy(RESOURCES), vulkan_layer_dir=LAYER_DIR,
    )
    offs = [(condition, {_key(o): o for o in manifests.render(replace(options, **changes))})
            for condition, changes in TOGGLES]
    template = Template()
    lines = [f"{{{{- /* {NOTE} */ -}}}}", f'{{{{- if eq .Values.mode "{chart_mode}" }}}}',
             '{{- include "gpuppetti.validate" . }}']
    for obj in manifests.render(options):
        if obj["kind"] == "Namespace":
            continue  # Helm's: the release's namespace, which `helm install --create-namespace` creates
        key = _key(obj)
        built = template.build(obj, [(c, off[key]) for c, off in offs if key in off])
        built["metadata"]["labels"][Block(('{{- include "gpuppetti.labels" . | nindent @here@ }}',))] = None
        document = template.dump(built).rstrip("\n").splitlines()
        conditions = [c for c, off in offs if key not in off]
        if conditions:
            lines += [_if(conditions), "---", *document, "{{- end }}"]
        else:
            lines += ["---", *document]
    lines.append("{{- end }}")
    text = "\n".join(lines) + "\n"
    _check_no_markers(text)
    return text


def _check_no_markers(text: str) -> None:
    left = [marker for marker in MARKERS if marker in text]
    if left:
        raise ValueError(f"a marker is left in the chart, where nothing puts its value back: {left}")


def generated_helpers() -> str:
    """The named templates that hold manifests' constants: the mode label, the names, the configs."""
    default, sliced = manifests.default_config(None), manifests.default_config(REPLICAS)
    if not sliced.startswith(default):
        raise ValueError("the default config with replicas no longer starts with the one without")
    replicas = sliced.removeprefix(default).replace(f"replicas: {REPLICAS}", "replicas: {{ .Values.replicas }}")
    labels = " ".join(f'"{chart}" "{mode}"' for chart, mode in MODES.items())
    names = " ".join(f'"{chart}" "gpuppetti-{manifests.COMPONENTS[mode]}"' for chart, mode in MODES.items())
    lines = [
        f"{{{{- /* {NOTE} */ -}}}}",
        "",
        "{{/* The node label that says which mode a node runs, and this mode's value of it. */}}",
        f'{{{{- define "gpuppetti.modeLabel" -}}}}{manifests.MODE_LABEL}{{{{- end }}}}',
        f'{{{{- define "gpuppetti.modeLabelValue" -}}}}{{{{ get (dict {labels}) .Values.mode }}}}{{{{- end }}}}',
        "",
        "{{/* This mode's DaemonSet. */}}",
        f'{{{{- define "gpuppetti.daemonSet" -}}}}{{{{ get (dict {names}) .Values.mode }}}}{{{{- end }}}}',
        "",
        "{{/* The config when none is given: time-sliced replicas of every GPU with replicas above 1. */}}",
        '{{- define "gpuppetti.defaultConfig" -}}',
        default.rstrip("\n"),
        "{{- if gt (int (.Values.replicas | default 0)) 1 }}",
        replicas.rstrip("\n"),
        "{{- end }}",
        "{{- end }}",
    ]
    for name in manifests.PRESETS:
        text = manifests.preset_config(name, REPLICAS)
        if "{{" in text:
            raise ValueError(f"the preset {name} has '{{{{' in it, which Helm would read as a template")
        text = text.replace(f"replicas: {REPLICAS}",
                            f"replicas: {{{{ .Values.replicas | default {manifests.PRESET_REPLICAS} }}}}")
        lines += ["", f'{{{{- define "gpuppetti.preset.{name}" -}}}}', text.rstrip("\n"), "{{- end }}"]
    text = "\n".join(lines) + "\n"
    _check_no_markers(text)
    return text


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
    [mode] = [chart_mode for chart_mode, mode in MODES.items() if mode == default.mode]
    modes = " or ".join(MODES)
    return f"""\
# {NOTE}
# The defaults are `gpuppetti manifests`' own: the same values render the same objects (docs/helm.md).

# {modes}: the device plugin or the DRA driver (`gpuppetti manifests --mode plugin|dra`). Each runs
# only on the nodes labelled {manifests.MODE_LABEL}=plugin or =dra; NOTES.txt prints the command.
mode: {mode}

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
# Where the Vulkan layer that enforces slices is installed on each node, and each allocation's accounting kept
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
            "mode": {"enum": list(MODES), "description": "the device plugin or the DRA driver"},
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


def rendered() -> dict[Path, str]:
    files = {
        CHART / "Chart.yaml": chart_yaml(),
        CHART / "values.yaml": values_yaml(),
        CHART / "values.schema.json": json.dumps(values_schema(), indent=2) + "\n",
        CHART / "templates" / "_generated.tpl": generated_helpers(),
    }
    for chart_mode in MODES:
        files[CHART / "templates" / f"{chart_mode}.yaml"] = objects_template(chart_mode)
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    write_rendered(rendered())
    return 0


if __name__ == "__main__":
    sys.exit(main())
