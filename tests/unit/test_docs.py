"""The README and the guides tell the truth: every path, make target, flag, env var and config key they name
exists, and every config they show validates."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from rich.cells import cell_len

from bench.compare import build_parser as compare_bench_parser
from bench.scale import build_parser as scale_bench_parser
from gpuppetti.cli.parser import build_parser
from gpuppetti.core.config import Config, ConfigError, parse_config
from gpuppetti.dra import opaque
from tests.helpers import fenced_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
# The package and its build (setup.py reads GPUPPETTI_REQUIRE_LAYER).
# The layer's C reads its own env vars (GPUPPETTI_VK_*).
SOURCE = "\n".join(path.read_text() for path in [*(ROOT / "src").rglob("*.py"), ROOT / "setup.py",
                                                  *(ROOT / "native" / "vulkan-layer").glob("*.[ch]")])
PARSER = build_parser()
COMMAND_FLAGS = {name: {s for action in sub._actions for s in action.option_strings}
                 for name, sub in PARSER.commands.items()}
ALL_FLAGS = set().union(*COMMAND_FLAGS.values())
# Flags of other tools that the guides show, next to gpuppetti's.
OTHER_TOOLS_FLAGS = {"--driver", "--name", "--namespace", "--for", "--timeout", "--from-file", "--mode",
                     "--vm-type", "--root-dir", "--version", "--help", "--overwrite", "--summary", "--json",
                     "--idle-seconds", "--calls", "--only", "--image", "--config", "--grace-period", "--force",
                     "--kube-api-qps", "--kube-api-burst", "--max-requests-inflight",
                     *(s for parser in (scale_bench_parser(), compare_bench_parser()) for action in parser._actions
                       for s in action.option_strings)}
# Files the commands write, named as their output.
WRITTEN_BY_COMMANDS = {"bench/results.json", "bench/scale-results.json", "bench/compare-results.json"}
# Keys the migration guide names because gpuppetti does not have them.
NOT_OURS = {"sharing.mps", "flags.plugin.deviceListStrategy"}
REPO_PATH = re.compile(r"(?<![\w/.~-])((?:src|tests|docs|deploy|bench|tools|\.ci)/[\w./-]*)")
INLINE = re.compile(r"`([^`\n]+)`")
CONFIG_KEY = re.compile(r"^(?:sharing|plugin|health|hostAgent|dra|virtio|simulated|backend)(?:\.\w+(?:\[\])?)+$")


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _code(path: Path) -> list[str]:
    """Everything in code: inline spans and fenced blocks."""
    text = path.read_text()
    return INLINE.findall(text) + [body for _, body in fenced_blocks(text)]


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_path_named_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = []
    for snippet in _code(doc):
        for path in REPO_PATH.findall(snippet):
            path = path.rstrip(".,:;)")
            if "<" in path or "*" in path:
                continue
            if not (ROOT / path).exists() and path not in WRITTEN_BY_COMMANDS:
                missing.append(path)
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        if not (doc.parent / link).exists():
            missing.append(link)
    assert not missing, f"{_doc_id(doc)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_make_target_exists(doc: Path) -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    named = {m for snippet in _code(doc) for m in re.findall(r"\bmake ([a-z][\w-]*)", snippet)}
    assert named <= targets, f"{_doc_id(doc)}: no such make target: {sorted(named - targets)}"


def _commands(snippet: str) -> list[tuple[str, list[str]]]:
    """Each `gpuppetti COMMAND ...` in a snippet, with the flags on its line (continuation lines joined)."""
    joined = snippet.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        for match in re.finditer(r"(?:^|[\s/(|;&])gpuppetti ([a-z-]+)((?: +[^|;&#]*)?)", line):
            command, rest = match.group(1), match.group(2)
            before = line[: match.start(1)].split()
            if len(before) > 1 and before[-2] in ("-n", "--namespace"):
                continue  # kubectl -n gpuppetti ...: the namespace
            found.append((command, re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest)))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_command_and_flag_exists(doc: Path) -> None:
    wrong = []
    for snippet in _code(doc):
        for command, flags in _commands(snippet):
            if command not in COMMAND_FLAGS:
                # "gpuppetti host-agent" runs on a Mac, "gpuppetti-host-agent" is a Secret: both are commands here.
                wrong.append(f"gpuppetti {command}")
                continue
            wrong += [f"gpuppetti {command} {flag}" for flag in flags if flag not in COMMAND_FLAGS[command]]
        if re.fullmatch(r"--[a-z][\w-]*(?: [A-Z_|a-z]+)?", snippet.strip()):
            flag = snippet.split()[0]
            if flag not in ALL_FLAGS | OTHER_TOOLS_FLAGS:
                wrong.append(flag)
    assert not wrong, f"{_doc_id(doc)} names commands or flags that do not exist: {wrong}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_env_var_is_read_or_set_by_the_code(doc: Path) -> None:
    named = set(re.findall(r"\b(GPUPPETTI_[A-Z0-9_]*[A-Z0-9])\b", doc.read_text()))
    unknown = {name for name in named if f'"{name}' not in SOURCE and f"'{name}" not in SOURCE}
    assert not unknown, f"{_doc_id(doc)} names env vars nothing reads or sets: {sorted(unknown)}"


def _field(model: type[BaseModel], key: str) -> Any:
    for name, field in model.model_fields.items():
        if (field.alias or name) == key:
            return field.annotation
    raise KeyError(key)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _resolves(model: type[BaseModel], parts: list[str]) -> bool:
    try:
        annotation = _field(model, parts[0].removesuffix("[]"))
    except KeyError:
        return False
    if len(parts) == 1:
        return True
    return any(_resolves(inner, parts[1:]) for inner in _models_in(annotation))


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_config_key_named_exists(doc: Path) -> None:
    keys = {span for span in INLINE.findall(doc.read_text()) if CONFIG_KEY.match(span)}
    unknown = [key for key in sorted(keys - NOT_OURS)
               if not _resolves(Config, key.split(".")) and not _resolves(opaque.GpuConfig, key.split("."))]
    assert not unknown, f"{_doc_id(doc)} names config keys that do not exist: {unknown}"


SECTIONS = {field.alias or name for name, field in Config.model_fields.items()}


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_config_shown_validates(doc: Path) -> None:
    checked = 0
    for language, body in fenced_blocks(doc.read_text()):
        if language != "yaml":
            continue
        documents = [d for d in yaml.safe_load_all(body) if isinstance(d, dict)]
        for document in documents:
            if document.get("apiVersion") == opaque.API_VERSION:
                opaque.decode(document, _doc_id(doc))
                checked += 1
            elif "apiVersion" not in document and set(document) <= SECTIONS | {"version"}:
                text = body if "version" in document else "version: v1\n" + body
                try:
                    parse_config(text, _doc_id(doc))
                except ConfigError as exc:
                    pytest.fail(f"a config in {_doc_id(doc)} does not validate:\n{exc}")
                checked += 1
    shows_configs = ("README.md", "configuration.md", "apple-silicon.md", "kind.md", "migrating-from-nvidia.md")
    if doc.name in shows_configs and doc.parent != ROOT / "bench":
        assert checked, f"{_doc_id(doc)} shows configs, and none was checked"


CODE_WIDTH = 100


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=_doc_id)
def test_every_code_block_line_fits_100_columns(doc: Path) -> None:
    """A code line wider than the page scrolls sideways, so a reader pastes less than the command. Measured as the
    file holds it, a list's indent included: that is what an editor and a terminal show."""
    wide, fence = [], False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        elif fence and cell_len(line) > CODE_WIDTH:
            wide.append(f"line {number} ({cell_len(line)} columns)")
    assert not wide, f"{_doc_id(doc)}: code lines wider than {CODE_WIDTH} columns: {wide}"


def test_the_mac_guide_makes_the_directories_it_writes_into_and_says_how_to_get_vmnet_helper() -> None:
    # A fresh account has no ~/Library/LaunchAgents; "the command on minikube's page" is no command.
    text = (ROOT / "docs" / "apple-silicon.md").read_text()
    for _, body in fenced_blocks(text):
        for written in re.findall(r">\s*(~/Library/\S+)/[^/\s]+", body):
            assert f"mkdir -p {written}" in body.split(f"> {written}")[0], f"{written} is written before it is made"
    assert "releases/latest/download/install.sh | bash" in text and "minikube.sigs.k8s.io/docs/drivers/krunkit" in text
    assert "socketfilterfw" in text, "the firewall's question for an agent on 0.0.0.0 is said"
