"""Which tree's gpuppetti the benchmark's daemons start from: this checkout's, as the virtualenv installed it, or
another revision's sources (bench/compare.py exports and builds one), put first on the daemons' PYTHONPATH.

Only the daemons change trees: the benchmark itself, its kubelet emulator and API stand-in stay this checkout's,
so that both trees are driven and timed by the same code."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Tree:
    name: str = "this checkout"
    # Another tree's src/ directory; None: the package the virtualenv has.
    src: Path | None = None

    def gpuppetti(self, *args: str) -> list[str]:
        """The command line that runs ``gpuppetti ARGS`` from this tree."""
        return [sys.executable, "-m", "gpuppetti", *args]

    def env(self) -> dict[str, str] | None:
        """The environment the daemons start with; None: this process's own."""
        if self.src is None:
            return None
        # Ahead of the virtualenv's own path to this checkout's package, which site-packages adds after it.
        inherited = os.environ.get("PYTHONPATH")
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.src), *([inherited] if inherited else [])])}


HERE = Tree()
