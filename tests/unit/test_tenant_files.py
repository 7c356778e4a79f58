"""What a tenant of an earlier version could leave in its allocation's directory (a tree deeper than any recursion,
links out of it, files that will not go, more than a pass takes), which the daemon removes once at start, and the
device plugin's records of its allocations, which no container sees."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuppetti.base.fsutil import REMOVE_DEPTH, remove_tree
from gpuppetti.layer.ledger import Terms
from gpuppetti.layer.vulkan import LayerDir, Record

MIB = 2**20


@pytest.fixture(autouse=True)
def _no_deep_tree_left(tmp_path: Path) -> Iterator[None]:
    """A tree this deep would take pytest's own clean-up of old temporary directories down (it recurses)."""
    yield
    remove_tree(tmp_path)


def _deep(top: Path, depth: int) -> None:
    """``mkdir d && cd d``, ``depth`` times, then a file: far past PATH_MAX, so built a level at a time."""
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            deeper = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
        os.close(os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


@contextlib.contextmanager
def _unremovable(path: Path) -> Iterator[None]:
    """``path`` (a file) cannot be removed while inside: immutable (as root), or in a directory not writable."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)],
                                                            capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available on this filesystem: no file root cannot remove")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.parent.chmod(0o500)
        try:
            yield
        finally:
            path.parent.chmod(0o755)


def test_a_tree_deeper_than_any_recursion_is_removed(tmp_path: Path) -> None:
    _deep(tmp_path / "tree", sys.getrecursionlimit() + 100)
    assert remove_tree(tmp_path / "tree") is None
    assert not (tmp_path / "tree").exists()


def test_a_link_is_removed_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "precious").write_text("kept")
    tree = tmp_path / "tree"
    _deep(tree, REMOVE_DEPTH + 5)
    (tree / "to-dir").symlink_to(outside)
    deepest = tree / "/".join(["d"] * (REMOVE_DEPTH + 5))
    (deepest / "to-sub").symlink_to(outside / "sub")
    (deepest / "to-file").symlink_to(outside / "sub" / "precious")
    assert remove_tree(tree) is None
    assert not tree.exists()
    assert (outside / "sub" / "precious").read_text() == "kept"


def test_a_file_that_cannot_be_removed_is_left_and_said_and_the_rest_goes(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "other").mkdir()
    (tree / "other" / "file").write_text("x")
    stuck = tree / "a" / "b" / "stuck"
    stuck.write_text("x")
    with _unremovable(stuck):
        why = remove_tree(tree)
        assert why is not None and "b" in why
        assert stuck.exists() and not (tree / "other").exists()
        assert remove_tree(tree) is not None, "still there: said again, never raised"
    assert remove_tree(tree) is None, "removable again: the next call finishes"
    assert not tree.exists()


def test_a_pass_takes_a_bounded_number_of_entries(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    for number in range(50):
        (tree / str(number)).write_text("")
    assert remove_tree(tree, limit=20) is not None
    left = len(list(tree.iterdir()))
    assert 0 < left < 50
    assert remove_tree(tree, limit=20) is not None
    assert remove_tree(tree, limit=20) is None
    assert not tree.exists()


def test_a_path_that_is_not_there_or_a_file_or_a_link(tmp_path: Path) -> None:
    assert remove_tree(tmp_path / "missing") is None
    assert remove_tree(tmp_path / "missing" / "deeper") is None
    (tmp_path / "file").write_text("")
    assert remove_tree(tmp_path / "file") is None and not (tmp_path / "file").exists()
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    assert remove_tree(tmp_path / "link") is None
    assert (tmp_path / "dir").is_dir() and not (tmp_path / "link").exists()


def test_what_an_earlier_version_let_tenants_write_goes_at_start(tmp_path: Path) -> None:
    layer = LayerDir(tmp_path / "vulkan")
    (layer.path / "allocations").mkdir(parents=True)
    _deep(layer.path / "allocations" / "dp-deep", 3000)
    (layer.path / "dra-trash" / "dra-x.0000").mkdir(parents=True)
    (layer.path / "dra-trash" / "dra-x.0000" / "left").write_text("x")
    layer.install()
    assert sorted(entry.name for entry in layer.path.iterdir()) == [
        "VkLayer_gpuppetti.json", "gpuppetti-dmem-hook", "gpuppetti-vkinfo", "ledgers", "libVkLayer_gpuppetti.so",
        "records"]


def test_a_legacy_directory_that_cannot_all_go_is_said_and_tried_at_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layer = LayerDir(tmp_path / "vulkan")
    stuck = layer.path / "allocations" / "dp-stuck" / "stuck"
    stuck.parent.mkdir(parents=True)
    stuck.write_text("x")
    with _unremovable(stuck):
        layer.install()
        assert "allocations, which an earlier version kept" in caplog.text and "tried again" in caplog.text
    layer.install()
    assert not (layer.path / "allocations").exists()


def test_the_records_are_the_daemons_and_a_record_that_does_not_parse_is_unknown(tmp_path: Path) -> None:
    layer = LayerDir(tmp_path / "vulkan")
    layer.install()
    layer.write_record("dp-a", Record(["gpu-0::1"], [Terms(512 * MIB, 250)]))
    assert stat_mode(layer.records) == 0o700 and stat_mode(layer.records / "dp-a") == 0o600
    # An earlier version's record: the units alone, a line each.
    (layer.records / "dp-legacy").write_text("gpu-0::0\n")
    (layer.records / "dp-garbage").write_bytes(b'{"units": 5, "terms": [[1]]}')
    assert layer.read_records() == {"dp-a": Record(["gpu-0::1"], [Terms(512 * MIB, 250)]), "dp-legacy": None,
                                    "dp-garbage": None}
    layer.remove_record("dp-a")
    assert "dp-a" not in layer.read_records()


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_any_mix_a_tenant_leaves_goes_and_nothing_outside_is_touched(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / "precious").write_text("kept")
    (outside / "file").write_text("kept")
    rng = random.Random(28)
    tree = tmp_path / "tree"
    tree.mkdir()
    directories = [tree]
    for number in range(600):
        where = rng.choice(directories[-40:] if rng.random() < 0.7 else directories)
        kind = rng.choice(["dir", "dir", "file", "link-dir", "link-file", "dangling", "fifo", "loop"])
        path = where / f"{kind}-{number}"
        if kind == "dir":
            path.mkdir()
            directories.append(path)
        elif kind == "file":
            path.write_bytes(b"x" * rng.randrange(100))
        elif kind == "link-dir":
            path.symlink_to(outside / "dir")
        elif kind == "link-file":
            path.symlink_to(outside / "file")
        elif kind == "dangling":
            path.symlink_to(tmp_path / "nowhere")
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to(path)
    directories[-1].chmod(0o000)
    assert remove_tree(tree) is None
    assert not tree.exists()
    assert (outside / "dir" / "precious").read_text() == "kept" and (outside / "file").read_text() == "kept"
