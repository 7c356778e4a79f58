"""A kubeconfig that cannot be used is one line naming the file and what is wrong, exit 2, before anything starts
(it was a 90-line exception group from inside the running driver)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuppetti.node.kube import ConfigError, read_kubeconfig
from tests.helpers import run_here

GOOD = """\
apiVersion: v1
kind: Config
current-context: here
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443"}}]
contexts: [{name: here, context: {cluster: c, user: u}}]
users: [{name: u, user: {token: t}}]
"""

BAD = {
    "truncated": (GOOD[:120], "not valid YAML at line"),
    "no-current-context": (GOOD.replace("current-context: here\n", ""), "no current context: choose one with "
                           "kubectl config use-context NAME"),
    "unknown-context": (GOOD.replace("current-context: here", "current-context: there"), "'there' not found"),
    "a-list": ("- 1\n- 2\n", "not a kubeconfig"),
    "empty": ("", "not a kubeconfig"),
}

COMMANDS = {
    "dra": ["dra", "--node-name", "n", "--backend", "simulated"],
    "plugin --label-node": ["plugin", "--label-node", "--node-name", "n", "--backend", "simulated"],
}


@pytest.mark.parametrize("command", COMMANDS, ids=list(COMMANDS))
@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_kubeconfig_is_one_line_naming_it(tmp_path: Path, command: str, case: str) -> None:
    text, says = BAD[case]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(text)
    for how in ("flag", "env"):
        argv = COMMANDS[command] + (["--kubeconfig", str(kubeconfig)] if how == "flag" else [])
        result = run_here(*argv, env={"KUBECONFIG": str(kubeconfig)} if how == "env" else None)
        lines = result.stderr.strip().splitlines()
        assert (result.returncode, len(lines)) == (2, 1), result.stderr
        assert str(kubeconfig) in lines[0] and says in lines[0], lines[0]
        assert "Traceback" not in result.stderr


def test_an_unreadable_kubeconfig_is_named(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.mkdir()  # unreadable as a file, whoever runs the test (root reads a file of mode 000)
    with pytest.raises(ConfigError, match=f"^{kubeconfig}: cannot be read: "):
        read_kubeconfig(kubeconfig)


def test_a_good_kubeconfig_and_the_first_existing_of_a_list(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(GOOD)
    assert read_kubeconfig(kubeconfig).current_context == "here"
    assert read_kubeconfig(Path(f"{tmp_path}/missing:{kubeconfig}")).current_context == "here"


def test_install_with_a_context_of_its_own_needs_no_current_context(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(GOOD.replace("current-context: here\n", ""))
    from gpuppetti.cli.main import parse

    args = parse(["install", "--kubeconfig", str(kubeconfig), "--context", "here"], {})
    assert args.kubeconfig == kubeconfig
    truncated = run_here("install", "--kubeconfig", str(tmp_path / "missing"))
    assert truncated.returncode == 2


@pytest.mark.parametrize("command", [["install"], ["dra", "--node-name", "n", "--backend", "simulated"]])
def test_a_directory_given_as_the_kubeconfig_is_said_to_be_one(tmp_path: Path, command: list[str]) -> None:
    result = run_here(*command, "--kubeconfig", str(tmp_path))
    [line] = result.stderr.strip().splitlines()
    assert result.returncode == 2
    assert f"--kubeconfig: '{tmp_path}': is a directory: give the kubeconfig file in it" in line, line
