"""The venus tier's machine: a throw-away VM whose guest sees a virtio-gpu with Mesa's Venus, from the shared
`venusnode` kit (what a krunkit/libkrun VM on an Apple-silicon Mac sees, with the host's lavapipe where the Mac has
MoltenVK and Metal).

The kit's chroot is set up once per state directory (``setup.sh``); the project goes into it as a user installs it,
a wheel installed with pip into a venv (its dependencies from PyPI, through the kit's ``chroot.sh``); each VM then
boots that chroot read-only (``run.sh``), runs one script of batched scenarios, and powers off. The guest's CPU is
emulated: every Python start costs seconds, so scenarios are batched, one VM per batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import helpers
from tests.apps.support import LLAMA_SERVER, LLAMA_SERVER_PACKAGE, WGPU, app_venv
from tests.apps.support import CannotRun as NoApps
from tests.helpers import fenced_blocks

REPO = Path(__file__).resolve().parents[2]
# Where the kit lives beside the repository; VENUSNODE_KIT points elsewhere.
KIT = Path(os.environ.get("VENUSNODE_KIT", REPO.parent / "shared" / "venusnode"))
# The tier's own state dir (the chroot, about 1.3 GB), kept between runs so that setup runs once per machine.
STATE_DIR = Path(os.environ.get("GPUPPETTI_VENUS_DIR", "/tmp/gpuppetti-venus"))
# A wheel to install instead of the one built from a clean clone of HEAD (to try uncommitted work in the guest).
WHEEL_ENV = "GPUPPETTI_VENUS_WHEEL"
# Debian packages the guest needs beyond the kit's own: podman and runc for the demo's containers (the kit's set
# already has python3, python3-venv, python3-pip, and busybox, which the containers' image is built from; Debian's
# busybox-static conflicts with it).
# qemu-system-arm boots the arm64 guest: in the chroot from the start, so that building the arm64 tree in the
# background never changes the chroot under a running x86-64 VM.
PACKAGES = ("podman", "runc", "qemu-system-arm")
# In the chroot: one venv per wheel (by digest), and the applications' venv.
VENVS = Path("/opt/gpuppetti-venus")
APPS_VENV = Path("/opt/gpuppetti-venus-apps")
# Lines of setup's and pip's output that mean the network, not the kit, is at fault.
UNREACHABLE = re.compile(r"Temporary failure resolving|Could not resolve|Failed to fetch|Failed getting release "
                         r"file|Network is unreachable|Connection refused|Connection timed out|No route to host|"
                         r"Name or service not known|Max retries exceeded|NewConnectionError|No matching distribution")
# What the guest kernel says when the emulated machine stops moving: a task blocked in a driver, a CPU whose timer
# stopped firing.
STALL = re.compile(r"INFO: task \S+ blocked for more than \d+ seconds|rcu: INFO: rcu_preempt detected stalls")
_SUMMARY = re.compile(r"\[venusnode\] exit (\d+) after ([0-9.]+)s wall \(guest userspace at ([0-9.]+)s, "
                      r"command ([0-9.]+)s\)")


# The arm64 guest (VENUSNODE_ARCH=arm64), a Mac's own architecture: a second tree beside the chroot, built once per
# machine by booting it emulated for debootstrap's second stage (about 20 minutes, so make test builds it in the
# background and the arm64 tests run where it is ready). Its guest has no network and no chroot to enter: the
# aarch64 wheel and its dependencies are unpacked into it from the x86-64 chroot's pip (`pip install --target` for
# the guest's platform and Python: no arm64 code runs), with small launchers for its own Python.
ARM64 = "arm64"
ARM64_TREE = STATE_DIR / "root-arm64"
ARM64_STAMP = STATE_DIR / "setup-arm64.stamp"
ARM64_WHEEL_ENV = "GPUPPETTI_VENUS_ARM64_WHEEL"
ARM64_LOG = STATE_DIR / "setup-arm64.log"
# In the arm64 tree: one directory per wheel (by digest) and one for the applications, each with bin/python.
ARM64_SITES = Path("/opt/gpuppetti-venus-arm64")
ARM64_APPS = Path("/opt/gpuppetti-venus-arm64-apps")
# In the x86-64 chroot: a venv whose pip downloads for the guest (the same Debian release: the same Python 3.13).
ARM64_PIP = Path("/opt/gpuppetti-venus-pip")
GUEST_PYTHON = "3.13"
# Every manylinux tag an aarch64 wheel may carry that trixie's glibc (2.41) runs.
ARM64_PLATFORMS = ("manylinux2014_aarch64", *(f"manylinux_2_{minor}_aarch64" for minor in range(17, 42)))


# The x86-64 guest's applications: wgpu, and llama.cpp's llama-server with its Vulkan backend (x86-64 only).
APPS = (WGPU, LLAMA_SERVER)
# llama.cpp in the x86-64 guest: the models written here (tests/apps/tiny_llama.py) and the apps' tests' script.
LLAMA_WRITER = REPO / "tests" / "apps" / "tiny_llama.py"
LLAMA_SMALL = ("--embd", "256", "--ff", "512", "--layers", "4", "--seed", "1")
# 560 MiB of weights: past a slice of 512 MiB.
LLAMA_LARGE = ("--embd", "1024", "--ff", "2048", "--layers", "14", "--seed", "2")


class CannotRun(Exception):
    """The tier cannot run here; the message is the one-line reason its tests skip with."""


def guide_virtio_config() -> str:
    """The Apple-silicon guide's config for Apple's GPU in a VM: the yaml block with ``backend: drm`` and
    ``virtio:`` under its heading "The config in the VM" in docs/apple-silicon.md (the guide shows others, e.g.
    one naming the host agent, which this tier's guest has none of)."""
    text = (REPO / "docs" / "apple-silicon.md").read_text()
    section = text.split("\n## The config in the VM\n", 1)[1].split("\n## ", 1)[0]
    [block] = [body for language, body in fenced_blocks(section)
               if language == "yaml" and "backend: drm" in body and "\nvirtio:" in body]
    return block


def why_not() -> str | None:
    """Why the venus VM cannot run here, in one line; None when it can."""
    if os.geteuid() != 0:
        return "the venus tier needs root (the kit's chroot and VM run as root)"
    if not (KIT / "run.sh").is_file():
        return f"no venusnode kit at {KIT} (set VENUSNODE_KIT to its directory)"
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is missing (Debian: util-linux)"
    return None


@dataclass
class Timings:
    """Where the tier's time went, for the summary at the end of the run."""

    entries: list[tuple[str, float]] = field(default_factory=list)

    def add(self, what: str, seconds: float) -> None:
        self.entries.append((what, seconds))
        # Also in the state dir: under pytest-xdist the summary at the end is the controller's, which never loads
        # this tier's conftest, so the last run's figures are read there.
        with contextlib.suppress(OSError):
            (STATE_DIR / "last-run-timings.txt").write_text("\n".join(self.lines()) + "\n")

    def lines(self) -> list[str]:
        total = sum(seconds for _, seconds in self.entries)
        return [f"{what}: {seconds:.1f}s" for what, seconds in self.entries] + [f"total: {total:.1f}s"]


TIMINGS = Timings()


# One user of the chroot at a time: a run installs its wheel's venv there and removes the others', so a second run
# (another checkout's make test, a tier started by hand) waits for the first rather than losing its venv.
LOCK = STATE_DIR.parent / f"{STATE_DIR.name}.lock"


def machine_lock() -> contextlib.AbstractContextManager[None]:
    return helpers.machine_lock(LOCK, f"venus tier: waiting for another run to finish with {STATE_DIR}")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "VENUSNODE_DIR": str(STATE_DIR), **extra}


