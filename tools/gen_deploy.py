"""Render the kustomize bases under deploy/base from `gpuppetti manifests`, so that the two never disagree.

tests/unit/test_manifests.py fails when a committed base differs from what this script writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuppetti.commands import manifests

ROOT = Path(__file__).resolve().parent.parent
HEADER = "# Rendered by tools/gen_deploy.py from `gpuppetti manifests --mode {mode}`. Edit the generator, not this.\n"
BASES = {"plugin": "plugin", "dra": "dra"}


def rendered() -> dict[Path, str]:
    files: dict[Path, str] = {}
    for directory, mode in BASES.items():
        objects = manifests.render(manifests.Options(mode=mode))  # type: ignore[arg-type]
        files[ROOT / "deploy" / "base" / directory / "resources.yaml"] = (
            HEADER.format(mode=mode) + manifests.to_yaml(objects)
        )
    return files


def write_rendered(files: dict[Path, str]) -> None:
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    write_rendered(rendered())
    return 0


if __name__ == "__main__":
    sys.exit(main())
