"""A mistake on the command line is one line that names what was wrong and, where one is close, what was meant;
output that cannot be written is one line too."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.helpers import run_cli, run_here


@pytest.mark.parametrize(("argv", "expected"), [
    (["--verison"], "gpuppetti: unknown option --verison; did you mean --version? (see 'gpuppetti --help')"),
    (["dicsover"], "gpuppetti: unknown command 'dicsover'; did you mean discover? (see 'gpuppetti --help')"),
    (["discover", "--jsn"],
     "gpuppetti: unrecognized arguments: --jsn; did you mean --json? (see 'gpuppetti discover --help')"),
    (["manifests", "--namspace", "gpu"],
     "gpuppetti: unrecognized arguments: --namspace gpu; did you mean --namespace? (see 'gpuppetti manifests --help')"),
    (["top", "--intervall=3"],
     "gpuppetti: unrecognized arguments: --intervall=3; did you mean --interval? (see 'gpuppetti top --help')"),
])
def test_a_near_miss_is_named_with_what_was_meant(argv: list[str], expected: str) -> None:
    result = run_here(*argv)
    assert (result.returncode, result.stderr.strip()) == (2, expected)


@pytest.mark.parametrize("argv", [["--frobnicate"], ["zzz"], ["discover", "--zzzzzz"]])
def test_nothing_close_is_said_without_a_guess(argv: list[str]) -> None:
    result = run_here(*argv)
    assert result.returncode == 2
    assert "did you mean" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_version_and_a_command_still_parse() -> None:
    assert run_cli("--version").stdout.startswith("gpuppetti ")
    assert run_here("manifests", "--mode", "dra").returncode == 0


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="this system has no /dev/full")
@pytest.mark.parametrize("argv", [
    ["manifests"],
    ["discover", "--config", "{config}"],
    ["discover", "--config", "{config}", "--json"],
    ["doctor", "--config", "{config}"],
    ["demo"],
    ["--help"],
])
def test_a_full_disk_is_one_line_and_exit_1(argv: list[str], tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("version: v1\nbackend: simulated\nsimulated:\n  gpus:\n    - {model: M3, memory: 8Gi}\n")
    with open("/dev/full", "w") as full:
        result = run_cli(*(word.format(config=config) for word in argv), stdout=full)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == "gpuppetti: cannot write the output: No space left on device"
    assert "Traceback" not in result.stderr


def test_a_ctrl_c_while_a_failure_is_said_is_one_line_and_130(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # The module, not the function of the same name that gpuppetti.cli exports.
    main = importlib.import_module("gpuppetti.cli.main")

    def interrupted(error: Exception) -> tuple[str, int]:
        raise KeyboardInterrupt  # the signal, arriving inside run's handler of the command's failure

    monkeypatch.setattr(main, "outcome", interrupted)
    try:
        code = main.run(["manifests", "--replicas", "0"])
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped run(): Python's traceback, and a death by SIGINT")
    assert code == 130
    assert capsys.readouterr().err == "gpuppetti: interrupted\n"
