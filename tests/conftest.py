"""Fixtures shared by the end-to-end and the fault tests: a kubelet emulator, and the plugin as a subprocess."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from gpuppetti.kubelet.emulator import KubeletEmulator
from tests.helpers import PluginProcess, short_tmpdir


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


@pytest.fixture
def start_plugin(plugin_dir: Path) -> Iterator[Callable[..., PluginProcess]]:
    started: list[PluginProcess] = []

    def start(config_text: str | None, *extra: str, env: dict[str, str] | None = None) -> PluginProcess:
        process = PluginProcess(config_text, plugin_dir, *extra, env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


# The DRA test bench's fixture (`cluster`).
pytest_plugins = ["tests.dra_support"]
