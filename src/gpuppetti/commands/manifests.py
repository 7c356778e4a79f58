"""Ready-to-apply cluster manifests for both modes: the one source of the deploy objects. The kustomize bases under
deploy/base and the Helm chart's templates are rendered from here (`make deploy`).

The containers run as root because the kubelet's sockets and directories belong to root; they drop every
capability, cannot escalate, and have a read-only root filesystem. Both mount the host's root read-only under
/host and /var/run/cdi read-write; the device plugin also mounts the kubelet's device plugin directory, the DRA
driver the plugin registry and its plugin directory. They run only on nodes labelled gpuppetti.dev/mode=plugin or
=dra.
"""

from __future__ import annotations

import copy
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from gpuppetti.base.nodepaths import DEFAULT_VULKAN_LAYER_DIR
from gpuppetti.core.config import parse_config
from gpuppetti.core.model import DEFAULT_RESOURCE_NAMES, FALLBACK_RESOURCE_NAME, Vendor

Mode = Literal["plugin", "dra"]
DEFAULT_NAMESPACE = "gpuppetti"
# Built from this repository (`make image`): no registry publishes gpuppetti's image yet.
DEFAULT_IMAGE = "localhost/gpuppetti:dev"
HTTP_PORT = 9400
LABELS = {"app.kubernetes.io/name": "gpuppetti", "app.kubernetes.io/part-of": "gpuppetti"}
COMPONENTS: dict[Mode, str] = {"plugin": "device-plugin", "dra": "dra"}
CONFIG_PATH = "/etc/gpuppetti/config.yaml"
HOST_ROOT = "/host"
DRIVER = "gpu.gpuppetti.dev"
ALL_RESOURCES = (*DEFAULT_RESOURCE_NAMES.values(), FALLBACK_RESOURCE_NAME)
# The node label an operator sets on GPU nodes: which of the two modes runs there (one per node).
MODE_LABEL = "gpuppetti.dev/mode"
# Per-vendor DeviceClasses: the vendors' devices, and the extended resource a device plugin would advertise.
VENDOR_CLASSES: dict[str, tuple[tuple[str, ...], str]] = {
    **{vendor.value: ((vendor.value,), name) for vendor, name in DEFAULT_RESOURCE_NAMES.items()},
    "generic": ((Vendor.VIRTIO.value, Vendor.OTHER.value), FALLBACK_RESOURCE_NAME),
}
# The GPU taints operators put on GPU nodes, and the critical-addons taint: not every taint, so that a node
# tainted for other reasons (maintenance, another team's hardware) is left alone.
TOLERATIONS: list[dict[str, str]] = [
    {"key": "CriticalAddonsOnly", "operator": "Exists"},
    *({"key": name, "operator": "Exists", "effect": "NoSchedule"} for name in ALL_RESOURCES),
]
# What each daemon's container asks for, and is held to.
RESOURCES: dict[str, dict[str, str]] = {"requests": {"cpu": "10m", "memory": "64Mi"},
                                        "limits": {"cpu": "200m", "memory": "192Mi"}}



def merged_resources(overrides: Mapping[str, Mapping[str, str] | None]) -> dict[str, dict[str, str]]:
    """The default resources with ``overrides`` merged in as Helm merges values: a kind's quantities by name, and
    None for a kind takes it out."""
    merged = copy.deepcopy(RESOURCES)
    for kind, quantities in overrides.items():
        if quantities is None:
            merged.pop(kind, None)
        else:
            merged.setdefault(kind, {}).update(quantities)
    return merged


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
    """What the objects are rendered for. The command's flags set some; the Helm chart's values set them all."""

    mode: Mode = "plugin"
    namespace: str = DEFAULT_NAMESPACE
    image: str = DEFAULT_IMAGE
    # None leaves it to Kubernetes: IfNotPresent, or Always for an untagged image or one tagged latest.
    image_pull_policy: str | None = None
    config: str | None = None
    replicas: int | None = None
    label_node: bool = False
    # The mode label in the node selector. Off for a single-node sandbox (the minikube preset): the one node is the
    # GPU node.
    node_selector: bool = True
    # Labels a node must have besides the mode label (which one of these may override).
    extra_node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = field(default_factory=lambda: copy.deepcopy(TOLERATIONS))
    resources: Mapping[str, Any] = field(default_factory=lambda: copy.deepcopy(RESOURCES))
    # Where the Vulkan layer is installed on the node; empty turns enforcement off (and mounts nothing).
    vulkan_layer_dir: str = str(DEFAULT_VULKAN_LAYER_DIR)


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


def _metadata(name: str, namespace: str | None, component: str | None) -> dict[str, Any]:
    labels = {**LABELS, "app.kubernetes.io/component": component} if component else dict(LABELS)
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if namespace is not None:
        metadata["namespace"] = namespace
    return metadata