def arm64_why_not() -> str | None:
    """Why the arm64 guest cannot run here, in one line; None when its tree is ready."""
    if (reason := why_not()) is not None:
        return reason
    if not ARM64_STAMP.is_file() or not ARM64_TREE.is_dir():
        return (f"the arm64 guest's tree is not built in {STATE_DIR} yet (about 20 minutes once per machine, "
                f"emulated; make test builds it in the background, its log is {ARM64_LOG})")
    return None


def setup_arm64() -> int:
    """Build the arm64 guest's tree (the kit's setup with VENUSNODE_ARCH=arm64): at once where it is built, else
    about 20 minutes, niced. Its output goes to ARM64_LOG; returns setup's exit status."""
    started = time.monotonic()
    with ARM64_LOG.open("w") as log:
        done = subprocess.run([str(KIT / "setup.sh")], env=_env(VENUSNODE_ARCH=ARM64,
                                                                  VENUSNODE_PACKAGES=" ".join(PACKAGES)),
                              stdout=log, stderr=subprocess.STDOUT, timeout=7200, check=False)
    TIMINGS.add("setup.sh, arm64 tree", time.monotonic() - started)
    return done.returncode


def _launchers(site: Path, host: Path) -> None:
    """bin/python (and bin/gpuppetti where the package is there) for the guest: its own Python with ``site`` on
    its path, as a venv's would be."""
    bin_dir = host / "bin"
    shutil.rmtree(bin_dir, ignore_errors=True)  # pip's scripts name the x86-64 chroot's interpreter
    bin_dir.mkdir(parents=True)
    launchers = {"python": 'exec /usr/bin/python3 "$@"'}
    if (host / "site" / "gpuppetti").is_dir():
        launchers["gpuppetti"] = 'exec /usr/bin/python3 -m gpuppetti "$@"'
    for name, line in launchers.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexport PYTHONPATH="{site}/site"\n{line}\n')
        path.chmod(0o755)


