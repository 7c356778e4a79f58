"""The venus tier: gpuppetti in a VM whose GPU is a virtio-gpu driven by Mesa's Venus (../shared/venusnode).

The kit is set up once per machine (its chroot is kept in GPUPPETTI_VENUS_DIR, default /tmp/gpuppetti-venus); the
wheel built from a clean clone (or GPUPPETTI_VENUS_WHEEL) is installed into it with pip; then each module boots one
VM that runs a batch of scenarios through gpuppetti's commands and writes what it saw into a shared directory,
which the tests judge. Where the tier cannot run (not root, no kit, the Debian archive or PyPI unreachable) every
test here is skipped with a one-line reason. At the end of the run, the summary says where the tier's time went
(under pytest-xdist, whose summary never sees this conftest: $GPUPPETTI_VENUS_DIR/last-run-timings.txt).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.apps.support import WGPU
from tests.packaging import only
from tests.venus import venusnode
from tests.venus.venusnode import TIMINGS, Batch, CannotRun, Guest

GUEST = Path(__file__).resolve().parent / "guest"
WGPU_APP = venusnode.REPO / "tests" / "apps" / "wgpu_app.py"
MIB = 2**20
# The node's config: the Apple-silicon guide's virtio config with memory a CPU's lavapipe can hold (four slices of
# 512 MiB), and each slice also held to its share of the GPU's time.
NODE_CONFIG = """\
version: v1
backend: drm
virtio:
  vendor: apple
  model: Apple M3 Max
  cores: 40
  memory: 2Gi
sharing:
  enforceCompute: true
  timeSlicing:
    resources:
      - {name: apple.com/gpu, replicas: 4}
"""
SLICE = 512 * MIB
# The DRA driver's configs: the node's, its GPU published as consumable capacity (with no shares configured: 4);
# then re-sliced into partitions (by default halves, quarters and eighths), one device whose memory claims take in
# the partitions' sizes.
DRA_CONSUMABLE = NODE_CONFIG + "dra: {slicing: consumable}\n"
DRA_PARTITIONS = NODE_CONFIG + "dra: {slicing: partitions}\n"
# What the guest's DRA runner (guest/dra.py) imports from the tests: the API server and DRA kubelet stand-ins.
STANDINS = venusnode.REPO / "tests" / "standins"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/venus/" in str(item.path) and item.path.name.startswith("test_guest_"):
            item.add_marker(pytest.mark.venus)
            # The first test of a module waits for its VM (and the first of all for setup and installs).
            item.add_marker(pytest.mark.timeout(1800))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS.entries:
        terminalreporter.write_sep("-", "venus tier: where the time went")
        for line in TIMINGS.lines():
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def venus_machine() -> Iterator[None]:
    """The kit's state directory, held for the whole run (venusnode.machine_lock), once for both guests."""
    reason = venusnode.why_not()
    if reason is not None:
        pytest.skip(f"venus tier skipped: {reason}")
    with venusnode.machine_lock():
        yield


@pytest.fixture(scope="session")
def guest(request: pytest.FixtureRequest, venus_machine: None) -> Guest:
    """The chroot with this run's wheel installed."""
    given = os.environ.get(venusnode.WHEEL_ENV)
    wheel = Path(given) if given else request.getfixturevalue("clean_wheel")
    try:
        venusnode.setup()
        venv = venusnode.install_wheel(wheel)
        apps = venusnode.install_apps(venusnode.APPS)
    except CannotRun as exc:
        pytest.skip(f"venus tier skipped: {exc}")
    return Guest(venv, apps)


@pytest.fixture(scope="session")
def aarch64_wheel(dist_dir: Path) -> Path:
    """The aarch64 wheel `make dist` builds from a clean clone of HEAD: what a Mac's arm64 VM installs."""
    return only(dist_dir, "gpuppetti-*_aarch64.whl")


@pytest.fixture(scope="session")
def arm64_guest(request: pytest.FixtureRequest) -> Guest:
    """The arm64 guest's tree with this run's aarch64 wheel and the applications unpacked into it."""
    reason = venusnode.arm64_why_not()
    if reason is not None:
        pytest.skip(f"arm64 venus tier skipped: {reason}")
    given = os.environ.get(venusnode.ARM64_WHEEL_ENV)
    wheel = Path(given) if given else request.getfixturevalue("aarch64_wheel")
    request.getfixturevalue("venus_machine")
    try:
        venv, apps = venusnode.install_arm64(wheel, (WGPU,))
    except CannotRun as exc:
        pytest.skip(f"arm64 venus tier skipped: {exc}")
    return Guest(venv, apps)


# Boots of a batch's VM before its stalls fail the test.
VM_ATTEMPTS = 3


def batch(tmp_path_factory: pytest.TempPathFactory, guest: Guest, label: str, script: str,
          before: Callable[[Path], None] | None = None, **options: Any) -> Batch:
    """Boot one VM running the guest script ``script`` over a fresh work directory (shared read-write), which
    ``before`` may add to."""
    work = tmp_path_factory.mktemp(f"venus-{label}")
    if before is not None:
        before(work)
    for name in ("driver.py", "runtime.py", "dra.py", "wgpu_slice.py", script):
        shutil.copy2(GUEST / name, work / name)
    shutil.copy2(WGPU_APP, work / "wgpu_app.py")
    (work / "tests" / "standins").mkdir(parents=True)
    (work / "tests" / "__init__.py").write_text("")
    for name in ("__init__.py", "apiserver.py", "dra_kubelet.py"):
        shutil.copy2(STANDINS / name, work / "tests" / "standins" / name)
    (work / "node.yaml").write_text(NODE_CONFIG)
    (work / "dra-consumable.yaml").write_text(DRA_CONSUMABLE)
    (work / "dra-partitions.yaml").write_text(DRA_PARTITIONS)
    (work / "guide.yaml").write_text(venusnode.guide_virtio_config())
    command = ["sh", str(work / script), str(work), str(guest.venv), str(guest.apps)]
    run = venusnode.run_vm(label, command, work, **options)
    for attempt in range(2, VM_ATTEMPTS + 1):
        if run.stalled is None:
            break
        # The emulated machine stopped moving (it does, now and then, on a loaded host: in two of three CI runs on
        # two cores, once each): again, from scratch. An attempt ends as soon as the guest's kernel reports its stall.
        shutil.rmtree(work / "out", ignore_errors=True)
        run = venusnode.run_vm(f"{label}, attempt {attempt}", command, work, **options)
    result = Batch(run, work / "out")
    assert run.stalled is None, f"the {label} VM stalled {VM_ATTEMPTS} times ({run.stalled}):\n{result.context()}"
    assert run.code == 0, f"the {label} VM failed:\n{result.context()}"
    return result


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, guest: Guest) -> Iterator[Batch]:
    """The node's batch: the plugin with the kubelet emulator and containers, discover and doctor, and llama.cpp in
    a slice. The guest's own lavapipe is shown too (--guest-lavapipe), so that the GPU's driver must be told apart
    from another."""
    ran = batch(tmp_path_factory, guest, "node", "node.sh", guest_lavapipe=True,
                before=lambda work: venusnode.write_llama(work / "llama"))
    yield ran
    # The model past the slice is 560 MiB.
    (ran.out.parent / "llama" / "large.gguf").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, guest: Guest) -> Iterator[Batch]:
    """The demo's batch, in a VM whose host-visible window (256 MiB) is smaller than a slice (512 MiB)."""
    yield batch(tmp_path_factory, guest, "demo", "demo.sh", hostmem="256M")
