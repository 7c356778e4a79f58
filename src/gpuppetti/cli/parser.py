"""Every command's flags, with their env vars and defaults: what ``--help`` shows is what is checked.

Each command is a row of COMMANDS: its name, its help, and a table of its flags, in the order its ``--help`` lists
them; the flags several commands share are made by the small functions above it, so that they read alike
everywhere.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from gpuppetti import __version__
from gpuppetti.base.nodepaths import (
    DEFAULT_CDI_DIR,
    DEFAULT_DEVICE_PLUGIN_DIR,
    DEFAULT_HTTP_ADDRESS,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_REGISTRY_DIR,
    DEFAULT_VULKAN_LAYER_DIR,
)
from gpuppetti.cli import installer, values
from gpuppetti.cli.options import OneOf, Opt, Parser, Plain, Repeated, Row, Switch, add_rows
from gpuppetti.commands.manifests import DEFAULT_IMAGE, DEFAULT_NAMESPACE, RESOURCES
from gpuppetti.core.config import BACKENDS, CONFIG_ENV

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_AGENT_LISTEN = "127.0.0.1:9410"
DEFAULT_API_TIMEOUT_S = 10.0

EXIT_CODES = """\
exit codes:
  0    done, or stopped cleanly by SIGTERM or SIGINT
  1    could not run: a directory, port or backend it cannot use; a failed check
  2    bad input: a flag, an env var or the config file (the message names it)
  130  interrupted by Ctrl-C before it was running