def _pip_for_arm64(target: Path, requirements: tuple[str, ...], binds: tuple[Path, ...]) -> None:
    """``requirements`` (and their dependencies) unpacked into ``target`` (a path of the arm64 tree, bound into the
    x86-64 chroot at the same path) for the guest's platform. Raises CannotRun or RuntimeError."""
    platforms = " ".join(f"--platform {platform}" for platform in ARM64_PLATFORMS)
    script = (f"[ -x {ARM64_PIP}/bin/pip ] || python3 -m venv {ARM64_PIP} && {ARM64_PIP}/bin/pip install --quiet "
              f"--disable-pip-version-check --only-binary=:all: --implementation cp --python-version "
              f"{GUEST_PYTHON} {platforms} --target {target}/site {' '.join(requirements)}")
    done = chroot("sh", "-c", script, binds=(target, *binds))
    if done.returncode != 0:
        raise _pip_failed(" ".join(requirements) + " for arm64", done)


def install_arm64(wheel: Path, apps: tuple[str, ...]) -> tuple[Path, Path]:
    """The aarch64 ``wheel`` and the applications unpacked into the arm64 tree, once per wheel (by digest) and per
    set of applications. Returns their directories in the guest (each with bin/python, the wheel's with
    bin/gpuppetti). Raises CannotRun or RuntimeError."""
    site = ARM64_SITES / wheel_digest(wheel)
    host = ARM64_TREE / site.relative_to("/")
    if not (host / ".installed").is_file():
        started = time.monotonic()
        shutil.rmtree(ARM64_TREE / ARM64_SITES.relative_to("/"), ignore_errors=True)  # older wheels' go
        host.mkdir(parents=True)
        _pip_for_arm64(host, (str(wheel),), (wheel.parent,))
        _launchers(site, host)
        (host / ".installed").write_text("")
        TIMINGS.add(f"pip install {wheel.name} into the arm64 tree", time.monotonic() - started)
    apps_host = ARM64_TREE / ARM64_APPS.relative_to("/")
    wanted = "\n".join(apps) + "\n"
    stamp = apps_host / ".requirements"
    if not (stamp.is_file() and stamp.read_text() == wanted):
        started = time.monotonic()
        shutil.rmtree(apps_host, ignore_errors=True)
        apps_host.mkdir(parents=True)
        _pip_for_arm64(apps_host, apps, ())
        _launchers(ARM64_APPS, apps_host)
        stamp.write_text(wanted)
        TIMINGS.add(f"pip install {' '.join(apps)} into the arm64 tree", time.monotonic() - started)
    return site, ARM64_APPS


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def setup() -> None:
    """The kit's chroot with the tier's packages: built once (about 1.5 to 3 minutes), then at once. Raises
    CannotRun where the Debian archive cannot be reached, RuntimeError where setup fails otherwise."""
    started = time.monotonic()
    done = subprocess.run([str(KIT / "setup.sh")], env=_env(VENUSNODE_PACKAGES=" ".join(PACKAGES)),
                          capture_output=True, text=True, timeout=1800, check=False)
    TIMINGS.add("setup.sh", time.monotonic() - started)
    if done.returncode == 0:
        return
    output = done.stdout + done.stderr
    for log in ("debootstrap.log", "apt.log"):
        with contextlib.suppress(OSError):
            output += (STATE_DIR / log).read_text(errors="replace")[-20000:]
    if (match := UNREACHABLE.search(output)) is not None:
        raise CannotRun(f"venusnode setup cannot reach the Debian archive ({match.group(0)})")
    raise RuntimeError(f"venusnode setup.sh failed ({done.returncode}):\n{_tail(done.stdout + done.stderr, 30)}")


