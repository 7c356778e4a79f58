"""Fixtures shared by the end-to-end and the fault tests: a kubelet emulator, and the plugin as a subprocess."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path

import pytest

from gpuppetti.kubelet.emulator import KubeletEmulator
from tests.helpers import Daemon, PluginProcess, short_tmpdir
from tests.inprocess import InProcessPlugin
from tests.packaging import clean_clone, make_dist, only, pip_wheel, why_no_build, why_no_dist


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    base = short_tmpdir()
    directory = base / "dp"
    directory.mkdir()
    yield directory
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
async def kubelet(plugin_dir: Path) -> AsyncIterator[KubeletEmulator]:
    async with KubeletEmulator(plugin_dir) as emulator:
        yield emulator


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # Kept on the item, so that fixtures can tell in their teardown whether the test failed.
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def failed(request: pytest.FixtureRequest) -> bool:
    report = getattr(request.node, "report_call", None)
    return report is not None and report.failed


@pytest.fixture
async def start_plugin(plugin_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Daemon]]:
    """Start ``gpuppetti plugin`` on ``plugin_dir`` in the test's event loop."""
    started: list[Daemon] = []

    def start(config_text: str | None, *extra: str) -> Daemon:
        started.append(InProcessPlugin(config_text, plugin_dir, *extra))
        return started[-1]

    yield start
    await _close(started, request)


@pytest.fixture
async def start_plugin_process(
        plugin_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., PluginProcess]]:
    """Start ``gpuppetti plugin`` on ``plugin_dir`` in a process of its own, for a test that needs the process
    boundary: signals, a crash, the environment (``env``), the process's memory or file descriptors."""
    started: list[Daemon] = []

    def start(config_text: str | None, *extra: str, env: dict[str, str] | None = None) -> PluginProcess:
        plugin = PluginProcess(config_text, plugin_dir, *extra, env=env)
        started.append(plugin)
        return plugin

    yield start
    await _close(started, request)


async def _close(started: list[Daemon], request: pytest.FixtureRequest) -> None:
    for daemon in started:
        await daemon.close()
        if failed(request):
            # The daemon's own account of what happened, in the failure's captured output.
            print(f"---- {daemon.log_path} (last lines)\n" + "\n".join(daemon.log().splitlines()[-80:]))


# The DRA test bench's fixture (`cluster`).
pytest_plugins = ["tests.dra_support"]


@pytest.fixture(scope="session")
def clean_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip wheel .` builds from a clean clone of HEAD, the layer required: what the image installs."""
    reason = why_no_build()
    if reason is not None:
        pytest.skip(f"the package cannot be built from a clean clone here: {reason}")
    base = tmp_path_factory.mktemp("clean-build")
    source = clean_clone(base / "clone")
    result = pip_wheel(source, base / "dist")
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    return only(base / "dist", "gpuppetti-*.whl")


@pytest.fixture(scope="session")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `make dist` writes from a clean clone of HEAD: the sdist and a manylinux wheel per architecture."""
    reason = why_no_dist()
    if reason is not None:
        pytest.skip(f"`make dist` cannot build every architecture's wheel here: {reason}")
    clone = clean_clone(tmp_path_factory.mktemp("dist") / "gpuppetti")
    result = make_dist(clone)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return clone / "dist"
