"""Signals before the event loop runs: a SIGHUP is remembered, not fatal; a Ctrl-C ends the start quietly.

A command spends a good part of a second importing before it runs, and before a daemon's runtime installs the
loop's signal handlers. SIGHUP's default action ends a process, and a KeyboardInterrupt in the middle of an import
prints a traceback. ``install()`` runs first thing in the command line: it notes a SIGHUP, which the runtime then
takes as a reload request, and answers a SIGINT with one line and exit code 130 until ``main()`` takes over.

It imports only what the interpreter has loaded before any program runs (``_signal``, ``os``, ``sys``): the
``signal`` and ``typing`` modules would cost ``enum``, ``re`` and ``collections``, milliseconds in which a SIGHUP
still ends the process.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing's, which would import what this module exists to run before
if TYPE_CHECKING:
    import signal as _signal  # the same functions and numbers, typed
    from types import FrameType
else:
    import _signal

EXIT_INTERRUPTED = 130

_pending = False


def _note(signum: int, frame: FrameType | None) -> None:
    global _pending
    _pending = True


def _interrupted(signum: int, frame: FrameType | None) -> None:
    # Nothing has started yet: nothing to clean up, and an exception here would surface as an import traceback.
    sys.stderr.write("gpuppetti: interrupted\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def install() -> None:
    _signal.signal(_signal.SIGHUP, _note)
    _signal.signal(_signal.SIGINT, _interrupted)


def started() -> None:
    """The command runs now: Ctrl-C is a KeyboardInterrupt again, which it handles. (Only the main thread has
    signal handlers: a command run from another, as tests run them, leaves them alone.)"""
    import threading

    if threading.current_thread() is threading.main_thread():
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)


def take_pending_hangup() -> bool:
    """Whether a SIGHUP arrived before the runtime ran (and forget it)."""
    global _pending
    pending, _pending = _pending, False
    return pending
