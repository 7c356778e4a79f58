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
from typing import Any, TextIO

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
    args: argparse.Namespace = parser.parse_args(argv)
    apply_environment(parser.commands[args.command], args, environ)
    return args


class OutputFailed(Exception):
    """Standard output cannot be written (a full disk, `> /dev/full`, a device gone): the output is incomplete."""


class _Output:
    """Standard output, whose failures say that it was standard output that failed (an OSError alone could come
    from any file)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(exc.strerror or str(exc)) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(exc.strerror or str(exc)) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def run(argv: Sequence[str] | None = None) -> int:
    stdout = sys.stdout
    sys.stdout = _Output(stdout)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        # A Ctrl-C inside one of _run's handlers (while a failure is being said), which its own clauses cannot
        # catch: the same one line.
        return fail("interrupted", EXIT_INTERRUPTED)
    finally:
        sys.stdout = stdout


def _run(argv: Sequence[str] | None) -> int:
    try:
        args = parse(argv)
        _setup_logging(args.log_level)
        earlysignals.started()
        gc.enable()  # held off by main() for the imports
        code = COMMANDS[args.command](args)
        # What is still buffered is written here, where a failure to write it is said in one line, not at the
        # interpreter's exit with a traceback.
        sys.stdout.flush()
        return code
    except (UsageError, ConfigError, Failure) as exc:
        return fail(*outcome(exc))
    except BrokenPipeError:
        # The reader of our output has gone (`| head`): nothing more to say, and nowhere to say it.
        _drop_stdout()
        return EXIT_FAILURE
    except OutputFailed as exc:
        return _output_failed(exc)
    except BaseExceptionGroup as group:
        # From inside a command's task group (the demo's).
        failed = group.subgroup(OutputFailed)
        if failed is None:
            raise
        leaf: BaseException = failed
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        return _output_failed(leaf)
    except KeyboardInterrupt:
        # A Ctrl-C before the process's own signal handling is in place (while it starts).
        return fail("interrupted", EXIT_INTERRUPTED)


def _drop_stdout() -> None:
    # What is left in the buffer would be written, and fail again, at the interpreter's exit.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _output_failed(error: BaseException) -> int:
    _drop_stdout()
    return fail(f"cannot write the output: {error}", EXIT_FAILURE)


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
