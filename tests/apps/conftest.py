"""Fixtures of the application tests: the node's layer directory, and the cache venv with the image it runs in."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.apps.support import CannotRun, app_venv, python_image, why_not_here
from tests.ledger_client import ServedLayer


@dataclass(frozen=True)
class PythonApp:
    """The cache venv's Python (the same path here and in the image), and the image it runs in."""

    python: Path
    image: str


def can_run() -> None:
    reason = why_not_here()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def venv_python() -> Path:
    can_run()
    try:
        return app_venv()
    except CannotRun as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def python_app(venv_python: Path) -> PythonApp:
    try:
        return PythonApp(venv_python, python_image(venv_python))
    except CannotRun as exc:
        pytest.skip(str(exc))


@pytest.fixture
def layer(tmp_path: Path) -> Iterator[ServedLayer]:
    """The layer installed as a daemon installs it, in a directory of this test's own, its allocations' ledgers
    served as a daemon serves them."""
    can_run()
    installed = ServedLayer(tmp_path / "vulkan")
    yield installed
    installed.stop()
