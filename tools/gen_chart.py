"""Render the Helm chart's generated files under deploy/helm/gpuppetti: values.yaml (with `gpuppetti manifests`'
defaults), values.schema.json (from the config model and the rules of gpuppetti.base.syntax) and Chart.yaml.

The templates are written by hand, one object per file, as Helm templates. tests/unit/test_helm_chart.py renders
the chart with Helm and compares it with `gpuppetti manifests`, object by object: that is what keeps the two in
step. It also fails when a file here is stale (`make deploy`).
"""

from __future__ import annotations

import argparse
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
        "{{/* Generated by tools/gen_chart.py from gpuppetti.base.nodepaths: `make deploy` rewrites it. */}}",
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


def rendered() -> dict[Path, str]:
    files = {
        CHART / "templates" / "_layerdir.tpl": layer_dir_template(),
        CHART / "Chart.yaml": chart_yaml(),
        CHART / "values.yaml": values_yaml(),
        CHART / "values.schema.json": json.dumps(values_schema(), indent=2) + "\n",
    }
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    write_rendered(rendered())
    return 0


if __name__ == "__main__":
    sys.exit(main())
