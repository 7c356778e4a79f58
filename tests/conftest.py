"""Fixtures shared by the end-to-end and the fault tests: a kubelet emulator, and the plugin as a subprocess."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path

import pytest

from gpuppetti.kubelet.emulator import KubeletEmulator
from tests.helpers import PluginProcess, short_tmpdir
from tests.packaging import clean_clone, only, pip_wheel, why_no_build


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
def start_plugin(plugin_dir: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., PluginProcess]]:
    started: list[PluginProcess] = []

    def start(config_text: str | None, *extra: str, env: dict[str, str] | None = None) -> PluginProcess:
        process = PluginProcess(config_text, plugin_dir, *extra, env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        if failed(request):
            # The plugin's own account of what happened, in the failure's captured output.
            print(f"---- {process.log_path} (last lines)\n" + "\n".join(process.log().splitlines()[-80:]))


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
