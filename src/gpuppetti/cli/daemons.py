"""The long-running commands: ``plugin``, ``dra`` and ``host-agent``."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from gpuppetti.base.runtime import Runtime
from gpuppetti.cli.options import UsageError
from gpuppetti.cli.status import EXIT_FAILURE, EXIT_OK, Failure
from gpuppetti.core.config import ConfigError

if TYPE_CHECKING:
    from gpuppetti.node.daemon import Serving, Sources


def plugin(args: argparse.Namespace, runtime: Runtime) -> Coroutine[Any, Any, None]:
    if args.label_node and not args.node_name:
        raise UsageError("--label-node needs this node's name: pass --node-name or set NODE_NAME")
    from gpuppetti.deviceplugin.run import Labelling, PluginOptions, run_plugin

    labelling = Labelling(args.node_name, args.kubeconfig) if args.label_node else None
    options = PluginOptions(args.device_plugin_dir, serving(args), labelling, args.instance)
    return run_plugin(runtime, sources(args), options)


def dra(args: argparse.Namespace, runtime: Runtime) -> Coroutine[Any, Any, None]:
    if not args.node_name:
        raise UsageError("the node's name is required: pass --node-name or set NODE_NAME (in a DaemonSet, from the "
                         "downward API: fieldRef spec.nodeName)")
    from gpuppetti.dra.run import DraOptions, run_dra

    options = DraOptions(args.node_name, serving(args), args.registry_dir, args.plugins_dir, args.kubeconfig,
                         args.api_timeout, args.instance)
    return run_dra(runtime, sources(args), options)


def host_agent(args: argparse.Namespace, runtime: Runtime) -> Coroutine[Any, Any, None]:
    from gpuppetti.base.webserver import parse_address
    from gpuppetti.commands.hostagent import run_agent
    from gpuppetti.hostagent import token

    path = args.token_file or token.default_token_path()
    try:
        secret, created = token.load_or_create(path)
    except token.TokenFileError as exc:
        raise UsageError(f"--token-file {exc}") from None
    if created:
        # The command names the file, never the token: this line may land in a log anyone can read.
        print(f"gpuppetti host-agent: created a token in {path} (mode 0600). Give it to the cluster once:\n\n"
              f"  {token.secret_command(path, args.namespace)}\n", flush=True)
    host, port = parse_address(args.listen)
    return run_agent(runtime, secret, host, port, args.interval)


# Each long-running command: what it runs, given its options and the runtime it runs in.
DAEMONS: dict[str, Callable[[argparse.Namespace, Runtime], Coroutine[Any, Any, None]]] = {
    "plugin": plugin,
    "dra": dra,
    "host-agent": host_agent,
}


def run_daemon(args: argparse.Namespace) -> int:
    """Run a long-running command as this process's whole life."""
    asyncio.run(served(DAEMONS[args.command](args, Runtime())))
    return EXIT_OK


def sources(args: argparse.Namespace) -> Sources:
    from gpuppetti.node.daemon import Sources

    return Sources(args.config, args.backend, args.host_root, args.host_agent, args.host_agent_token_file)


def serving(args: argparse.Namespace) -> Serving:
    from gpuppetti.node.daemon import Serving

    return Serving(args.http_address, args.cdi_dir, args.vulkan_layer_dir)


async def served(main: Coroutine[Any, Any, None]) -> None:
    """Await a long-running command; a failure we expect becomes one clear line, not a traceback."""
    from gpuppetti.base.runtime import StartupError
    from gpuppetti.base.webserver import AddressError
    from gpuppetti.discovery import BackendUnavailable

    expected = (BackendUnavailable, StartupError, AddressError)
    try:
        await main
    except expected as exc:
        raise Failure(str(exc), EXIT_FAILURE) from None
    except ExceptionGroup as group:
        # Raised from inside the process's task group; show the cause, not a traceback, when it is one we expect.
        config = group.subgroup(ConfigError)
        if config is not None:
            raise _leaf(config) from None
        known = group.subgroup(expected)
        if known is None:
            raise
        raise Failure(str(_leaf(known)), EXIT_FAILURE) from None


def _leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
