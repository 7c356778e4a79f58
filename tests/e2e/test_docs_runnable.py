"""Every shell block the docs mark as runnable (``<!-- runnable -->`` on the line before it) works as written, pasted
the way a user pastes it: in a fresh bash, from the checkout, with the venv activated and nothing else of ours on
PATH. A block may say which exit codes are its success (``exit=0,1``: doctor exits 1 when a check fails) and what
it needs (``needs=podman``); sudo is needed where the block uses it. Where this machine lacks what a block needs,
its test is skipped saying so."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import fenced_blocks

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- runnable(?P<options>(?: [a-z]+=[^ ]+)*) -->$")
# What a command missing on PATH, or found but not runnable, looks like in bash and sudo.
NOT_FOUND = re.compile(r"command not found|: not found|No such file or directory|Permission denied")
# The few programs a block may need, by the name it says and the file that shows this machine has it.
NEEDS = {"podman": "podman", "runc": "runc", "busybox": "busybox", "sudo": "sudo"}


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    body: str
    exits: tuple[int, ...]
    needs: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def runnable_blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for number, line in enumerate(lines):
            match = MARK.match(line.strip())
            if match is None:
                continue
            following = "\n".join(lines[number + 1:])
            assert following.lstrip().startswith("```sh"), f"{doc.name}:{number + 1}: a runnable mark, no sh block"
            [(_, body)] = fenced_blocks(following)[:1]
            options = dict(option.split("=", 1) for option in match.group("options").split())
            exits = tuple(int(code) for code in options.get("exit", "0").split(","))
            needs = tuple(filter(None, options.get("needs", "").split(",")))
            if re.search(r"(^|[;&|]\s*)sudo\s", body, re.MULTILINE):
                needs += ("sudo", "root")
            found.append(Block(str(doc.relative_to(REPO)), number + 2, body, exits, needs))
    return found


BLOCKS = runnable_blocks()


def test_the_docs_mark_their_commands_for_the_users_paths() -> None:
    # The README's "when something does not work", the doctor and demo commands of docs/cli.md, a GPU node's first
    # checks: each path a user pastes from is run here.
    assert {block.doc for block in BLOCKS} >= {"README.md", "docs/cli.md", "docs/gpu-nodes.md"}


def _missing(block: Block) -> str | None:
    for need in block.needs:
        if need == "root":
            if os.geteuid() != 0:
                return "it uses sudo, which these tests run only as root (no password to type)"
        elif shutil.which(NEEDS[need]) is None and not Path(f"/bin/{NEEDS[need]}").exists():
            return f"{need} is not installed here"
    return None


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_a_runnable_block_works_as_written(block: Block, tmp_path: Path) -> None:
    if (why := _missing(block)) is not None:
        pytest.skip(f"{block.name}: {why}")
    venv = Path(sys.executable).parent
    # What `. .venv/bin/activate` leaves: the venv's bin first, then the system's; none of the test's own settings.
    env = {"PATH": f"{venv}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "VIRTUAL_ENV": str(venv.parent), "HOME": str(tmp_path), "LANG": "C.UTF-8", "TERM": "dumb"}
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.body], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    output = done.stdout + done.stderr
    assert done.returncode in block.exits, f"{block.name} exited {done.returncode}:\n{output[-3000:]}"
    assert not NOT_FOUND.search(done.stderr), f"{block.name}:\n{done.stderr[-3000:]}"
    assert "Traceback" not in output, output[-3000:]
