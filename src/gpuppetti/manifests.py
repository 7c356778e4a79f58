"""Ready-to-apply cluster manifests for both modes; the kustomize bases under deploy/ are rendered from here.

The containers run as root because the kubelet's sockets and directories belong to root; they drop every
capability, cannot escalate, and have a read-only root filesystem. The device plugin mounts the kubelet's device
plugin directory read-write and the host's /sys and /dev read-only; the DRA driver also needs the plugin registry,
its plugin directory and /var/run/cdi, where it writes CDI specs.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from gpuppetti import __version__
from gpuppetti.config import parse_config
from gpuppetti.model import DEFAULT_RESOURCE_NAMES, FALLBACK_RESOURCE_NAME

Mode = Literal["plugin", "dra"]
DEFAULT_NAMESPACE = "gpuppetti"
DEFAULT_IMAGE = f"ghcr.io/gpuppetti/gpuppetti:{__version__}"
HTTP_PORT = 9400
LABELS = {"app.kubernetes.io/name": "gpuppetti", "app.kubernetes.io/part-of": "gpuppetti"}
CONFIG_PATH = "/etc/gpuppetti/config.yaml"
DRIVER = "gpu.gpuppetti.dev"
ALL_RESOURCES = (*DEFAULT_RESOURCE_NAMES.values(), FALLBACK_RESOURCE_NAME)

PRESETS: dict[str, str] = {
    # minikube --driver krunkit on an Apple silicon Mac: the Mac's GPU is the VM's virtio-gpu (Vulkan via Venus).
    "minikube-krunkit": textwrap.dedent("""\
        version: v1
        backend: drm
        virtio:
          vendor: apple
        # The Mac's own facts (model, cores, memory), from `gpuppetti host-agent` on the Mac, once its token is in
        # the gpuppetti-host-agent Secret; until then the plugin serves the virtio GPU as configured here.
        hostAgent:
          url: http://host.minikube.internal:9410
        sharing:
          timeSlicing:
            resources:
              - name: apple.com/gpu
                replicas: {replicas}
        """),
}
PRESET_REPLICAS = 4


def preset_config(name: str, replicas: int | None) -> str:
    return PRESETS[name].format(replicas=replicas or PRESET_REPLICAS)


@dataclass(frozen=True)
class Options:
    mode: Mode = "plugin"
    namespace: str = DEFAULT_NAMESPACE
    image: str = DEFAULT_IMAGE
    config: str | None = None
    replicas: int | None = None
    label_node: bool = False


def default_config(replicas: int | None) -> str:
    text = "version: v1\n"
    if replicas and replicas > 1:
        text += "sharing:\n  timeSlicing:\n    resources:\n"
        text += "".join(f"      - name: {name}\n        replicas: {replicas}\n" for name in ALL_RESOURCES)
    return text


def _config_text(options: Options) -> str:
    text = options.config if options.config is not None else default_config(options.replicas)
    # A manifest with a broken config would only fail on the node; fail here instead.
    parse_config(text, "the generated config")
    return text


def _metadata(name: str, namespace: str | None, component: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": {**LABELS, "app.kubernetes.io/component": component}}
    if namespace is not None:
        metadata["namespace"] = namespace
    return metadata


def _host_path(name: str, path: str, kind: str = "Directory") -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": path, "type": kind}}


def _daemonset(options: Options, component: str, args: list[str], mounts: list[dict[str, Any]],
               volumes: list[dict[str, Any]], service_account: str | None) -> dict[str, Any]:
    name = f"gpuppetti-{component}"
    selector = {"app.kubernetes.io/name": "gpuppetti", "app.kubernetes.io/component": component}
    env = [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    probe_port = {"port": HTTP_PORT}
    container: dict[str, Any] = {
        "name": component,
        "image": options.image,
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": HTTP_PORT}],
        "readinessProbe": {"httpGet": {"path": "/healthz", **probe_port}, "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/livez", **probe_port}, "initialDelaySeconds": 10,
                          "periodSeconds": 20},
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"cpu": "200m", "memory": "192Mi"}},
        "securityContext": {
            "runAsUser": 0,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "config", "mountPath": "/etc/gpuppetti", "readOnly": True}, *mounts],
    }
    spec: dict[str, Any] = {
        "priorityClassName": "system-node-critical",
        "tolerations": [{"operator": "Exists"}],
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": "gpuppetti-config"}}, *volumes],
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _metadata(name, options.namespace, component),
        "spec": {
            "selector": {"matchLabels": selector},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": {**LABELS, **selector}}, "spec": spec},
        },
    }


def _host_mounts() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    mounts = [
        {"name": "host-sys", "mountPath": "/host/sys", "readOnly": True},
        {"name": "host-dev", "mountPath": "/host/dev", "readOnly": True},
    ]
    volumes = [_host_path("host-sys", "/sys"), _host_path("host-dev", "/dev")]
    return mounts, volumes


def _common_args() -> list[str]:
    return ["--config", CONFIG_PATH, "--host-root", "/host", "--http-address", f"$(POD_IP):{HTTP_PORT}"]


def device_plugin(options: Options) -> list[dict[str, Any]]:
    mounts, volumes = _host_mounts()
    mounts.insert(0, {"name": "device-plugins", "mountPath": "/var/lib/kubelet/device-plugins"})
    volumes.insert(0, _host_path("device-plugins", "/var/lib/kubelet/device-plugins"))
    # The host agent's token, where a Mac runs one; optional, so that nodes without it start the same.
    mounts.append({"name": "host-agent-token", "mountPath": "/var/run/secrets/gpuppetti-host-agent",
                   "readOnly": True})
    volumes.append({"name": "host-agent-token", "secret": {"secretName": "gpuppetti-host-agent", "optional": True}})
    args = ["plugin", *_common_args()]
    objects: list[dict[str, Any]] = []
    account = None
    if options.label_node:
        account = "gpuppetti-device-plugin"
        args.append("--label-node")
        objects += [
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": _metadata(account, options.namespace, "device-plugin")},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": _metadata(account, None, "device-plugin"),
             # Only get and patch: the plugin reads its Node and merges its gpuppetti.dev/ labels.
             "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": _metadata(account, None, "device-plugin"),
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": account},
             "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": options.namespace}]},
        ]
    return [*objects, _daemonset(options, "device-plugin", args, mounts, volumes, account)]


def dra_driver(options: Options) -> list[dict[str, Any]]:
    namespace = options.namespace
    mounts, volumes = _host_mounts()
    for name, path, kind in (("plugins-registry", "/var/lib/kubelet/plugins_registry", "Directory"),
                             ("plugins", "/var/lib/kubelet/plugins", "Directory"),
                             ("cdi", "/var/run/cdi", "DirectoryOrCreate")):
        mounts.insert(0, {"name": name, "mountPath": path})
        volumes.insert(0, _host_path(name, path, kind))
    account = "gpuppetti-dra"
    rbac: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(account, namespace, "dra")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": _metadata(account, None, "dra"),
         "rules": [
             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
              "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
             {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": _metadata(account, None, "dra"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]},
    ]
    classes: list[dict[str, Any]] = [
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": _metadata(DRIVER, None, "dra"),
         "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}],
                  # A pod asking for apple.com/gpu in its limits can be served by DRA (DRAExtendedResource).
                  "extendedResourceName": "apple.com/gpu"}},
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
         "metadata": _metadata(f"partition.{DRIVER}", None, "dra"),
         "spec": {"selectors": [{"cel": {"expression": (
             f"device.driver == '{DRIVER}' && 'partitions' in device.attributes['{DRIVER}'] && "
             f"device.attributes['{DRIVER}'].partitions > 1")}}]}},
    ]
    args = ["dra", *_common_args(), "--node-name", "$(NODE_NAME)"]
    return [*rbac, *classes, _daemonset(options, "dra", args, mounts, volumes, account)]


def render(options: Options) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": _metadata(options.namespace, None, options.mode)},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": _metadata("gpuppetti-config", options.namespace, options.mode),
         "data": {"config.yaml": _config_text(options)}},
    ]
    objects += device_plugin(options) if options.mode == "plugin" else dra_driver(options)
    return objects


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False, width=120)
