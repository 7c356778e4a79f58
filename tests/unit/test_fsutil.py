"""Writing files that a planted link cannot redirect, with modes that do not depend on the umask."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuppetti.base.fsutil import atomic_write, make_directory
from gpuppetti.core import cdi


@pytest.fixture
def open_umask() -> Iterator[None]:
    previous = os.umask(0)
    yield
    os.umask(previous)


def test_atomic_write_replaces_a_planted_link_instead_of_following_it(tmp_path: Path, open_umask: None) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o600)
    (tmp_path / "spec.json").symlink_to(victim)
    atomic_write(tmp_path / "spec.json", b"{}", mode=0o644, durable=False)
    assert victim.read_text() == "precious" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    spec = (tmp_path / "spec.json")
    assert not spec.is_symlink() and spec.read_text() == "{}"
    assert stat.S_IMODE(spec.stat().st_mode) == 0o644, "the mode asked for, whatever the umask"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json", "victim"], "no temporary file left"


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    # A link at the temporary name makes O_EXCL fail, and a random name is used instead.
    planted = tmp_path / f".spec.json.{os.getpid()}-{threading.get_ident()}.tmp"
    planted.symlink_to(victim)
    atomic_write(tmp_path / "spec.json", b"new", durable=True)
    assert victim.read_text() == "precious"
    assert (tmp_path / "spec.json").read_text() == "new"


def test_many_specs_are_renamed_into_place_from_beside_them(tmp_path: Path, open_umask: None) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "b.json").symlink_to(victim)
    assert cdi.write_spec_files(tmp_path, {"a.json": b'{"a":1}\n', "b.json": b'{"b":2}\n'}) == {}
    assert json.loads((tmp_path / "a.json").read_text()) == {"a": 1}
    assert json.loads((tmp_path / "b.json").read_text()) == {"b": 2}
    assert victim.read_text() == "precious" and not (tmp_path / "b.json").is_symlink()
    assert {stat.S_IMODE((tmp_path / n).stat().st_mode) for n in ("a.json", "b.json")} == {0o644}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json", "victim"], "nothing else, no subdir"


def test_directories_get_their_mode_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    make_directory(tmp_path / "a" / "b", 0o755)
    assert {stat.S_IMODE((tmp_path / p).stat().st_mode) for p in ("a", "a/b")} == {0o755}


def test_make_directory_follows_no_link_it_did_not_make(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    victim.chmod(0o700)
    # A link where the directory is to be: refused, and the victim is neither used nor given the directory's mode.
    (tmp_path / "layer").mkdir()
    (tmp_path / "layer" / "allocations").symlink_to(victim)
    with pytest.raises(NotADirectoryError, match="allocations is a link: not following it"):
        make_directory(tmp_path / "layer" / "allocations", 0o755)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o700
    # Nor through atomic_write, whose parent is made the same way.
    (tmp_path / "layer" / "lib").symlink_to(victim)
    with pytest.raises(NotADirectoryError):
        atomic_write(tmp_path / "layer" / "lib" / "file", b"x")
    assert list(victim.iterdir()) == []


def test_make_directory_follows_the_links_of_the_parents_that_were_there(tmp_path: Path) -> None:
    # The node's layout, as /var/run is a link to /run: followed; what is made below it is made in the target.
    (tmp_path / "run").mkdir()
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to(tmp_path / "run")
    make_directory(tmp_path / "var" / "run" / "cdi" / "x", 0o750)
    assert (tmp_path / "run" / "cdi" / "x").is_dir()
    assert stat.S_IMODE((tmp_path / "run" / "cdi").stat().st_mode) == 0o750
