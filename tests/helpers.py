"""Shared test helpers: configs, short socket directories, and the plugin as a real subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import io
import os
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from gpuppetti.core.config import Config, parse_config
from gpuppetti.sharing.replicas import Unit, replica_unit_id

TWO_M3_MAX = """\
version: v1
backend: simulated
simulated:
  gpus:
    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: 2, numaNode: 0}
sharing:
  timeSlicing:
    resources:
      - name: apple.com/gpu
        replicas: 4
"""


# What the command reads from the environment besides GPUPPETTI_*: a test states what it wants.
CALLER_ONLY = ("NODE_NAME", "KUBECONFIG", "CONTAINER_RUNTIME_ENDPOINT", "COLUMNS", "LINES")


def _command_environment(env: dict[str, str] | None) -> dict[str, str]:
    """This process's environment with none of the caller's settings for the command, plus ``env``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GPUPPETTI_") and k not in CALLER_ONLY}
    environment.update(env or {})
    return environment


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
            stdout: IO[str] | int = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    """``gpuppetti ARGS`` to completion, with none of the caller's settings for it, plus ``env``; its output
    captured, or written to ``stdout``."""
    return subprocess.run([sys.executable, "-m", "gpuppetti", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=timeout, check=False, env=_command_environment(env))


def run_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``gpuppetti ARGS`` to completion in this process, as ``run_cli`` runs it in another: the same environment,
    its output and exit code, without a second of imports each time. For a command that needs no process of its
    own (no daemon, no signal); from a thread (asyncio.to_thread) in a test whose event loop runs; a traceback
    fails the test."""
    from gpuppetti.cli.main import run

    environment = _command_environment(env)
    saved = dict(os.environ)
    # What a command may set for its whole process (the demo's runtime: the umask, a frozen heap), put back.
    umask = os.umask(0o022)
    os.umask(umask)
    stdout, stderr = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(environment)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = run(list(args))
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.umask(umask)
        gc.unfreeze()
    return subprocess.CompletedProcess(["gpuppetti", *args], code, stdout.getvalue(), stderr.getvalue())


def config_from(text: str, source: str = "test.yaml") -> Config:
    return parse_config(textwrap.dedent(text), source)


def replicas(gpu_id: str, *numbers: int, resource: str = "apple.com/gpu", of: int = 4) -> list[Unit]:
    """Replicas ``numbers`` of a GPU shared ``of`` ways, as the device plugin's plan holds them."""
    return [Unit(replica_unit_id(gpu_id, n), gpu_id, resource, of, n) for n in numbers]


def short_tmpdir(prefix: str = "gp-") -> Path:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can come close.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class Daemon:
    """A long-running ``gpuppetti`` command under test, its log kept in a file: in a process of its own
    (DaemonProcess) or in the test's own event loop (InProcessDaemon), from the same command line."""

    def __init__(self, args: list[str], config_text: str | None, workdir: Path, name: str) -> None:
        self.name = name
        self.config_path: Path | None = None
        if config_text is not None:
            self.config_path = workdir / f"{name}-config.yaml"
            self.config_path.write_text(textwrap.dedent(config_text))
            args = [*args, "--config", str(self.config_path)]
        self.log_path = workdir / f"{name}.log"
        # An ephemeral port, so that tests never collide on the default one; http_url() reads it from the log.
        if args[0] in ("plugin", "dra") and "--http-address" not in args:
            args = [*args, "--http-address", "127.0.0.1:0"]
        # The layer goes into the test's directory, never the machine's /var/lib/gpuppetti.
        if args[0] in ("plugin", "dra") and "--vulkan-layer-dir" not in args:
            args = [*args, "--vulkan-layer-dir", str(workdir / "vulkan")]
        self.argv = [*args, "--log-level", "debug"]

    def returncode(self) -> int | None:
        """The exit code, or None while it runs."""
        raise NotImplementedError

    def running(self) -> bool:
        return self.returncode() is None

    def send(self, signum: int) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Gone, whatever it was doing (a test's teardown)."""
        raise NotImplementedError

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def write_config(self, text: str) -> None:
        assert self.config_path is not None
        self.config_path.write_text(textwrap.dedent(text))

    async def wait_for_log(self, text: str, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while text not in self.log():
                if not self.running():
                    raise AssertionError(f"{self.name} exited ({self.returncode()}) before logging {text!r}:\n"
                                         f"{self.log()}")
                await asyncio.sleep(0.02)

    async def http_url(self, timeout: float = 30.0) -> str:
        marker = "/metrics on http://"
        await self.wait_for_log(marker, timeout)
        # The last: a daemon started again in the same directory logs into the same file.
        line = [line for line in self.log().splitlines() if marker in line][-1]
        return "http://" + line.split(marker, 1)[1].strip()

    async def wait(self, timeout: float = 30.0) -> int:
        """Wait for it to exit by itself."""
        async with asyncio.timeout(timeout):
            while (code := self.returncode()) is None:
                await asyncio.sleep(0.02)
        return code

    async def stop(self, signum: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.running():
            self.send(signum)
        return await self.wait(timeout)


class DaemonProcess(Daemon):
    """The command started as its own process: for what needs the process boundary (signals, a crash, the
    environment, the process's memory and file descriptors)."""

    def __init__(self, args: list[str], config_text: str | None, workdir: Path, name: str,
                 env: dict[str, str] | None = None, umask: int | None = None,
                 open_files: int | None = None) -> None:
        """``open_files``: the soft limit on open files it starts with (a container runtime's 1,024)."""
        super().__init__(args, config_text, workdir, name)
        self._log = self.log_path.open("ab")
        environment = {k: v for k, v in os.environ.items() if not k.startswith("GPUPPETTI_")}
        environment.update(env or {})
        self.process = subprocess.Popen([sys.executable, "-m", "gpuppetti", *self.argv],
                                        stdout=self._log, stderr=subprocess.STDOUT, env=environment,
                                        umask=-1 if umask is None else umask,
                                        preexec_fn=None if open_files is None else _soft_open_files(open_files))

    @property
    def pid(self) -> int:
        return self.process.pid

    def returncode(self) -> int | None:
        code = self.process.poll()
        if code is not None:
            self._log.close()
        return code

    def send(self, signum: int) -> None:
        self.process.send_signal(signum)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()

    async def close(self) -> None:
        self.kill()


def _soft_open_files(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return apply


class PluginProcess(DaemonProcess):
    """``gpuppetti plugin`` in a process of its own, serving the device plugin directory ``directory``."""

    def __init__(
        self, config_text: str | None, directory: Path, *extra: str, env: dict[str, str] | None = None,
        open_files: int | None = None,
    ) -> None:
        self.directory = directory
        super().__init__(["plugin", "--device-plugin-dir", str(directory), *extra], config_text, directory.parent,
                         f"{directory.name}-plugin", env, open_files=open_files)


FAKES = Path(__file__).resolve().parent / "fakes"


def fake_nvml_env(state_file: Path) -> dict[str, str]:
    """Env that makes a subprocess import tests/fakes/pynvml.py as nvidia-ml-py."""
    return {"PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
            "FAKE_NVML_STATE": str(state_file)}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown text, as (language, body), indented ones included (in lists)."""
    blocks: list[tuple[str, str]] = []
    language: str | None = None
    indent = ""
    body: list[str] = []
    for line in text.splitlines():
        stripped = line.lstrip()
        if language is None:
            if stripped.startswith("```"):
                language, indent, body = stripped[3:].strip(), line[: len(line) - len(stripped)], []
        elif stripped.startswith("```"):
            blocks.append((language, "".join(f"{b.removeprefix(indent)}\n" for b in body)))
            language = None
        else:
            body.append(line)
    return blocks


@contextlib.contextmanager
def machine_lock(path: Path, waiting: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made when missing): a resource one run at a time may use on this machine.
    ``waiting`` goes to stderr when another run holds it, before waiting for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{waiting} (lock {path})", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


async def flood_endpoint(host: str, port: int, held: list[asyncio.StreamWriter]) -> None:
    """What any pod can do to a daemon's HTTP port: 1,500 connections that say nothing (kept open in ``held``, for
    the caller to close), then 3,000 scrapes of /metrics and /v1/slices whose clients give up at once."""
    for _ in range(1500):
        held.append((await asyncio.open_connection(host, port))[1])
    for n in range(3000):
        _, writer = await asyncio.open_connection(host, port)
        writer.write(f"GET {'/metrics' if n % 2 else '/v1/slices'} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        writer.close()
