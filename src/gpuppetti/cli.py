"""The ``gpuppetti`` command line."""

from __future__ import annotations

# First, before the imports that take most of a second: a SIGHUP during start-up must not end a daemon.
from gpuppetti import earlysignals

earlysignals.install()

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuppetti import __version__
from gpuppetti.config import BACKENDS, CONFIG_ENV, ConfigError
from gpuppetti.deviceplugin.lifecycle import DEFAULT_DEVICE_PLUGIN_DIR, SocketDirError
from gpuppetti.dra.paths import DEFAULT_CDI_DIR, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR

DEFAULT_HTTP_ADDRESS = "127.0.0.1:9400"

if TYPE_CHECKING:
    from rich.console import Console

    from gpuppetti.daemon import Sources

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = earlysignals.EXIT_INTERRUPTED
LOG_LEVELS = ("debug", "info", "warning", "error")


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def _add_common(parser: argparse.ArgumentParser, default_level: str = "info") -> None:
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default=os.environ.get("GPUPPETTI_LOG_LEVEL", default_level),
        help=f"log verbosity (env GPUPPETTI_LOG_LEVEL; default {default_level})",
    )


def _add_config(parser: argparse.ArgumentParser, help_default: str) -> None:
    parser.add_argument(
        "--config", type=Path, default=_env_path(CONFIG_ENV), metavar="PATH",
        help=f"YAML config file with 'version: v1' (env {CONFIG_ENV}; default: {help_default})",
    )


def _add_http(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--http-address", default=os.environ.get("GPUPPETTI_HTTP_ADDRESS", DEFAULT_HTTP_ADDRESS), metavar="HOST:PORT",
        help="where to serve /healthz (ready once registered), /livez and /metrics; the only TCP listener, "
        f"'' turns it off (env GPUPPETTI_HTTP_ADDRESS; default {DEFAULT_HTTP_ADDRESS})",
    )