def config_map_name(mode: Mode) -> str:
    # One per mode: applying both bases must not let one mode's config replace the other's.
    return f"gpuppetti-{COMPONENTS[mode]}-config"


def _host_path(name: str, path: str, kind: str = "Directory") -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": path, "type": kind}}


SCRAPE_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
                      "prometheus.io/path": "/metrics"}


def _daemonset(options: Options, component: str, args: list[str], mounts: list[dict[str, Any]],
               volumes: list[dict[str, Any]], service_account: str | None) -> dict[str, Any]:
    name = f"gpuppetti-{component}"
    selector = {"app.kubernetes.io/name": "gpuppetti", "app.kubernetes.io/component": component}
    env = _env(options)
    probe_port = {"port": HTTP_PORT}
    container: dict[str, Any] = {"name": component, "image": options.image}
    if options.image_pull_policy:
        container["imagePullPolicy"] = options.image_pull_policy
    container |= {
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": HTTP_PORT}],
        "readinessProbe": {"httpGet": {"path": "/healthz", **probe_port}, "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/livez", **probe_port}, "initialDelaySeconds": 10,
                          "periodSeconds": 20},
        "resources": copy.deepcopy(dict(options.resources)),
        "securityContext": _security_context(options),
        "volumeMounts": [{"name": "config", "mountPath": "/etc/gpuppetti", "readOnly": True}, *mounts],
    }
    spec: dict[str, Any] = {
        "priorityClassName": "system-node-critical",
        "tolerations": copy.deepcopy(list(options.tolerations)),
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": config_map_name(options.mode)}}, *volumes],
    }
    # Only where an operator said GPUs are, and one mode per node: the device plugin and the DRA driver never serve
    # the same resource name on one node.
    node_selector: dict[str, str] = {MODE_LABEL: options.mode} if options.node_selector else {}
    node_selector |= options.extra_node_selector
    if node_selector:
        spec["nodeSelector"] = node_selector
    if service_account:
        spec["serviceAccountName"] = service_account
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _metadata(name, options.namespace, component),
        "spec": {
            "selector": {"matchLabels": selector},
            # The new pod starts beside the old one (sockets named for each, kit.instances), and the old one goes
            # once the new one is ready: the kubelet always has an instance to serve it.
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            # Prometheus's kubernetes_sd pod role reads these (deploy/grafana has a dashboard over what it scrapes).
            "template": {"metadata": {"labels": {**LABELS, **selector}, "annotations": SCRAPE_ANNOTATIONS},
                         "spec": spec},
        },
    }


def _security_context(options: Options) -> dict[str, Any]:
    return {"runAsUser": 0, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def _host_mounts() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # The host's root, read-only: /sys and /dev for DRM, /proc/driver/nvidia for NVIDIA's UUIDs and minor numbers,
    # and the driver's libnvidia-ml.so.1 for NVML, wherever the distribution keeps it.
    mounts = [{"name": "host-root", "mountPath": HOST_ROOT, "readOnly": True}]
    volumes = [_host_path("host-root", "/")]
    return mounts, volumes


def _env(options: Options) -> list[dict[str, Any]]:
    """The settings as env vars rather than flags: every gpuppetti command run in the pod (`kubectl exec ...
    gpuppetti doctor`, `discover`) then sees the node as the daemon does, with nothing to repeat."""
    settings = {
        "GPUPPETTI_CONFIG": CONFIG_PATH,
        "GPUPPETTI_HOST_ROOT": HOST_ROOT,
        # Every address of the pod: the probes reach it on the pod IP (IPv4 or IPv6), and
        # `gpuppetti discover --from http://127.0.0.1:9400` works from inside the pod.
        "GPUPPETTI_HTTP_ADDRESS": f":{HTTP_PORT}",
        # Which of the node's checks `gpuppetti doctor` makes in this pod.
        "GPUPPETTI_MODE": options.mode,
        # Where the layer goes ('' turns enforcement off), for the daemon and `gpuppetti doctor` alike.
        "GPUPPETTI_VULKAN_LAYER_DIR": options.vulkan_layer_dir,
    }
    if options.mode == "plugin" and options.label_node:
        settings["GPUPPETTI_LABEL_NODE"] = "true"
    # The pod's UID names its sockets: a rolling update's two pods serve side by side.
    return [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "GPUPPETTI_INSTANCE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            *({"name": key, "value": value} for key, value in settings.items())]


def _layer_mount(options: Options) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    # Where the Vulkan layer is installed and each allocation's ledger served: at the same path as on the host,
    # since the mounts the daemon hands to containers name host paths. Nothing where enforcement is off.
    path = options.vulkan_layer_dir
    if not path:
        return []
    mount: dict[str, Any] = {"name": "vulkan-layer", "mountPath": path}
    return [(mount, _host_path("vulkan-layer", path, "DirectoryOrCreate"))]


def _cdi_mount() -> tuple[dict[str, Any], dict[str, Any]]:
    return {"name": "cdi", "mountPath": "/var/run/cdi"}, _host_path("cdi", "/var/run/cdi", "DirectoryOrCreate")


def device_plugin(options: Options) -> list[dict[str, Any]]:
    mounts, volumes = _host_mounts()
    mounts.insert(0, {"name": "device-plugins", "mountPath": "/var/lib/kubelet/device-plugins"})
    volumes.insert(0, _host_path("device-plugins", "/var/lib/kubelet/device-plugins"))
    # Where the CDI spec goes with a CDI deviceListStrategy; the runtime reads it on the host.
    for mount, volume in (_cdi_mount(), *_layer_mount(options)):
        mounts.append(mount)
        volumes.append(volume)
    # The host agent's token, where a Mac runs one; optional, so that nodes without it start the same.
    mounts.append({"name": "host-agent-token", "mountPath": "/var/run/secrets/gpuppetti-host-agent",
                   "readOnly": True})
    volumes.append({"name": "host-agent-token", "secret": {"secretName": "gpuppetti-host-agent", "optional": True}})
    args = ["plugin"]
    objects: list[dict[str, Any]] = []
    account = None
    if options.label_node:
        account = "gpuppetti-device-plugin"
        objects += [
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": _metadata(account, options.namespace, "device-plugin")},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": _metadata(account, None, "device-plugin"),
             # Only get and patch: the plugin reads its Node and merges its gpuppetti.dev/gpu. labels.
             "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": _metadata(account, None, "device-plugin"),
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": account},
             "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": options.namespace}]},
        ]
    return [*objects, _daemonset(options, "device-plugin", args, mounts, volumes, account)]


