"""Every link between the README and the guides lands: the file exists (tests/unit/test_docs.py checks that too),
and a link to a section (``cli.md#gpuppetti-plugin``, ``#what-is-enforced``) names a heading that is there, as
GitHub makes a heading's anchor. Moving a section breaks such links without any other test noticing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import fenced_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text outside fenced blocks, where a '# ' line is a comment, not a heading."""
    for _, body in fenced_blocks(text):
        text = text.replace(body, "")
    return text


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the file's headings: lowercase, punctuation dropped, spaces as hyphens, and a
    repeated heading numbered."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _prose(path.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_anchors_are_made_as_github_makes_them(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## gpuppetti host-agent: the Mac's own GPU facts\n\n```sh\n# a comment\n```\n\n"
                    "## `make test`\n\n## Notes\n\n## Notes\n")
    assert anchors(page) == {"title", "gpuppetti-host-agent-the-macs-own-gpu-facts", "make-test", "notes", "notes-1"}


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_every_relative_link_lands(doc: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z][a-z+.-]*:", target):
            continue  # https:, mailto:
        path, _, fragment = target.partition("#")
        landing = (doc.parent / path).resolve() if path else doc
        if not landing.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and landing.suffix == ".md" and fragment not in anchors(landing):
            broken.append(f"{target} (no such section in {_doc_id(landing)})")
    assert not broken, f"{_doc_id(doc)} has links that land nowhere: {broken}"