def chroot(*command: str, binds: tuple[Path, ...] = (), timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """``command`` run in the kit's chroot (natively, no VM), with ``binds`` at their own paths."""
    args = [str(KIT / "chroot.sh")]
    for bind in binds:
        args += ["--bind", str(bind)]
    return subprocess.run([*args, "--", *command], env=_env(), capture_output=True, text=True, timeout=timeout,
                          check=False)


def _pip_failed(what: str, done: subprocess.CompletedProcess[str]) -> Exception:
    output = done.stdout + done.stderr
    if (match := UNREACHABLE.search(output)) is not None:
        return CannotRun(f"cannot install {what} in the venusnode chroot: PyPI unreachable ({match.group(0)})")
    return RuntimeError(f"installing {what} in the venusnode chroot failed ({done.returncode}):\n{_tail(output)}")


def wheel_digest(wheel: Path) -> str:
    """What the wheel holds, by its members' names and checksums (a rebuild of the same tree gives the same)."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        for info in sorted(archive.infolist(), key=lambda member: member.filename):
            digest.update(f"{info.filename}\0{info.CRC:08x}\0".encode())
    return digest.hexdigest()[:16]


def install_wheel(wheel: Path) -> Path:
    """A venv in the chroot with ``wheel`` installed by pip, its dependencies from PyPI; one per wheel (by digest),
    kept for the next run. Returns the venv's path (the same in the chroot and the guest)."""
    venv = VENVS / wheel_digest(wheel)
    root = STATE_DIR / "root"
    if (root / venv.relative_to("/") / ".installed").is_file():
        return venv
    started = time.monotonic()
    # Older wheels' venvs go: the chroot is the guest's whole root.
    script = (f"rm -rf {VENVS} && python3 -m venv {venv} && {venv}/bin/pip install --quiet "
              f"--disable-pip-version-check {wheel} && touch {venv}/.installed")
    done = chroot("sh", "-c", script, binds=(wheel.parent,))
    TIMINGS.add(f"pip install {wheel.name} in the chroot", time.monotonic() - started)
    if done.returncode != 0:
        raise _pip_failed(wheel.name, done)
    return venv


def install_apps(requirements: tuple[str, ...]) -> Path:
    """The applications' venv in the chroot (wgpu from PyPI), apart from gpuppetti's, as a workload's own."""
    stamp = STATE_DIR / "root" / APPS_VENV.relative_to("/") / ".requirements"
    wanted = "\n".join(requirements) + "\n"
    if stamp.is_file() and stamp.read_text() == wanted:
        return APPS_VENV
    started = time.monotonic()
    # Quoted: a requirement may carry an environment marker (`; platform_machine == ...`).
    quoted = " ".join(shlex.quote(requirement) for requirement in requirements)
    script = (f"rm -rf {APPS_VENV} && python3 -m venv {APPS_VENV} && {APPS_VENV}/bin/pip install --quiet "
              f"--disable-pip-version-check {quoted} && printf '%s\\n' {quoted} > {APPS_VENV}/.requirements")
    done = chroot("sh", "-c", script)
    TIMINGS.add(f"pip install {' '.join(requirements)} in the chroot", time.monotonic() - started)
    if done.returncode != 0:
        raise _pip_failed(" ".join(requirements), done)
    return APPS_VENV


def write_llama(directory: Path) -> None:
    """llama.cpp's part of the x86-64 guest's batch, in ``directory`` (under the VM's share): the models, and the
    scripts that run llama-server on each (small.sh fits a slice, large.sh does not). Where the models cannot be
    written here, ``skipped`` says why instead, and the guest runs no llama.cpp. Blocks for seconds."""
    from tests.apps.test_llama_cpp import script  # the apps' own script, so that both tiers judge the same run

    directory.mkdir()
    found = sorted((STATE_DIR / "root" / APPS_VENV.relative_to("/")).glob(
        f"lib/python*/site-packages/{LLAMA_SERVER_PACKAGE}/bin/llama-server"))
    try:
        if not found:
            raise NoApps(f"{LLAMA_SERVER.split(';')[0]} is not installed in the guest's {APPS_VENV}")
        python = app_venv()
    except NoApps as exc:
        (directory / "skipped").write_text(f"{exc}\n")
        return
    server = Path("/") / found[0].relative_to(STATE_DIR / "root")
    for name, shape, tokens in (("small", LLAMA_SMALL, 16), ("large", LLAMA_LARGE, 2)):
        model = directory / f"{name}.gguf"
        subprocess.run([str(python), str(LLAMA_WRITER), str(model), *shape], check=True, timeout=300)
        (directory / f"{name}.sh").write_text(script(server, tokens, str(model)))


@dataclass(frozen=True)
class GuestRun:
    """One VM: the command's exit status and output, and where the time went; ``stalled`` says why the VM was
    stopped early (its guest kernel reported a stall), None where it ran to the end."""

    code: int
    stdout: str
    stderr: str
    wall: float
    boot: float | None  # until the guest's userspace ran
    command: float | None
    stalled: str | None = None

    def tail(self) -> str:
        return _tail(self.stdout + "\n" + self.stderr, 40)


def _stall(runs: Path, before: set[str]) -> str | None:
    """A stall the guest kernel reported on its console, in the run directories made since ``before``."""
    for run in sorted(runs.glob("run.*")):
        if run.name in before:
            continue
        try:
            with (run / "serial.log").open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 65536))
                text = log.read().decode(errors="replace")
        except OSError:
            continue
        if (match := STALL.search(text)) is not None:
            return match.group(0)
    return None


