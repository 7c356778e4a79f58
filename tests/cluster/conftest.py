"""The cluster tier: one real node per test run, brought up once and always torn down.

Where the node cannot run (not root, no kit), every test here is skipped with a one-line reason that names what is
missing; `make test` runs pytest with -rs, so the reason is printed in the summary.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.realnode import IMAGE, IMAGE_VENV, KIT, REPO, STATE_DIR, RealNode, machine_lock, why_not
from tests.packaging import venv_with


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in str(item.path):
            item.add_marker(pytest.mark.cluster)
            # Pods start in seconds, but a kubelet restart or a status update period adds up.
            item.add_marker(pytest.mark.timeout(300))


@pytest.fixture(scope="session")
def realnode() -> Iterator[RealNode]:
    reason = why_not()
    if reason is not None:
        pytest.skip(f"cluster tier skipped: {reason}")
    node = RealNode(STATE_DIR)
    with machine_lock():
        try:
            node.up()
            yield node
        finally:
            node.down()


@pytest.fixture
def node(realnode: RealNode) -> Iterator[RealNode]:
    """The node, left as each test found it: its pods deleted and the gpuppetti processes it started stopped."""
    yield realnode
    realnode.delete("pods", "--all", "-n", "default", "--grace-period=0", "--force")
    realnode.delete("resourceclaims", "--all", "-n", "default")
    status = realnode.ctl("status", check=False).stdout
    for line in status.splitlines():
        name = line.split()[0]
        if name.startswith("gpuppetti"):
            realnode.ctl("stop", name, check=False)


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gp-cluster-") as directory:
        yield Path(directory)


@pytest.fixture(scope="session")
def image(realnode: RealNode, clean_wheel: Path) -> str:
    """The project's image as users get it: the wheel built from a clean clone, installed into a fresh venv as the
    Dockerfile installs it, packed and imported into the node's containerd.

    No registry is reachable and no container builder runs here, so the kit's mkimage.py packs that venv with its
    interpreter and the shared libraries they load, in place of the Dockerfile's base image.
    """
    # At a path of its own, which the image keeps: commands run in its pods name it (IMAGE_VENV).
    shutil.rmtree(IMAGE_VENV, ignore_errors=True)
    venv = venv_with(clean_wheel, IMAGE_VENV)
    entrypoint = f'["{venv / "bin" / "gpuppetti"}"]'
    with tempfile.TemporaryDirectory(prefix="gp-image-") as directory:
        archive = Path(directory) / "gpuppetti.tar"
        subprocess.run([sys.executable, str(KIT / "mkimage.py"), "venv", str(venv), IMAGE, str(archive),
                        "--entrypoint", entrypoint], check=True, capture_output=True, timeout=600, cwd=REPO)
        realnode.import_image(archive)
    return IMAGE
