"""A stand-in for the NVIDIA container toolkit's hook program, under a test's host root."""

from __future__ import annotations

from pathlib import Path


def fake_toolkit(root: Path, commands: str = "create-symlinks, update-ldcache, apply-cuda-memory-limits") -> None:
    """``usr/bin/nvidia-cdi-hook`` under ``root``: a program whose --help lists its commands, as the toolkit's
    does."""
    hook = root / "usr/bin/nvidia-cdi-hook"
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(f"#!/bin/sh\necho 'COMMANDS: {commands}'\n")
    hook.chmod(0o755)