def _device_class(name: str, expression: str, extended_resource: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": expression}}]}
    if extended_resource:
        # A pod asking for this resource in its limits is served by DRA on nodes where no device plugin
        # advertises it (DRAExtendedResource).
        spec["extendedResourceName"] = extended_resource
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": _metadata(name, None, "dra"),
            "spec": spec}


def device_classes() -> list[dict[str, Any]]:
    """The generic class, the partition class, and one class per vendor named after its extended resource."""
    driver = f"device.driver == '{DRIVER}'"
    attrs = f"device.attributes['{DRIVER}']"
    # What a claim that names no partition gets: a whole GPU, or on a partitions node the device the driver marks
    # byDefault (dra.defaultPartition), so that a plain resources.limits is served whatever the node's slicing.
    whole = f"('byDefault' in {attrs} ? {attrs}.byDefault : (!('partitions' in {attrs}) || {attrs}.partitions == 1))"
    classes = [
        _device_class(DRIVER, driver),
        _device_class(f"partition.{DRIVER}", f"{driver} && 'partitions' in {attrs} && {attrs}.partitions > 1"),
    ]
    for name, (vendors, resource) in VENDOR_CLASSES.items():
        chosen = " || ".join(f"{attrs}.vendor == '{vendor}'" for vendor in vendors)
        classes.append(_device_class(f"{name}.{DRIVER}", f"{driver} && ({chosen}) && {whole}", resource))
    return classes


def dra_driver(options: Options) -> list[dict[str, Any]]:
    namespace = options.namespace
    mounts, volumes = _host_mounts()
    for name, path, kind in (("plugins-registry", "/var/lib/kubelet/plugins_registry", "Directory"),
                             ("plugins", "/var/lib/kubelet/plugins", "Directory")):
        mounts.insert(0, {"name": name, "mountPath": path})
        volumes.insert(0, _host_path(name, path, kind))
    cdi_mount, cdi_volume = _cdi_mount()
    mounts.insert(0, cdi_mount)
    volumes.insert(0, cdi_volume)
    for layer_mount, layer_volume in _layer_mount(options):
        mounts.append(layer_mount)
        volumes.append(layer_volume)
    account = "gpuppetti-dra"
    rbac: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(account, namespace, "dra")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": _metadata(account, None, "dra"),
         "rules": [
             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
              "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
             # list: a kubelet call that names many claims of one namespace reads them in one request.
             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get", "list"]},
             # The claims' status.devices entries of the devices it prepares, applied server-side: the status
             # subresource, and (Kubernetes 1.36's granular status authorization) this driver's entries on claims
             # of its own node only.
             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"], "verbs": ["patch"]},
             {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"], "resourceNames": [DRIVER],
              "verbs": ["associated-node:patch"]},
             {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": _metadata(account, None, "dra"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": account},
         "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]},
    ]
    args = ["dra"]
    return [*rbac, *device_classes(), _daemonset(options, "dra", args, mounts, volumes, account)]


def render(options: Options) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": _metadata(options.namespace, None, None)},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": _metadata(config_map_name(options.mode), options.namespace, COMPONENTS[options.mode]),
         "data": {"config.yaml": _config_text(options)}},
    ]
    objects += device_plugin(options) if options.mode == "plugin" else dra_driver(options)
    return objects


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False, width=120)
