"""bench/compare.py: which tree the daemons start from, what counts as growing beyond noise, and bad input in one
line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.compare import Compared
from bench.trees import HERE, Tree

ROOT = Path(__file__).resolve().parents[2]


def test_another_tree_s_package_is_the_one_its_daemons_import(tmp_path: Path) -> None:
    # The virtualenv reaches this checkout's package through a path file in site-packages: the other tree's src/
    # must come first, or "before" would quietly run this checkout's code.
    package = tmp_path / "src" / "gpuppetti"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text("import gpuppetti, sys; print(gpuppetti.__file__, sys.argv[1:])\n")
    tree = Tree("other", tmp_path / "src")
    ran = subprocess.run(tree.gpuppetti("plugin", "--x"), env=tree.env(), capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    assert ran.stdout.strip() == f"{package / '__init__.py'} ['plugin', '--x']"
    assert HERE.env() is None


def test_another_tree_keeps_the_pythonpath_it_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = Tree("other", tmp_path).env()
    assert env is not None and env["PYTHONPATH"] == f"{tmp_path}{os.pathsep}/elsewhere"


@pytest.mark.parametrize(("before", "after", "grew", "shrank"), [
    ([100, 104, 98], [110, 120, 115], True, False),    # every round above, by 15 %
    ([100, 104, 98], [104.5, 104.8, 105], False, False),  # every round above, by under 5 %: noise
    ([100, 130, 98], [120, 125, 121], False, False),   # 21 % higher, but a round of before is higher still
    ([100, 104, 98], [80, 82, 85], False, True),
    ([0.0, 0.0, 0.0], [0.0, 0.05, 0.0], False, False),  # idle CPU: one tick in one round is not growth
    ([0.0, 0.0], [0.05, 0.05], True, False),
])
def test_a_figure_grew_only_where_every_round_is_above_and_the_medians_differ_by_more_than_noise(
        before: list[float], after: list[float], grew: bool, shrank: bool) -> None:
    figure = Compared("f", "ms", before, after)
    assert (figure.grew, figure.shrank) == (grew, shrank)


def test_the_ratio_is_of_the_medians_and_none_where_before_is_zero() -> None:
    assert Compared("f", "ms", [1.0, 2.0, 9.0], [3.0, 4.0, 5.0]).ratio == 2.0
    assert Compared("f", "%", [0.0], [1.0]).ratio is None


def _compare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "bench/compare.py", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize(("args", "said"), [
    (["--against", "no-such-revision"], "bench-compare: --against no-such-revision: no such commit in "),
    (["--against", "HEAD", "--only", "nothing"], "--only nothing: no step's label has these words"),
    (["--against", "HEAD", "--rounds", "0"], "argument --rounds: '0' is not a whole number of at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], said: str) -> None:
    ran = _compare(*args)
    assert ran.returncode == 2
    assert said in ran.stderr and "Traceback" not in ran.stderr