"""



def _log_level(default: str = "info") -> Opt:
    return Opt(("--log-level",), env="GPUPPETTI_LOG_LEVEL", convert=values.choice(*LOG_LEVELS), default=default,
               metavar="LEVEL", help=f"log verbosity: {', '.join(LOG_LEVELS)}")


def _config(what_default: str) -> Opt:
    return Opt(("--config",), env=CONFIG_ENV, convert=values.path, metavar="PATH", shown_default=what_default,
               help="YAML config file with 'version: v1'")


_HTTP = Opt(("--http-address",), env="GPUPPETTI_HTTP_ADDRESS", convert=values.http_address,
            default=DEFAULT_HTTP_ADDRESS, metavar="HOST:PORT", empty_is_value=True,
            help="where to serve /healthz (ready once registered), /livez, /metrics and /v1/gpus: the only TCP "
            "listener; [::1]:9400 for IPv6, :9400 for every address, '' turns it off")


def _cdi_dir(what: str) -> Opt:
    return Opt(("--cdi-dir",), env="GPUPPETTI_CDI_DIR", convert=values.cdi_directory, default=DEFAULT_CDI_DIR,
               metavar="DIR", help=what)


def _resources(kind: str) -> str:
    return ",".join(f"{name}={quantity}" for name, quantity in RESOURCES[kind].items())


_VULKAN_LAYER_DIR = Opt(
    ("--vulkan-layer-dir",), env="GPUPPETTI_VULKAN_LAYER_DIR", convert=values.host_directory,
    default=DEFAULT_VULKAN_LAYER_DIR, metavar="DIR", empty_is_value=True,
    help="where the Vulkan layer that enforces slices is installed, and each allocation's ledger served; "
    "containers mount it; '' turns enforcement off")


def _instance(sockets: str, outcome: str) -> Opt:
    return Opt(("--instance",), env="GPUPPETTI_INSTANCE", convert=values.instance_name, metavar="NAME",
               shown_default="none: the fixed socket names, one instance at a time",
               help=f"this instance's name (in a DaemonSet, the pod's UID): its sockets are named for it ({sockets}), "
               f"so that during a rolling update the new instance serves beside the old one and the kubelet {outcome}")


def _node_name(what: str) -> Opt:
    return Opt(("--node-name",), env="NODE_NAME", convert=values.node_name, metavar="NAME", help=what)


def _kubeconfig(what: str) -> Opt:
    return Opt(("--kubeconfig",), env="KUBECONFIG", convert=values.kubeconfig, metavar="PATH",
               shown_default="the in-cluster service account", help=what)


_DISCOVERY = (
    Opt(("--backend",), env="GPUPPETTI_BACKEND", convert=values.choice(*BACKENDS), metavar="NAME",
        shown_default="the config's backend, else auto",
        help=f"discovery backend: {', '.join(BACKENDS)}; auto runs every backend that can run here"),
    Opt(("--host-root",), env="GPUPPETTI_HOST_ROOT", convert=values.directory, metavar="DIR", default=Path("/"),
        help="where the host's /sys, /dev and /proc are mounted, e.g. /host in a DaemonSet"),
    Opt(("--host-agent",), env="GPUPPETTI_HOST_AGENT", convert=values.http_url, metavar="URL",
        shown_default="the config's hostAgent.url",
        help="a gpuppetti host-agent on the Mac, e.g. http://host.minikube.internal:9410, whose facts (model, "
        "cores, memory) the virtio-gpu takes"),
    Opt(("--host-agent-token-file",), env="GPUPPETTI_HOST_AGENT_TOKEN_FILE", convert=values.path, metavar="FILE",
        shown_default="the config's hostAgent.tokenFile", help="the host agent's bearer token"),
)
_DAEMON_ADDRESS = "as a URL or as its --http-address (:9400 means this machine)"


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    description: str
    rows: tuple[Row, ...]


COMMANDS = (
    Command(
        "plugin", "serve GPUs to the kubelet as a device plugin (Device Plugin API v1beta1)",
        "Serve the node's GPUs, whole or time-sliced, to the kubelet through the Device Plugin API v1beta1: one "
        "socket per extended resource, re-registered whenever the kubelet restarts. SIGHUP reloads the config; "
        "SIGTERM or SIGINT removes the sockets and exits 0.",
        (
            _config("built-in defaults: whole GPUs, no sharing"),
            Opt(("--device-plugin-dir",), env="GPUPPETTI_DEVICE_PLUGIN_DIR", convert=values.path,
                default=DEFAULT_DEVICE_PLUGIN_DIR, metavar="DIR",
                help="the kubelet's device plugin directory, holding kubelet.sock"),
            _cdi_dir("where the CDI spec goes when plugin.deviceListStrategy includes a CDI strategy"),
            _instance("gpuppetti-RESOURCE-NAME.sock", "is left without the resource as briefly as it allows"),
            Switch("--label-node", env="GPUPPETTI_LABEL_NODE",
                   help="label this node with its GPU (gpuppetti.dev/gpu.vendor, .model, .cores, .memory, .count, "
                   ".replicas, .sharing-strategy) and keep the labels current; needs --node-name and RBAC to get "
                   "and patch its Node"),
            _VULKAN_LAYER_DIR,
            _node_name("this node's name, for --label-node"),
            _kubeconfig("kubeconfig for --label-node"),
            *_DISCOVERY,
            _HTTP,
            _log_level(),
        ),
    ),
    Command(
        "dra", "serve GPUs through Dynamic Resource Allocation (resource.k8s.io/v1, kubelet DRA v1/v1beta1)",
        "Publish the node's GPUs as ResourceSlices (whole, as partitions, or as consumable capacity, per the "
        "config's dra section), register with the kubelet's plugin watcher, and prepare claims by writing one CDI "
        "spec per claim. Prepared claims survive restarts in a checkpoint. SIGHUP reloads the config; SIGTERM or "
        "SIGINT unregisters and exits 0.",
        (
            _config("built-in defaults: whole GPUs"),
            _node_name("this node's name, which is also the pool name (required)"),
            Opt(("--registry-dir",), env="GPUPPETTI_REGISTRY_DIR", convert=values.path,
                default=DEFAULT_REGISTRY_DIR, metavar="DIR", help="the kubelet's plugin registry directory"),
            Opt(("--plugins-dir",), env="GPUPPETTI_PLUGINS_DIR", convert=values.path, default=DEFAULT_PLUGINS_DIR,
                metavar="DIR", help="where the driver's socket and checkpoint go, under <driver>/"),
            _instance("dra-NAME.sock, DRIVER-NAME-reg.sock", "loses no claim"),
            _cdi_dir("where the per-claim CDI specs are written"),
            _VULKAN_LAYER_DIR,
            _kubeconfig("kubeconfig for the API server"),
            Opt(("--api-timeout",), env="GPUPPETTI_API_TIMEOUT", convert=values.seconds,
                default=DEFAULT_API_TIMEOUT_S, shown_default="10", metavar="SECONDS",
                help="the longest one request to the API server may take, connect to last byte; a claim read that "
                "takes longer fails that claim, and the kubelet retries"),
            *_DISCOVERY,
            _HTTP,
            _log_level(),
        ),
    ),
    Command(
        "discover", "show the GPUs this node has, as the plugin would serve them",
        "Run the discovery backends and print what they found: vendor, model, cores, memory, device nodes, NUMA "
        "node, health and backend, and the resource each GPU would be advertised under. Exits 1 when nothing is "
        "found, saying what was looked at.",
        (
            _config("built-in defaults"),
            *_DISCOVERY,
            Switch("--json", help="print a JSON list instead of a table"),
            Opt(("--from",), convert=values.daemon_address, metavar="ADDRESS",
                help="show what a running plugin or DRA driver serves instead of discovering here, from its HTTP "
                f"endpoint, {_DAEMON_ADDRESS}: its GPUs' health and whether their facts are stale"),
            _log_level("warning"),
        ),
    ),
    Command(
        "top", "watch a node's GPU slices live: who holds each, its memory used of its budget, its compute wait",
        "Show, from a running plugin or DRA driver's HTTP endpoint, each GPU and the slices containers hold of "
        "it: the namespace/pod/container holding each, the memory its processes use of its budget (as the Vulkan "
        "layer counts it) and how long its submits waited for its share of the GPU's time. Redraws every "
        "--interval seconds until Ctrl-C. In a cluster: kubectl exec -n gpuppetti ds/gpuppetti-device-plugin -- "
        "gpuppetti top (or ds/gpuppetti-dra).",
        (
            Opt(("--from",), env="GPUPPETTI_HTTP_ADDRESS", convert=values.daemon_address, metavar="ADDRESS",
                default="http://127.0.0.1:9400", shown_default="http://127.0.0.1:9400, the daemons' default",
                help=f"the daemon's HTTP endpoint, {_DAEMON_ADDRESS}"),
            Opt(("--interval",), convert=values.seconds, default=2.0, shown_default="2", metavar="SECONDS",
                help="how often to redraw"),
            Switch("--once", help="print the view once and exit (for scripts)"),
            Switch("--json", help="print the GPUs and slices once as JSON and exit"),
            _log_level("warning"),
        ),
    ),
    Command(
        "doctor", "check this node for what gpuppetti needs, and say how to fix what is missing",
        "Check, on a node or inside the plugin's pod, everything gpuppetti depends on: the GPUs and the backend "
        "that finds them, the kubelet's directories and sockets, the container runtime (through its CRI socket: "
        "name, version, and whether it applies CDI devices, without which DRA claims reach no container), the CDI "
        "directory, the Vulkan loader and drivers for enforced slices, the host agent, a running daemon's "
        "/healthz, and which of the DRA driver's features the cluster's version and feature gates allow. Prints one "
        "line per check, and the fix for each that fails. Exits 1 when a check fails.",
        (
            _config("built-in defaults"),
            *_DISCOVERY,
            Opt(("--device-plugin-dir",), env="GPUPPETTI_DEVICE_PLUGIN_DIR", convert=values.path,
                default=DEFAULT_DEVICE_PLUGIN_DIR, metavar="DIR", help="the kubelet's device plugin directory"),
            Opt(("--registry-dir",), env="GPUPPETTI_REGISTRY_DIR", convert=values.path,
                default=DEFAULT_REGISTRY_DIR, metavar="DIR", help="the kubelet's plugin registry directory"),
            _cdi_dir("the CDI directory the daemons write"),
            _VULKAN_LAYER_DIR,
            Opt(("--runtime-endpoint",), env="CONTAINER_RUNTIME_ENDPOINT", convert=values.endpoint,
                metavar="SOCKET", help="the container runtime's CRI socket, as crictl takes it",
                shown_default="the first of containerd's, CRI-O's, cri-dockerd's and k3s's sockets found, under "
                "--host-root too"),
            Opt(("--containerd-address",), env="CONTAINERD_ADDRESS", convert=values.endpoint, metavar="SOCKET",
                shown_default="none: the usual sockets only",
                help="containerd's socket, as ctr takes it; without --runtime-endpoint it is looked at first "
                "(under --host-root too), before the usual sockets"),
            Opt(("--mode",), env="GPUPPETTI_MODE", convert=values.mode("plugin", "dra", "both"), default="both",
                metavar="MODE", help="what this node runs: plugin, dra or both; the other's kubelet directory is "
                "not checked (the DaemonSets set it in their pods)"),
            Opt(("--daemon",), env="GPUPPETTI_HTTP_ADDRESS", convert=values.daemon_address, metavar="ADDRESS",
                shown_default="none: not checked",
                help="a running plugin or DRA driver's HTTP endpoint, as a URL (http://127.0.0.1:9400) or its "
                "--http-address (:9400 means this machine), whose /healthz to ask"),
            _kubeconfig("the API server whose version and feature gates to check; in a pod, its service account"),
            Switch("--json", help="print the checks as JSON"),
            _log_level("warning"),
        ),
    ),
    Command(
        "manifests", "print ready-to-apply YAML for a cluster (gpuppetti manifests | kubectl apply -f -)",
        "Print the Namespace, ConfigMap, DaemonSet (and for DRA the RBAC and DeviceClasses) that run gpuppetti on "
        "the nodes labelled gpuppetti.dev/mode=<mode> (every node with --preset minikube-krunkit); the labelling "
        "command goes to stderr. The same objects as `kubectl kustomize deploy/base/<mode>` and the overlays.",
        (
            Plain("--mode", convert=values.mode("plugin", "dra"), default="plugin", metavar="MODE",
                  help="plugin (the device plugin) or dra (the DRA driver) (default plugin)"),
            Opt(("--replicas",), convert=values.count(1, 1024), metavar="N", shown_default="no time-slicing",
                help="device plugin: time-slice every GPU into N replicas, under every vendor's default resource "
                "name"),
            Opt(("--image",), convert=values.image, default=DEFAULT_IMAGE, metavar="IMAGE",
                help="the gpuppetti image to run (build it with `make image`)"),
            Opt(("--namespace",), convert=values.namespace, default=DEFAULT_NAMESPACE, metavar="NS",
                help="the namespace to run in"),
            Switch("--label-node", help="device plugin: label each node with its GPU, with the RBAC to patch Nodes"),
            Opt(("--image-pull-policy",), convert=values.choice("Always", "IfNotPresent", "Never"),
                metavar="POLICY", shown_default="Kubernetes' own: IfNotPresent, or Always for :latest",
                help="when the kubelet pulls the image: Always, IfNotPresent or Never"),
            Repeated("--node-selector", convert=values.label, metavar="KEY=VALUE",
                     help="run only on nodes with this label too, besides gpuppetti.dev/mode"),
            Repeated("--toleration", convert=values.toleration, metavar="KEY[=VALUE][:EFFECT]",
                     help="tolerate this taint (kubectl taint's syntax; no VALUE: any value, no EFFECT: every "
                     "effect), instead of the default tolerations (CriticalAddonsOnly and the GPU resources' "
                     "NoSchedule taints)"),
            Opt(("--requests",), convert=values.resource_list, metavar="cpu=Q,memory=Q",
                default=values.UNGIVEN, shown_default=_resources("requests"),
                help="what the daemon's container asks for, merged into the default (kubectl set resources' "
                "syntax); none for nothing"),
            Opt(("--limits",), convert=values.resource_list, metavar="cpu=Q,memory=Q",
                default=values.UNGIVEN, shown_default=_resources("limits"),
                help="what the daemon's container is held to, merged into the default; none for no limit"),
            Opt(("--vulkan-layer-dir",), convert=values.host_directory, default=DEFAULT_VULKAN_LAYER_DIR,
                metavar="DIR",
                help="where the daemon installs the Vulkan layer on each node (a hostPath); '' turns enforcement "
                "off"),
            # Accepted for one more release, and said to do nothing (cli.tools.BOUND_DIRS_GONE).
            Switch("--bound-allocation-dirs", help=argparse.SUPPRESS),
            OneOf((
                Plain("--preset", convert=values.choice("minikube-krunkit"), default=None, metavar="NAME",
                      help="a ready config: minikube-krunkit serves the VM's virtio-gpu as apple.com/gpu"),
                Plain("--config", convert=values.path, default=None, metavar="PATH",
                      help="put this config file in the ConfigMap (validated first)"),
            )),
            _log_level("warning"),
        ),
    ),
    Command(
        "host-agent", "on a Mac: serve its GPU's facts to the plugin inside a krunkit VM",
        "Serve the Mac's GPU inventory (model, cores, unified memory, Metal's recommended working set, Metal "
        "family, live utilisation and in-use memory) as JSON at /v1/gpus. Every request needs the bearer token, "
        "generated on first start and stored with mode 0600; a first start from a terminal prints the kubectl "
        "command that gives it to the cluster. Needs no root.",
        (
            Opt(("--listen",), env="GPUPPETTI_HOST_AGENT_LISTEN", convert=values.listen_address,
                default=DEFAULT_AGENT_LISTEN, metavar="ADDR:PORT",
                help="where to listen. The VM reaches the Mac at the address host.minikube.internal resolves to: "
                "listen there, or on 0.0.0.0:9410"),
            Opt(("--token-file",), env="GPUPPETTI_HOST_AGENT_TOKEN_FILE", convert=values.path, metavar="FILE",
                shown_default="host-agent.token in the user's config directory",
                help="where the token is kept, created with mode 0600 on first start"),
            Opt(("--interval",), convert=values.seconds, default=5.0, shown_default="5", metavar="SECONDS",
                help="how often to refresh utilisation and in-use memory from ioreg"),
            Opt(("--namespace",), convert=values.namespace, default=DEFAULT_NAMESPACE, metavar="NS",
                help="the namespace in the printed kubectl command"),
            _log_level(),
        ),
    ),
    Command(
        "demo", "run the plugin on simulated GPUs, or this node's own, against the built-in kubelet emulator",
        "Start the device plugin with the GPUs the config's backend finds (by default two simulated Apple M3 Max, "
        "40 cores, 4 slices each; backend drm for this node's own) against the built-in kubelet emulator in a "
        "temporary directory, admit a handful of pods, and print which pod got which slice and the device nodes "
        "and env it would see. Needs no cluster; simulated GPUs need no root or GPU.",
        (
            Opt(("--config",), convert=values.path, metavar="PATH", shown_default="the built-in demo config",
                help="YAML config: simulated GPUs, or a backend that finds this node's"),
            Opt(("--backend",), env="GPUPPETTI_BACKEND", convert=values.choice(*BACKENDS), metavar="NAME",
                shown_default="the config's backend", help=f"discovery backend: {', '.join(BACKENDS)}"),
            Opt(("--host-root",), env="GPUPPETTI_HOST_ROOT", convert=values.directory, metavar="DIR",
                default=Path("/"), help="where the host's /sys and /dev are mounted"),
            Plain("--runtime", convert=values.choice("podman"), default=None, metavar="RUNTIME",
                  help="podman: also run each admitted pod as a real container, applying its CDI devices, env, "
                  "device nodes and mounts, and show what it saw inside (needs root, podman, runc and "
                  "busybox-static)"),
            Opt(("--image",), convert=values.image, metavar="IMAGE",
                shown_default="one built from /bin/busybox; nothing is pulled",
                help="with --runtime podman: a local image with /bin/sh"),
            Switch("--keep-running",
                   help="once the pods are admitted, keep the plugin running and serve its HTTP endpoint "
                   "(/metrics, /v1/gpus, /v1/slices) until Ctrl-C, for `gpuppetti top` to show its slices"),
            Opt(("--http-address",), env="GPUPPETTI_HTTP_ADDRESS", convert=values.http_address,
                default=DEFAULT_HTTP_ADDRESS, metavar="HOST:PORT",
                help="with --keep-running: where to serve, as the daemons do (gpuppetti top's default --from)"),
            _log_level("warning"),
        ),
    ),
)


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuppetti",
        description="GPU sharing for Kubernetes that does not assume NVIDIA: finds a node's GPUs, slices them, "
        "and offers the slices to the kubelet.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"gpuppetti {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    def command(name: str, help: str, description: str) -> Parser:
        sub: Parser = commands.add_parser(name, help=help, description=description, epilog=EXIT_CODES)
        parser.commands[name] = sub
        return sub

    for spec in COMMANDS:
        add_rows(command(spec.name, spec.help, spec.description), spec.rows)
    installer.register(command)
    return parser
