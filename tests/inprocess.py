"""A daemon in the test's own event loop: the command line parsed as the CLI parses it, its duties in a runtime
that owns neither the process's signals nor its umask, its log lines in a file as a subprocess's would be.

What costs a subprocess most is the start (importing grpc, pydantic and the proto modules, a second of CPU each
time); here the test's process has them already, so most tests of the daemons' behaviour start them here and keep
processes of their own for what needs the process boundary: signals, a crash, the environment, memory and file
descriptors.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
import traceback
from pathlib import Path

from gpuppetti.base.runtime import Runtime
from gpuppetti.cli.daemons import DAEMONS, served
from gpuppetti.cli.main import outcome, parse
from gpuppetti.cli.options import UsageError
from gpuppetti.cli.status import EXIT_FAILURE, EXIT_OK, Failure
from gpuppetti.core.config import ConfigError
from tests.helpers import Daemon

# Which daemon the running code belongs to: each runs in a context of its own, which its tasks and threads inherit.
_CURRENT: contextvars.ContextVar[InProcessDaemon | None] = contextvars.ContextVar("daemon", default=None)
_RUNNING: list[InProcessDaemon] = []
# The signals a runtime answers; anything else (SIGKILL, SIGSTOP) needs a process of its own.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The exit status a shell reports for a process killed by SIGKILL, as Popen.poll() gives it.
KILLED = -signal.SIGKILL


class _ToItsDaemon(logging.Handler):
    """Each record goes to the log of the daemon whose code logged it; with one daemon running, also a record of
    code that runs outside any context it made (an executor's thread)."""

    def emit(self, record: logging.LogRecord) -> None:
        daemon = _CURRENT.get()
        if daemon is None and len(_RUNNING) == 1:
            daemon = _RUNNING[0]
        if daemon is not None:
            daemon.write(self.format(record))


_HANDLER = _ToItsDaemon()
_HANDLER.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
_LOGGER = logging.getLogger("gpuppetti")
# Its level before the first of the running daemons set it to debug, as their command lines ask.
_SAVED_LEVEL: list[int] = []


class InProcessDaemon(Daemon):
    def __init__(self, args: list[str], config_text: str | None, workdir: Path, name: str) -> None:
        super().__init__(args, config_text, workdir, name)
        self._log = self.log_path.open("a", buffering=1)
        self.runtime = Runtime(whole_process=False)
        if not _RUNNING:
            _SAVED_LEVEL[:] = [_LOGGER.level]
            _LOGGER.setLevel(logging.DEBUG)
            _LOGGER.addHandler(_HANDLER)
        _RUNNING.append(self)
        self.task = asyncio.get_running_loop().create_task(self._serve(), name=name,
                                                           context=contextvars.copy_context())

    def write(self, line: str) -> None:
        if not self._log.closed:
            self._log.write(line + "\n")

    async def _serve(self) -> int:
        _CURRENT.set(self)
        try:
            # No env var reaches the command line: a test says on it what it means (an environment is a process's,
            # and a test that needs one starts a DaemonProcess).
            args = parse(self.argv, {})
            await served(DAEMONS[args.command](args, self.runtime))
            return EXIT_OK
        except (UsageError, ConfigError, Failure) as exc:
            message, code = outcome(exc)
            self.write(f"gpuppetti: {message}")
            return code
        except Exception:
            self.write(traceback.format_exc())
            return EXIT_FAILURE
        finally:
            self._ended()

    def _ended(self) -> None:
        if self in _RUNNING:
            _RUNNING.remove(self)
            if not _RUNNING:
                _LOGGER.removeHandler(_HANDLER)
                _LOGGER.setLevel(_SAVED_LEVEL[0])
        self._log.close()

    def returncode(self) -> int | None:
        if not self.task.done():
            return None
        if self.task.cancelled():
            return KILLED
        return self.task.result()

    def send(self, signum: int) -> None:
        if signum not in SIGNALS:
            raise ValueError(f"an in-process daemon answers {', '.join(s.name for s in SIGNALS)}: "
                             f"start a DaemonProcess to send it {signal.Signals(signum).name}")
        self.runtime.on_signal(signum)

    async def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self._ended()


class InProcessPlugin(InProcessDaemon):
    """``gpuppetti plugin`` in the test's event loop, serving the device plugin directory ``directory``."""

    def __init__(self, config_text: str | None, directory: Path, *extra: str) -> None:
        self.directory = directory
        super().__init__(["plugin", "--device-plugin-dir", str(directory), *extra], config_text, directory.parent,
                         f"{directory.name}-plugin")
