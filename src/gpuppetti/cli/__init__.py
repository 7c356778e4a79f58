"""The ``gpuppetti`` command line."""

from __future__ import annotations

import gc

# Not typing's: importing typing costs milliseconds before the early signal handlers are in (mypy knows the name).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    # First, before the imports that take most of a second: a SIGHUP during start-up must not end a daemon, and a
    # Ctrl-C must not print an import's traceback. Only here, so that importing the package installs nothing.
    from gpuppetti.base import earlysignals
    earlysignals.install()
    # The cyclic collector waits out the imports: they make nothing to collect, and its passes over their
    # hundreds of thousands of objects as they are made are CPU spent for nothing. The command line resumes it
    # before the command runs.
    gc.disable()
    from gpuppetti.cli.main import run

    return run(argv)
