"""Parse, check everything the user gave, then run one command; a user's mistake is one line, never a traceback.

Exit codes: 0 done, 1 could not run, 2 bad input (a flag, an env var, the config), 130 interrupted.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from gpuppetti.base import earlysignals
from gpuppetti.cli import daemons, installer, tools
from gpuppetti.cli.options import UsageError, apply_environment
from gpuppetti.cli.parser import build_parser
from gpuppetti.cli.status import EXIT_CONFIG, EXIT_FAILURE, EXIT_INTERRUPTED, Failure, fail
from gpuppetti.core.config import ConfigError

COMMANDS: dict[str, Callable[..., int]] = {
    "plugin": daemons.run_daemon,
    "dra": daemons.run_daemon,
    "host-agent": daemons.run_daemon,
    "discover": tools.discover,
    "doctor": tools.doctor,
    "top": tools.top,
    "manifests": tools.manifests,
    "demo": tools.demo,
    "install": installer.install,
    "uninstall": installer.uninstall,
}


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """The command and its options, each from its flag, else its env var, else its default, all checked.
    Raises UsageError."""
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_environment(parser.commands[args.command], args, environ)
    return args


def run(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(argv)
        _setup_logging(args.log_level)
        earlysignals.started()
        gc.enable()  # held off by main() for the imports
        return COMMANDS[args.command](args)
    except (UsageError, ConfigError, Failure) as exc:
        return fail(*outcome(exc))
    except BrokenPipeError:
        # The reader of our output has gone (`| head`): nothing more to say, and nowhere to say it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except KeyboardInterrupt:
        # A Ctrl-C before the process's own signal handling is in place (while it starts).
        return fail("interrupted", EXIT_INTERRUPTED)


def outcome(error: UsageError | ConfigError | Failure) -> tuple[str, int]:
    """The line a command that cannot go on ends with, and its exit code."""
    if isinstance(error, UsageError):
        return str(error), EXIT_CONFIG
    if isinstance(error, ConfigError):
        return config_message(error), EXIT_CONFIG
    return error.message, error.code


def config_message(error: ConfigError) -> str:
    """One problem on one line; several under a line that counts them."""
    text = str(error)
    if len(error.problems) <= 1:
        return f"config error: {text}"
    return f"config error: {len(error.problems)} problems:\n{text}"


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