def _add_discovery(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", choices=BACKENDS, default=os.environ.get("GPUPPETTI_BACKEND"),
        help="discovery backend, overriding the config's 'backend'; auto runs every backend that can run here "
        "(env GPUPPETTI_BACKEND; default: the config's, else auto)",
    )
    parser.add_argument(
        "--host-root", type=Path, default=_env_path("GPUPPETTI_HOST_ROOT") or Path("/"), metavar="DIR",
        help="where the host's /sys, /dev and /proc are mounted, e.g. /host in a DaemonSet "
        "(env GPUPPETTI_HOST_ROOT; default /)",
    )
    parser.add_argument(
        "--host-agent", default=os.environ.get("GPUPPETTI_HOST_AGENT"), metavar="URL",
        help="a gpuppetti host-agent on the Mac, e.g. http://host.minikube.internal:9410, whose facts (model, "
        "cores, memory) the virtio-gpu takes (env GPUPPETTI_HOST_AGENT; default: the config's hostAgent.url)",
    )
    parser.add_argument(
        "--host-agent-token-file", type=Path, default=_env_path("GPUPPETTI_HOST_AGENT_TOKEN_FILE"), metavar="FILE",
        help="the agent's bearer token (env GPUPPETTI_HOST_AGENT_TOKEN_FILE; default: the config's "
        "hostAgent.tokenFile, /var/run/secrets/gpuppetti-host-agent/token)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuppetti",
        description="GPU sharing for Kubernetes that does not assume NVIDIA: finds a node's GPUs, slices them, "
        "and offers the slices to the kubelet.",
    )
    parser.add_argument("--version", action="version", version=f"gpuppetti {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plugin = commands.add_parser(
        "plugin", help="serve GPUs to the kubelet as a device plugin (Device Plugin API v1beta1)",
        description="Serve the node's GPUs, whole or time-sliced, to the kubelet through the Device Plugin API "
        "v1beta1: one socket per extended resource, re-registered whenever the kubelet restarts. "
        "SIGHUP reloads the config; SIGTERM or SIGINT removes the sockets and exits 0.",
    )
    _add_config(plugin, "built-in defaults: no sharing")
    plugin.add_argument(
        "--device-plugin-dir", type=Path, metavar="DIR",
        default=_env_path("GPUPPETTI_DEVICE_PLUGIN_DIR") or DEFAULT_DEVICE_PLUGIN_DIR,
        help=f"the kubelet's device plugin directory, holding kubelet.sock (env GPUPPETTI_DEVICE_PLUGIN_DIR; "
        f"default {DEFAULT_DEVICE_PLUGIN_DIR})",
    )
    plugin.add_argument(
        "--cdi-dir", type=Path, default=_env_path("GPUPPETTI_CDI_DIR") or DEFAULT_CDI_DIR, metavar="DIR",
        help=f"where the CDI spec goes when plugin.deviceListStrategy includes a CDI strategy "
        f"(env GPUPPETTI_CDI_DIR; default {DEFAULT_CDI_DIR})",
    )
    plugin.add_argument(
        "--label-node", action="store_true", default=os.environ.get("GPUPPETTI_LABEL_NODE") == "true",
        help="label this node with its GPU (gpuppetti.dev/gpu.vendor, .model, .cores, .memory, .count, .replicas, "
        ".sharing-strategy) and keep the labels current; needs RBAC to get and patch its Node "
        "(env GPUPPETTI_LABEL_NODE=true)",
    )
    plugin.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""), metavar="NAME",
                        help="this node's name, for --label-node (env NODE_NAME)")
    plugin.add_argument("--kubeconfig", type=Path, default=_env_path("KUBECONFIG"), metavar="PATH",
                        help="kubeconfig for --label-node (env KUBECONFIG; default: the in-cluster service account)")
    _add_discovery(plugin)
    _add_http(plugin)
    _add_common(plugin)

    discover = commands.add_parser(
        "discover", help="show the GPUs this node has, as the plugin would serve them",
        description="Run the discovery backends and print what they found: vendor, model, cores, memory, device "
        "nodes, NUMA node, health and backend, and the resource each GPU would be advertised under. Exits 1 when "
        "nothing is found, saying what was looked at.",
    )
    _add_config(discover, "built-in defaults")
    _add_discovery(discover)
    discover.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    discover.add_argument(
        "--from", dest="from_url", default=None, metavar="URL",
        help="show what a running plugin or DRA driver serves instead of discovering here, from its HTTP "
        "endpoint (e.g. http://127.0.0.1:9400): its GPUs' health and whether their facts are stale",
    )
    _add_common(discover, default_level="warning")

    dra = commands.add_parser(
        "dra", help="serve GPUs through Dynamic Resource Allocation (resource.k8s.io/v1, kubelet DRA v1/v1beta1)",
        description="Publish the node's GPUs as ResourceSlices (whole, as partitions, or as consumable capacity, "
        "per the config's dra section), register with the kubelet's plugin watcher, and prepare claims by "
        "writing one CDI spec per claim. Prepared claims survive restarts in a checkpoint. SIGHUP reloads the "
        "config; SIGTERM or SIGINT unregisters and exits 0.",
    )
    _add_config(dra, "built-in defaults: whole GPUs")
    dra.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""), metavar="NAME",
                     help="this node's name, which is also the pool name (env NODE_NAME; required)")
    dra.add_argument("--registry-dir", type=Path, default=DEFAULT_REGISTRY_DIR, metavar="DIR",
                     help=f"the kubelet's plugin registry directory (default {DEFAULT_REGISTRY_DIR})")
    dra.add_argument("--plugins-dir", type=Path, default=DEFAULT_PLUGINS_DIR, metavar="DIR",
                     help=f"where the driver's socket and checkpoint go, under <driver>/ "
                     f"(default {DEFAULT_PLUGINS_DIR})")
    dra.add_argument("--cdi-dir", type=Path, default=DEFAULT_CDI_DIR, metavar="DIR",
                     help=f"where CDI specs are written (default {DEFAULT_CDI_DIR})")
    dra.add_argument("--kubeconfig", type=Path, default=_env_path("KUBECONFIG"), metavar="PATH",
                     help="kubeconfig for the API server (env KUBECONFIG; default: the in-cluster service account)")
    dra.add_argument("--api-timeout", type=float, default=float(os.environ.get("GPUPPETTI_API_TIMEOUT", "10")),
                     metavar="SECONDS",
                     help="the longest one request to the API server may take, connect to last byte; a claim read "
                     "that takes longer fails that claim, and the kubelet retries (env GPUPPETTI_API_TIMEOUT; "
                     "default 10)")
    _add_discovery(dra)
    _add_http(dra)
    _add_common(dra)

    manifests = commands.add_parser(
        "manifests", help="print ready-to-apply YAML for a cluster (gpuppetti manifests | kubectl apply -f -)",
        description="Print the Namespace, ConfigMap, DaemonSet (and for DRA the RBAC and DeviceClasses) that run "
        "gpuppetti on every node. The same objects as `kubectl kustomize deploy/base/<mode>` and the overlays.",
    )
    manifests.add_argument("--mode", choices=("plugin", "dra"), default="plugin",
                           help="device plugin or DRA driver (default plugin)")
    manifests.add_argument("--replicas", type=int, default=None, metavar="N",
                           help="time-slice every GPU into N replicas (every vendor's default resource name)")
    manifests.add_argument("--image", default=None, metavar="IMAGE", help="the gpuppetti image to run")
    manifests.add_argument("--namespace", default=None, metavar="NS", help="namespace (default gpuppetti)")
    manifests.add_argument("--label-node", action="store_true",
                           help="device plugin: label each node with its GPU, with the RBAC to patch Nodes")
    source = manifests.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=("minikube-krunkit",), default=None,
                        help="a ready config: minikube-krunkit serves the VM's virtio-gpu as apple.com/gpu")
    source.add_argument("--config", type=Path, default=None, metavar="PATH",
                        help="put this config file in the ConfigMap (validated first)")
    _add_common(manifests, default_level="warning")

    agent = commands.add_parser(
        "host-agent", help="on a Mac: serve its GPU's facts to the plugin inside a krunkit VM",
        description="Serve the Mac's GPU inventory (model, cores, unified memory, Metal's recommended working "
        "set, Metal family, live utilisation and in-use memory) as JSON at /v1/gpus. Every request needs the "
        "bearer token, generated on first start and stored with mode 0600; the first start prints the kubectl "
        "command that gives it to the cluster. Needs no root.",
    )
    agent.add_argument("--listen", default=os.environ.get("GPUPPETTI_HOST_AGENT_LISTEN", "127.0.0.1:9410"),
                       metavar="ADDR:PORT",
                       help="where to listen (env GPUPPETTI_HOST_AGENT_LISTEN; default 127.0.0.1:9410). The VM "
                       "reaches the Mac at the address host.minikube.internal resolves to: listen there, or on "
                       "0.0.0.0:9410")
    agent.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                       help="where the token is kept (default: the user's config directory, host-agent.token)")
    agent.add_argument("--interval", type=float, default=5.0, metavar="SECONDS",
                       help="how often to refresh utilisation and in-use memory from ioreg (default 5)")
    agent.add_argument("--namespace", default="gpuppetti", help="the namespace in the printed kubectl command")
    _add_common(agent)

    demo = commands.add_parser(
        "demo", help="run the plugin on simulated GPUs against the built-in kubelet emulator",
        description="Start the device plugin with simulated GPUs (by default two Apple M3 Max, 40 cores, "
        "4 slices each) against the built-in kubelet emulator in a temporary directory, admit a handful of "
        "pods, and print which pod got which slice and the env it would see. Needs no cluster, root or GPU.",
    )
    demo.add_argument(
        "--config", type=Path, default=None, metavar="PATH",
        help="YAML config with simulated GPUs (default: the built-in demo config)",
    )
    demo.add_argument(
        "--runtime", choices=("podman",), default=None,
        help="also run each admitted pod as a real container with podman, applying its CDI devices, env, device "
        "nodes and mounts, and show what it saw inside (needs root, podman, runc and busybox-static)",
    )
    demo.add_argument(
        "--image", default=None, metavar="IMAGE",
        help="a local image with /bin/sh for --runtime podman (default: one built from /bin/busybox; "
        "nothing is pulled)",
    )
    _add_common(demo, default_level="warning")
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _fail(message: str, code: int) -> int:
    print(f"gpuppetti: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    earlysignals.started()
    try:
        if args.command == "plugin":
            return _plugin(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "discover":
            return _discover(args)
        if args.command == "dra":
            return _dra(args)
        if args.command == "manifests":
            return _manifests(args)
        if args.command == "host-agent":
            return _host_agent(args)
    except ConfigError as exc:
        return _fail(f"config error:\n{exc}", EXIT_CONFIG)
    except KeyboardInterrupt:
        # A Ctrl-C before the process's own signal handling is in place (while it starts).
        return _fail("interrupted", EXIT_INTERRUPTED)
    raise AssertionError(f"unhandled command {args.command}")  # pragma: no cover - argparse requires one


def _plugin(args: argparse.Namespace) -> int:
    from gpuppetti.deviceplugin.run import Labelling, PluginOptions, run_plugin

    labelling = Labelling(args.node_name, args.kubeconfig) if args.label_node else None
    options = PluginOptions(args.device_plugin_dir, args.http_address, args.cdi_dir, labelling)
    return _run_daemon(run_plugin(_sources(args), options))


def _host_agent(args: argparse.Namespace) -> int:
    from gpuppetti.hostagent import token
    from gpuppetti.hostagent.run import run_agent

    path = args.token_file or token.default_token_path()
    secret, created = token.load_or_create(path)
    if created:
        print(f"gpuppetti host-agent: created a token in {path} (mode 0600). Give it to the cluster once:\n\n"
              f"  {token.secret_command(secret, args.namespace)}\n", flush=True)
    from gpuppetti.httpserver import AddressError, parse_address

    try:
        host, port = parse_address(args.listen)
    except AddressError as exc:
        return _fail(str(exc), EXIT_CONFIG)
    return _run_daemon(run_agent(secret, host, port, args.interval))


def _manifests(args: argparse.Namespace) -> int:
    from gpuppetti import manifests
    from gpuppetti.config import load_config

    if args.replicas is not None and not 1 <= args.replicas <= 1024:
        return _fail(f"--replicas must be between 1 and 1024, got {args.replicas}", EXIT_CONFIG)
    if args.config is not None and args.replicas is not None:
        return _fail("--replicas applies to the generated config; set replicas in --config instead", EXIT_CONFIG)
    config_text: str | None = None
    if args.preset:
        config_text = manifests.preset_config(args.preset, args.replicas)
    elif args.config is not None:
        load_config(args.config)
        config_text = args.config.read_text(encoding="utf-8")
    options = manifests.Options(
        mode=args.mode,
        namespace=args.namespace or manifests.DEFAULT_NAMESPACE,
        image=args.image or manifests.DEFAULT_IMAGE,
        config=config_text,
        replicas=args.replicas,
        label_node=args.label_node,
        node_selector=args.preset is None,
    )
    sys.stdout.write(manifests.to_yaml(manifests.render(options)))
    return EXIT_OK


def _dra(args: argparse.Namespace) -> int:
    from gpuppetti.dra.run import DraOptions, run_dra

    options = DraOptions(args.node_name, args.registry_dir, args.plugins_dir, args.cdi_dir, args.kubeconfig,
                         args.http_address, args.api_timeout)
    return _run_daemon(run_dra(_sources(args), options))


def _sources(args: argparse.Namespace) -> Sources:
    from gpuppetti.daemon import Sources

    return Sources(args.config, args.backend, args.host_root, args.host_agent, args.host_agent_token_file)


def _run_daemon(main: Coroutine[Any, Any, None]) -> int:
    """Run a long-running command; a failure we expect becomes one clear line, not a traceback."""
    from gpuppetti.discovery import BackendUnavailable
    from gpuppetti.httpserver import AddressError
    from gpuppetti.runtime import StartupError

    expected = (SocketDirError, BackendUnavailable, StartupError, AddressError)
    try:
        asyncio.run(main)
    except expected as exc:
        return _fail(str(exc), EXIT_FAILURE)
    except ExceptionGroup as group:
        # Raised from inside the process's task group; show the cause, not a traceback, when it is one we expect.
        config = group.subgroup(ConfigError)
        if config is not None:
            raise _leaf(config) from None
        known = group.subgroup(expected)
        if known is None:
            raise
        return _fail(str(_leaf(known)), EXIT_FAILURE)
    return EXIT_OK


def _leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _console() -> Console:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        # Piped output has no width to follow; keep the tables whole instead of wrapping them at 80 columns.
        console = Console(width=160)
    return console


def _discover(args: argparse.Namespace) -> int:
    from gpuppetti.daemon import host_agent, load_and_discover, nothing_found
    from gpuppetti.discovery import BackendUnavailable, with_host_facts
    from gpuppetti.inventory import Inventory
    from gpuppetti.report import gpu_records, gpu_table

    if args.from_url:
        return _discover_from(args.from_url, args.json)
    sources = _sources(args)
    try:
        found = load_and_discover(sources)
    except BackendUnavailable as exc:
        return _fail(str(exc), EXIT_FAILURE)
    gpus = found.gpus
    agent = host_agent(sources, found.config)
    if agent is not None:
        facts = asyncio.run(agent.fetch_once())
        gpus = [with_host_facts(gpu, facts) for gpu in gpus]
    if not gpus:
        return _fail(nothing_found(found), EXIT_FAILURE)
    snapshot = Inventory(found.config, gpus).snapshot
    if args.json:
        print(json.dumps(gpu_records(snapshot), indent=2))
    else:
        _console().print(gpu_table(snapshot))
    return EXIT_OK


def _discover_from(url: str, as_json: bool) -> int:
    import urllib.error
    import urllib.request

    from gpuppetti.httpserver import GPUS_PATH
    from gpuppetti.report import records_table

    target = url.rstrip("/") + GPUS_PATH
    try:
        with urllib.request.urlopen(target, timeout=10) as response:
            records = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return _fail(f"cannot read {target}: {getattr(exc, 'reason', exc)}", EXIT_FAILURE)
    if as_json:
        print(json.dumps(records, indent=2))
    else:
        _console().print(records_table(records, f"GPUs served by {url}"))
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from gpuppetti.demo import run_demo

    code = asyncio.run(run_demo(args.config, _console(), args.runtime, args.image))
    if code == EXIT_INTERRUPTED:
        return _fail("interrupted", EXIT_INTERRUPTED)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