def run_vm(label: str, command: list[str], share: Path, *, hostmem: str = "1G", mem: str = "2G",
           guest_lavapipe: bool = False, timeout: int = 900, arch: str | None = None,
           env: dict[str, str] | None = None) -> GuestRun:
    """Boot one VM (``arch`` arm64 for the arm64 guest) with ``share`` read-write at its own path, run ``command``
    in it with ``env``, power it off. A VM whose guest kernel reports a stall (a task blocked in the virtio-gpu
    driver, a vCPU whose timer stopped: the emulated machine, not the project) is stopped at once rather than left
    to its timeout."""
    args = [str(KIT / "run.sh"), "--share", str(share), "--hostmem", hostmem, "--mem", mem, "--timeout",
            str(timeout)]
    if guest_lavapipe:
        args.append("--guest-lavapipe")
    for name, value in (env or {}).items():
        args += ["--env", f"{name}={value}"]
    runs = STATE_DIR / "runs"
    before = {run.name for run in runs.glob("run.*")}
    started = time.monotonic()
    stalled: str | None = None
    with subprocess.Popen([*args, "--", *command], env=_env(**({"VENUSNODE_ARCH": arch} if arch else {})),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        output: dict[str, str] = {}
        readers = [threading.Thread(target=lambda name, stream: output.__setitem__(name, stream.read()),
                                    args=(name, stream), daemon=True)
                   for name, stream in (("stdout", process.stdout), ("stderr", process.stderr))]
        for reader in readers:
            reader.start()
        while True:
            try:
                process.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - started > timeout + 120:
                process.kill()
                break
            if (stalled := _stall(runs, before)) is not None:
                process.terminate()
                break
        process.wait()
        for reader in readers:
            reader.join(30)
    if stalled is not None:
        # run.sh keeps the directory of a run that did not end well; this one's story is told here.
        for run in runs.glob("run.*"):
            if run.name not in before:
                shutil.rmtree(run, ignore_errors=True)
    wall = time.monotonic() - started
    TIMINGS.add(f"VM {label}" + (" (stalled, stopped)" if stalled else ""), wall)
    stderr = output.get("stderr", "")
    match = _SUMMARY.search(stderr)
    return GuestRun(process.returncode, output.get("stdout", ""), stderr, wall,
                    float(match.group(3)) if match else None, float(match.group(4)) if match else None, stalled)


@dataclass(frozen=True)
class Guest:
    """What the VMs run: the chroot's venv with the project's wheel, and the applications' venv."""

    venv: Path
    apps: Path


@dataclass(frozen=True)
class Batch:
    """One VM's batch: its run, and what its guest script wrote to ``out``."""

    run: GuestRun
    out: Path

    def text(self, name: str) -> str:
        path = self.out / name
        return path.read_text(errors="replace") if path.exists() else ""

    def json(self, name: str) -> Any:
        text = self.text(name)
        assert text.strip(), f"the guest wrote no {name}:\n{self.context()}"
        return json.loads(text)

    def code(self, name: str) -> int | None:
        text = self.text(f"{name}.rc").strip()
        return int(text) if text else None

    def context(self) -> str:
        """What the guest left, for a failure's message."""
        logs = []
        for path in sorted(self.out.glob("*")):
            if path.suffix in (".log", ".err", ".txt", ".rc") and path.stat().st_size:
                logs.append(f"---- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-25:]))
        return f"VM exit {self.run.code}\n{self.run.tail()}\n" + "\n".join(logs)


def prepare() -> int:
    """`python -m tests.venus.venusnode`: the kit's chroot and the applications' venv in it, made ahead of the tier
    (make test does this in the background while other tests run). Never fails: the tier's own tests report what
    could not be made, with its reason."""
    reason = why_not()
    if reason is not None:
        print(f"venus tier: nothing to prepare: {reason}")
        return 0
    started = time.monotonic()
    try:
        with machine_lock():
            setup()
            install_apps(APPS)
    except (CannotRun, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"venus tier: not prepared ahead (its tests will say why): {exc}")
        return 0
    print(f"venus tier: chroot and applications ready in {STATE_DIR} after {time.monotonic() - started:.0f}s")
    return 0


def prepare_arm64() -> int:
    """`python -m tests.venus.venusnode arm64`: the arm64 guest's tree, built where it is not (make test starts this
    in the background and does not wait: the arm64 tests run where the tree is ready, and say so where not). Holds
    its own lock, not the tier's, so that the x86-64 tier runs meanwhile."""
    if why_not() is not None or ARM64_STAMP.is_file():
        return 0
    with helpers.machine_lock(STATE_DIR.parent / f"{STATE_DIR.name}-arm64.lock",
                              "venus tier: another run is building the arm64 tree"):
        if ARM64_STAMP.is_file():
            return 0
        with machine_lock():
            setup()  # the x86-64 chroot first, as the arm64 setup needs it and would change its package set
        code = setup_arm64()
    print(f"venus tier: the arm64 tree {'is ready' if code == 0 else f'failed ({code}), see {ARM64_LOG}'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(prepare_arm64() if sys.argv[1:] == [ARM64] else prepare())
