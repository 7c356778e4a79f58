"""Flags with environment fallbacks, validated the same way wherever they come from, before anything starts.

argparse checks a flag's value through its ``type``, but takes a default as it is: an env var used as a default
would skip the checks (``GPUPPETTI_LOG_LEVEL=verbose`` went through). Here an option with an env var gets a
sentinel default; after parsing, each option that was not given is read from its env var through the same
converter, and an error names the env var instead of the flag.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn


class UsageError(Exception):
    """A mistake in the command line or the environment: one line, exit code 2."""


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


@dataclass(frozen=True)
class EnvOption:
    dest: str
    flag: str
    env: str
    convert: Callable[[str], Any]
    default: Any
    # Whether an empty value means something (``GPUPPETTI_HTTP_ADDRESS=`` turns the listener off); otherwise an
    # empty env var counts as unset, as shells and manifests leave them.
    empty_is_value: bool


class _Formatter(argparse.HelpFormatter):
    """Wraps prose to the terminal, and keeps a text of several lines (the exit code table) as it is written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, and which knows its options' env vars."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        self.env_options: list[EnvOption] = []
        self.commands: dict[str, Parser] = {}

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """Parsed as argparse does, but a mistake is said by the parser it belongs to, with what was likely
        meant: an unknown flag of a command names that command's help, not the top level's."""
        argv = list(args) if args is not None else sys.argv[1:]
        if self.commands:
            self._check_leading_flags(argv)
        parsed, extras = self.parse_known_args(argv, namespace)
        if extras:
            owner = self.commands.get(getattr(parsed, "command", None) or "", self)
            owner.error(f"unrecognized arguments: {' '.join(extras)}", hint=owner._closest_flag(extras))
        return parsed

    def _check_leading_flags(self, argv: Sequence[str]) -> None:
        # argparse would say only that a command is required (`gpuppetti --verison`).
        for word in argv:
            if not word.startswith("-") or word == "--":
                return
            flag = word.split("=", 1)[0]
            if flag not in self._option_string_actions:
                self.error(f"unknown option {flag}", hint=self._closest_flag([flag]))

    def _closest_flag(self, words: Sequence[str]) -> str | None:
        flags = [flag for flag in self._option_string_actions if flag.startswith("--")]
        for word in words:
            if word.startswith("--"):
                match = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.6)
                if match:
                    return match[0]
        return None

    def error(self, message: str, hint: str | None = None) -> NoReturn:
        choice = _INVALID_CHOICE.fullmatch(message)
        if choice and hint is None:
            wanted, options = choice.group(1), re.findall(r"'([^']*)'", choice.group(2))
            match = difflib.get_close_matches(wanted, options, n=1, cutoff=0.6)
            hint = match[0] if match else None
            if choice.group(0).startswith("argument COMMAND"):
                message = f"unknown command {wanted!r}"
        did_you_mean = f"; did you mean {hint}?" if hint else ""
        raise UsageError(f"{message}{did_you_mean} (see '{self.prog} --help')")


# argparse's words for a value that is not one of a fixed list.
_INVALID_CHOICE = re.compile(r"argument [^:]+: invalid choice: '([^']*)' \(choose from (.*)\)$")


def option(
    parser: Parser,
    *flags: str,
    help: str,
    convert: Callable[[str], Any] = str,
    default: Any = None,
    env: str | None = None,
    shown_default: str | None = None,
    metavar: str | None = None,
    empty_is_value: bool = False,
) -> None:
    """Add a flag taking a value. Its help ends with where else the value may come from and its default."""
    notes = []
    if env:
        notes.append(f"env {env}")
    if shown_default is None and default not in (None, ""):
        shown_default = str(default)
    if shown_default is not None:
        notes.append(f"default {shown_default}")
    text = f"{help} ({'; '.join(notes)})" if notes else help
    action = parser.add_argument(*flags, type=_quoting(convert), default=UNSET if env else default, help=text,
                                 metavar=metavar)
    if env:
        parser.env_options.append(EnvOption(action.dest, flags[0], env, convert, default, empty_is_value))


