"""The commands that answer and exit: ``discover``, ``doctor``, ``manifests`` and ``demo``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from gpuppetti.cli import values
from gpuppetti.cli.daemons import sources
from gpuppetti.cli.options import UsageError
from gpuppetti.cli.status import BOUND_DIRS_GONE, EXIT_CONFIG, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, Failure

if TYPE_CHECKING:
    from rich.console import Console


def console() -> Console:
    """Rich's console: the terminal's width, or $COLUMNS, or 80 when piped, which the tables fit."""
    from rich.console import Console

    class Quiet(Console):
        def on_broken_pipe(self) -> None:
            # `gpuppetti demo | head`: the reader has gone; the rest goes nowhere, without an error.
            self.quiet = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    return Quiet(highlight=False)


def discover(args: argparse.Namespace) -> int:
    from gpuppetti.discovery import BackendUnavailable, with_host_facts
    from gpuppetti.layer.vulkan import BUILD_FIX, Enforcement, missing_files
    from gpuppetti.node.daemon import host_agent, load_and_discover, nothing_found
    from gpuppetti.node.inventory import Inventory
    from gpuppetti.node.report import gpu_records, print_gpus
    from gpuppetti.sharing.remarks import config_remarks

    url = getattr(args, "from")
    if url:
        return _discover_from(url, args.json)
    where = sources(args)
    try:
        found = load_and_discover(where)
    except BackendUnavailable as exc:
        raise Failure(str(exc)) from None
    gpus = found.gpus
    agent = host_agent(where, found.config)
    if agent is not None:
        facts = asyncio.run(agent.fetch_once())
        gpus = [with_host_facts(gpu, facts) for gpu in gpus]
    if not gpus:
        raise Failure(nothing_found(found))
    for remark in config_remarks(gpus, found.config):
        label = "warning" if remark.warning else "note"
        print(f"gpuppetti: {label}: {found.config.source}: {remark.path}: {remark.why}", file=sys.stderr)
    records = gpu_records(Inventory(found.config, gpus).snapshot)
    missing = missing_files()
    if args.json:
        print(json.dumps(records, indent=2))
        if missing:
            print(f"gpuppetti: warning: slices are not enforced: this installation has no built Vulkan layer "
                  f"({', '.join(missing)} missing); {BUILD_FIX}", file=sys.stderr)
    else:
        print_gpus(console(), records)
        enforcement = Enforcement(None, "this installation has no built Vulkan layer") if missing else None
        print(enforcement.summary() if enforcement is not None else
              "slices can be enforced: this installation has the Vulkan layer")
        if missing:
            print(f"  ({', '.join(missing)} missing: {BUILD_FIX})")
    return EXIT_OK


def _discover_from(url: str, as_json: bool) -> int:
    from gpuppetti.base.httpclient import FetchError, get
    from gpuppetti.node.httpserver import GPUS_PATH
    from gpuppetti.node.report import print_gpus, records_problem

    target = url.rstrip("/") + GPUS_PATH
    try:
        reply = asyncio.run(get(target, timeout=10))
    except FetchError as exc:
        raise Failure(str(exc)) from None
    not_ours = f"{url} is not a gpuppetti plugin or DRA driver's HTTP endpoint (its --http-address)"
    if reply.status != 200:
        raise Failure(f"{not_ours}: {GPUS_PATH} answered {reply.status}")
    try:
        records: Any = json.loads(reply.body)
    except ValueError:
        raise Failure(f"{not_ours}: {GPUS_PATH} answered something that is not JSON ({reply.content_type})") from None
    if (problem := records_problem(records)) is not None:
        raise Failure(f"{not_ours}: {GPUS_PATH} answered JSON that is not a list of GPUs ({problem})")
    if as_json:
        print(json.dumps(records, indent=2))
    else:
        print_gpus(console(), records, f"GPUs served by {url}")
    return EXIT_OK


def doctor(args: argparse.Namespace) -> int:
    from gpuppetti.commands.doctor import Settings, checkup, print_checkup

    settings = Settings(
        sources=sources(args), device_plugin_dir=args.device_plugin_dir, registry_dir=args.registry_dir,
        cdi_dir=args.cdi_dir, runtime_endpoint=args.runtime_endpoint, containerd_address=args.containerd_address,
        daemon_url=args.daemon, mode=args.mode, vulkan_layer_dir=args.vulkan_layer_dir, kubeconfig=args.kubeconfig,
    )
    results = asyncio.run(checkup(settings))
    if args.json:
        print(json.dumps([result.record() for result in results], indent=2))
    else:
        print_checkup(console(), results)
    return EXIT_FAILURE if any(result.failed for result in results) else EXIT_OK


def manifests(args: argparse.Namespace) -> int:
    from gpuppetti.commands import manifests
    from gpuppetti.core.config import load_config

    if args.mode == "dra":
        for flag, given in (("--replicas", args.replicas is not None), ("--label-node", args.label_node)):
            if given:
                raise UsageError(f"{flag} is for the device plugin (--mode plugin); with --mode dra, choose the "
                                 "slicing in the config's dra section (--config)")
    if args.config is not None and args.replicas is not None:
        raise UsageError("--replicas applies to the generated config; set the replicas in --config instead")
    if args.bound_allocation_dirs:
        print(f"gpuppetti: {BOUND_DIRS_GONE}", file=sys.stderr)
    config_text: str | None = None
    if args.preset:
        config_text = manifests.preset_config(args.preset, args.replicas)
    elif args.config is not None:
        load_config(args.config)
        config_text = args.config.read_text(encoding="utf-8")
    resources = manifests.merged_resources({kind: given for kind, given in
                                            (("requests", args.requests), ("limits", args.limits))
                                            if given is not values.UNGIVEN})
    options = manifests.Options(
        mode=args.mode,
        namespace=args.namespace,
        image=args.image,
        image_pull_policy=args.image_pull_policy,
        config=config_text,
        replicas=args.replicas,
        label_node=args.label_node,
        node_selector=args.preset is None,
        extra_node_selector=dict(args.node_selector),
        vulkan_layer_dir=str(args.vulkan_layer_dir or ""),
        resources=resources,
        **({"tolerations": args.toleration} if args.toleration else {}),
    )
    sys.stdout.write(manifests.to_yaml(manifests.render(options)))
    if options.node_selector:
        # The DaemonSet runs only where an operator said which mode a node serves: without the label, nothing runs.
        print(f"gpuppetti: the DaemonSet runs only on nodes labelled {manifests.MODE_LABEL}={args.mode}: "
              f"kubectl label node NODE {manifests.MODE_LABEL}={args.mode}", file=sys.stderr)
    return EXIT_OK


def top(args: argparse.Namespace) -> int:
    from gpuppetti.commands.top import TopError, fetch, render, watch

    url = getattr(args, "from")
    out = console()
    if args.json or args.once:
        try:
            view = asyncio.run(fetch(url))
        except TopError as exc:
            raise Failure(str(exc)) from None
        if args.json:
            print(json.dumps(view.document(), indent=2))
        else:
            out.print(render(view, out.width))
        return EXIT_OK
    try:
        asyncio.run(watch(out, url, args.interval))
    except TopError as exc:
        raise Failure(str(exc)) from None
    except KeyboardInterrupt:
        return EXIT_OK  # Ctrl-C is how a live view ends
    return EXIT_OK


def demo(args: argparse.Namespace) -> int:
    if args.image is not None and args.runtime is None:
        raise UsageError("--image is the image the sandbox runs: it needs --runtime podman")
    from gpuppetti.commands.demo import DemoError, run_demo

    try:
        code = asyncio.run(run_demo(args.config, console(), args.runtime, args.image, args.host_root, args.backend,
                                    args.http_address if args.keep_running else None))
    except DemoError as exc:
        raise Failure(str(exc), EXIT_CONFIG if exc.bad_input else EXIT_FAILURE) from None
    if code == EXIT_INTERRUPTED:
        raise Failure("interrupted", EXIT_INTERRUPTED)
    return code
