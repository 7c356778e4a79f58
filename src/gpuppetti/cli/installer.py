"""``gpuppetti install`` and ``gpuppetti uninstall``: their flags, and the step from flags to the commands' work."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from gpuppetti.cli import values
from gpuppetti.cli.options import Parser, UsageError, option, repeated
from gpuppetti.cli.status import BOUND_DIRS_GONE, EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, Failure
from gpuppetti.commands.manifests import DEFAULT_IMAGE, DEFAULT_NAMESPACE

Command = Callable[[str, str, str], Parser]
DEFAULT_TIMEOUT_S = 300.0
T = TypeVar("T")


def _cluster(parser: Parser) -> None:
    option(parser, "--kubeconfig", env="KUBECONFIG", convert=values.kubeconfig_any_context, metavar="PATH",
           shown_default="~/.kube/config", help="the kubeconfig whose cluster to use")
    option(parser, "--context", metavar="NAME", shown_default="the kubeconfig's current context",
           help="the kubeconfig's context to use")
    option(parser, "--namespace", convert=values.namespace, default=DEFAULT_NAMESPACE, metavar="NS",
           help="the namespace gpuppetti runs in")
    option(parser, "--timeout", convert=values.seconds, default=DEFAULT_TIMEOUT_S, shown_default="300",
           metavar="SECONDS", help="how long to wait for each thing to happen in the cluster")


def _log_level(parser: Parser) -> None:
    levels = ("debug", "info", "warning", "error")
    option(parser, "--log-level", env="GPUPPETTI_LOG_LEVEL", convert=values.choice(*levels), default="warning",
           metavar="LEVEL", help=f"log verbosity: {', '.join(levels)}")


def register(command: Command) -> None:
    """Add ``install`` and ``uninstall`` through ``command`` (name, help, description -> its parser)."""
    install = command(
        "install", "install gpuppetti on the current kube context's cluster, up to a pod running on a slice",
        "Find what the cluster is (minikube and its driver, kind, k3s, or another), get the image onto its nodes "
        "the way that cluster takes images, apply the objects of `gpuppetti manifests` through the API server "
        "(server-side apply; no helm needed), label the nodes, wait until their GPUs are allocatable (device "
        "plugin) or published (DRA), and run one smoke pod that prints its slice as the Vulkan layer shows it. "
        "Each step says what it does. Run it again to update; `gpuppetti uninstall` removes it all.",
    )
    _cluster(install)
    install.add_argument("--mode", type=values.choice("plugin", "dra"), default="plugin", metavar="MODE",
                         help="plugin (the device plugin) or dra (the DRA driver) (default plugin)")
    option(install, "--image", convert=values.image, metavar="IMAGE",
           shown_default=f"{DEFAULT_IMAGE}, built from the checkout",
           help="the gpuppetti image to run; without --build the nodes pull it (a registry reference)")
    option(install, "--build", convert=values.directory, metavar="DIR",
           shown_default="the current directory, when it is a gpuppetti checkout and --image is not given",
           help="build the image from this checkout's Dockerfile and load it the cluster's way: minikube image "
           "build, docker or podman build and kind load, or k3s ctr images import")
    option(install, "--config", convert=values.path, metavar="PATH",
           shown_default="minikube with krunkit: the minikube-krunkit preset; otherwise every GPU, whole",
           help="the config the daemons run with (kind's nodes have no GPUs: give one with simulated GPUs)")
    option(install, "--replicas", convert=values.count(1, 1024), metavar="N", shown_default="the preset's, or none",
           help="device plugin, without --config: time-slice every GPU into N replicas")
    repeated(install, "--node", convert=values.node_name, metavar="NAME",
             help="label this node to run gpuppetti (default: every node)")
    install.add_argument("--host-network", action="store_true",
                         help="run the daemons in the node's network, reaching the API server at the kubeconfig's "
                         "address: for a node without a pod network or kube-proxy")
    # Accepted for one more release, and said to do nothing.
    install.add_argument("--bound-allocation-dirs", action="store_true", help=argparse.SUPPRESS)
    option(install, "--smoke-image", convert=values.image, metavar="IMAGE",
           shown_default="busybox:1.36; on minikube with krunkit, quay.io/slopezpa/fedora-vgpu (Venus)",
           help="the smoke pod's image: one with a Vulkan loader shows the slice through gpuppetti-vkinfo")
    _log_level(install)

    uninstall = command(
        "uninstall", "remove everything install made: its objects, the smoke pod and the nodes' gpuppetti labels",
        "Stop the daemons (each removes its sockets, CDI specs and slices), delete the smoke pod, the namespace, "
        "the cluster-wide RBAC and DeviceClasses and any ResourceSlice left, and remove every gpuppetti.dev/ node "
        "label. Prints what stays on the nodes' disks: the Vulkan layer's directory and the image.",
    )
    _cluster(uninstall)
    _log_level(uninstall)


def _say(line: str) -> None:
    print(line, flush=True)


def _checkout(directory: Path) -> bool:
    return (directory / "Dockerfile").is_file() and (directory / "src" / "gpuppetti" / "__init__.py").is_file()


def install(args: argparse.Namespace) -> int:
    from gpuppetti.commands import install as work
    from gpuppetti.core.config import load_config

    if args.mode == "dra" and args.replicas is not None:
        raise UsageError("--replicas is for the device plugin (--mode plugin); with --mode dra, choose the slicing "
                         "in the config's dra section (--config)")
    if args.config is not None and args.replicas is not None:
        raise UsageError("--replicas applies to the generated config; set the replicas in --config instead")
    if args.bound_allocation_dirs:
        print(f"gpuppetti: {BOUND_DIRS_GONE}", file=sys.stderr)
    config_text = None
    if args.config is not None:
        load_config(args.config)
        config_text = args.config.read_text(encoding="utf-8")
    build = args.build
    if build is None and args.image is None and _checkout(Path.cwd()):
        build = Path.cwd()
    settings = work.Settings(
        kubeconfig=args.kubeconfig, context=args.context, mode=args.mode, namespace=args.namespace,
        image=args.image, build=build, config=config_text, config_source=str(args.config) if args.config else None,
        replicas=args.replicas, nodes=tuple(args.node), host_network=args.host_network,
        smoke_image=args.smoke_image, timeout=args.timeout,
    )
    _run(lambda: work.install(settings, _say))
    return EXIT_OK


def uninstall(args: argparse.Namespace) -> int:
    from gpuppetti.commands import install as work

    settings = work.Settings(kubeconfig=args.kubeconfig, context=args.context, namespace=args.namespace,
                             timeout=args.timeout)
    left = _run(lambda: work.uninstall(settings, _say))
    _say("done: nothing of gpuppetti is left in the cluster. On the nodes' disks:")
    for line in left:
        _say(f"  {line}")
    return EXIT_OK


def _run(work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    from gpuppetti.commands.install import InstallError

    try:
        return asyncio.run(work())
    except InstallError as exc:
        raise Failure(str(exc), EXIT_CONFIG if exc.bad_input else EXIT_FAILURE) from None