def _quoting(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """The converter, with the value given at the front of its complaint (argparse names only the flag)."""

    def checked(text: str) -> Any:
        try:
            return convert(text)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            message = str(exc)
            raise argparse.ArgumentTypeError(message if repr(text) in message else f"{text!r}: {message}") from None

    checked.__name__ = getattr(convert, "__name__", "value")
    return checked


def repeated(parser: Parser, flag: str, help: str, convert: Callable[[str], Any], metavar: str) -> None:
    """A flag that may be given more than once: its values, in order (an empty list when it is not given)."""
    parser.add_argument(flag, type=_quoting(convert), action="append", default=[], help=f"{help} (repeatable)",
                        metavar=metavar)


def switch(parser: Parser, flag: str, help: str, env: str | None = None) -> None:
    """An on/off flag; its env var must say ``true`` or ``false``."""
    text = f"{help} (env {env}=true)" if env else help
    action = parser.add_argument(flag, action="store_const", const=True, default=UNSET if env else False,
                                 help=text)
    if env:
        parser.env_options.append(EnvOption(action.dest, flag, env, boolean, False, False))


@dataclass(frozen=True)
class Opt:
    """A row of a command's table: a flag taking a value (``option``)."""

    flags: tuple[str, ...]
    help: str
    convert: Callable[[str], Any] = str
    default: Any = None
    env: str | None = None
    shown_default: str | None = None
    metavar: str | None = None
    empty_is_value: bool = False


@dataclass(frozen=True)
class Switch:
    """A row: an on/off flag, with an env var (``switch``) or without (a plain store_true)."""

    flag: str
    help: str
    env: str | None = None


@dataclass(frozen=True)
class Repeated:
    """A row: a flag that may be given more than once (``repeated``)."""

    flag: str
    help: str
    convert: Callable[[str], Any]
    metavar: str


@dataclass(frozen=True)
class Plain:
    """A row: a flag argparse checks by its ``type`` alone, with no env var: a value given only on the line."""

    flag: str
    help: str
    convert: Callable[[str], Any]
    default: Any
    metavar: str


@dataclass(frozen=True)
class OneOf:
    """A row: flags of which at most one may be given."""

    rows: tuple[Plain, ...]


Row = Opt | Switch | Repeated | Plain | OneOf


def add_rows(parser: Parser | argparse._MutuallyExclusiveGroup, rows: Iterable[Row]) -> None:
    """Each row's flag on ``parser``, in order (the order ``--help`` shows them in)."""
    for row in rows:
        if isinstance(row, Opt):
            assert isinstance(parser, Parser)
            option(parser, *row.flags, help=row.help, convert=row.convert, default=row.default, env=row.env,
                   shown_default=row.shown_default, metavar=row.metavar, empty_is_value=row.empty_is_value)
        elif isinstance(row, Switch):
            if row.env is not None:
                assert isinstance(parser, Parser)
                switch(parser, row.flag, help=row.help, env=row.env)
            else:
                parser.add_argument(row.flag, action="store_true", help=row.help)
        elif isinstance(row, Repeated):
            assert isinstance(parser, Parser)
            repeated(parser, row.flag, help=row.help, convert=row.convert, metavar=row.metavar)
        elif isinstance(row, Plain):
            parser.add_argument(row.flag, type=row.convert, default=row.default, metavar=row.metavar, help=row.help)
        else:
            assert isinstance(parser, Parser)
            add_rows(parser.add_mutually_exclusive_group(), row.rows)


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError("expected true or false")


def apply_environment(parser: Parser, args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> None:
    """Fill each option not given on the command line from its env var, else its default; check the env's value
    as the flag's would be checked."""
    for spec in parser.env_options:
        if getattr(args, spec.dest) is not UNSET:
            continue
        raw = environ.get(spec.env)
        if raw is None or (raw == "" and not spec.empty_is_value):
            setattr(args, spec.dest, spec.default)
            continue
        try:
            value = spec.convert(raw)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise UsageError(f"{spec.env}={raw!r}: {exc} (or give {spec.flag})") from None
        setattr(args, spec.dest, value)
