"""Exit codes, and the one line a command ends with when it cannot do what was asked."""

from __future__ import annotations

import sys

from gpuppetti.base import earlysignals

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = earlysignals.EXIT_INTERRUPTED


class Failure(Exception):
    """A command cannot run: the message, and the exit code it ends with."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def fail(message: str, code: int) -> int:
    print(f"gpuppetti: {message}", file=sys.stderr)
    return code

# What `manifests` and `install` say of a flag kept for one more release.
BOUND_DIRS_GONE = ("--bound-allocation-dirs no longer does anything: containers mount nothing writable from the "
                   "node (each slice's ledger is the daemon's); drop the flag")
