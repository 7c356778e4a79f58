"""The long-running commands: ``plugin``, ``dra`` and ``host-agent``."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from gpuppetti.cli.options import UsageError
from gpuppetti.cli.status import EXIT_FAILURE, EXIT_OK, Failure
from gpuppetti.core.config import ConfigError

if TYPE_CHECKING:
    from gpuppetti.node.daemon import Sources


def plugin(args: argparse.Namespace) -> int:
    if args.label_node and not args.node_name:
        raise UsageError("--label-node needs this node's name: pass --node-name or set NODE_NAME")
    from gpuppetti.deviceplugin.run import Labelling, PluginOptions, run_plugin

    labelling = Labelling(args.node_name, args.kubeconfig) if args.label_node else None
    options = PluginOptions(args.device_plugin_dir, args.http_address, args.cdi_dir, labelling, args.vulkan_layer_dir)
    return run_daemon(run_plugin(sources(args), options))


def dra(args: argparse.Namespace) -> int:
    if not args.node_name:
        raise UsageError("the node's name is required: pass --node-name or set NODE_NAME (in a DaemonSet, from the "
                         "downward API: fieldRef spec.nodeName)")
    from gpuppetti.dra.run import DraOptions, run_dra

    options = DraOptions(args.node_name, args.registry_dir, args.plugins_dir, args.cdi_dir, args.kubeconfig,
                         args.http_address, args.api_timeout, args.vulkan_layer_dir)
    return run_daemon(run_dra(sources(args), options))


def host_agent(args: argparse.Namespace) -> int:
    from gpuppetti.base.webserver import parse_address
    from gpuppetti.hostagent import token
    from gpuppetti.hostagent.run import run_agent

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
    return run_daemon(run_agent(secret, host, port, args.interval))


def sources(args: argparse.Namespace) -> Sources:
    from gpuppetti.node.daemon import Sources

    return Sources(args.config, args.backend, args.host_root, args.host_agent, args.host_agent_token_file)


def run_daemon(main: Coroutine[Any, Any, None]) -> int:
    """Run a long-running command; a failure we expect becomes one clear line, not a traceback."""
    from gpuppetti.base.runtime import StartupError
    from gpuppetti.base.webserver import AddressError
    from gpuppetti.deviceplugin.lifecycle import SocketDirError
    from gpuppetti.discovery import BackendUnavailable

    expected = (SocketDirError, BackendUnavailable, StartupError, AddressError)
    try:
        asyncio.run(main)
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
    return EXIT_OK


def _leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
