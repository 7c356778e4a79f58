#!/usr/bin/env python3
"""gpuppetti-dmem-hook: an OCI createRuntime hook that holds a container to its slices with the kernel's dmem
cgroup controller.

The daemon installs this file into its layer directory on the host, and a claim's CDI spec names it with the
container's regions as arguments (``drm/0000:03:00.0/vram0=536870912``). The runtime runs it with the container's
state on stdin once the container's process is in its cgroup; it writes ``<region> <bytes>`` to that cgroup's
``dmem.max``. It runs with the host's python3 and the standard library alone: it imports nothing of gpuppetti.

Where the kernel has no dmem controller (no ``dmem.capacity`` at the cgroup root), or no longer lists a region,
nothing is written and the container starts. Where the controller is there but the limit cannot be set, the hook
fails, and the container with it: it would run unheld while its env says it is held.

``GPUPPETTI_DMEM_CGROUP_ROOT`` names another cgroup root: a stand-in tree, whose directories the hook makes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

CGROUP_ROOT = "/sys/fs/cgroup"
ROOT_ENV = "GPUPPETTI_DMEM_CGROUP_ROOT"
PROGRAM = "gpuppetti-dmem-hook"


class HookError(Exception):
    pass


def parse_limits(args: list[str]) -> list[tuple[str, int]]:
    limits = []
    for arg in args:
        region, _, size = arg.rpartition("=")
        if not region or not size.isdigit():
            raise HookError(f"argument {arg!r} is not REGION=BYTES")
        limits.append((region, int(size)))
    return limits


def container_cgroup(state: dict[str, Any], proc: Path = Path("/proc")) -> str:
    """The container's cgroup (v2) path, from its process's /proc/PID/cgroup."""
    pid = state.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        raise HookError("the container's state names no process (pid)")
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError as exc:
        raise HookError(f"cannot read the cgroup of process {pid}: {exc.strerror or exc}") from None
    for line in lines:
        if line.startswith("0::"):
            return line[3:]
    raise HookError(f"process {pid} is in no cgroup v2 (the dmem controller is cgroup v2 only)")


def regions(root: Path) -> set[str] | None:
    try:
        text = (root / "dmem.capacity").read_text()
    except OSError:
        return None
    return {line.split()[0] for line in text.splitlines() if line.strip()}


def apply(state: dict[str, Any], limits: list[tuple[str, int]], root: Path, proc: Path = Path("/proc"),
          stand_in: bool = False) -> list[str]:
    """Write the limits the kernel knows the regions of; what was written (none where there is no controller)."""
    known = regions(root)
    if known is None:
        return []
    wanted = [(region, size) for region, size in limits if region in known]
    if not wanted:
        return []
    cgroup = root / container_cgroup(state, proc).lstrip("/")
    if stand_in:
        cgroup.mkdir(parents=True, exist_ok=True)
    written = []
    for region, size in wanted:
        line = f"{region} {size}"
        try:
            with open(cgroup / "dmem.max", "a") as f:
                f.write(line + "\n")
        except OSError as exc:
            raise HookError(f"cannot write {line!r} to {cgroup / 'dmem.max'}: {exc.strerror or exc}") from None
        written.append(line)
    return written


def main(argv: list[str], stdin: TextIO, environ: dict[str, str] | os._Environ[str]) -> int:
    try:
        limits = parse_limits(argv[1:])
        state = json.loads(stdin.read() or "{}")
        if not isinstance(state, dict):
            raise HookError("the container's state on stdin is not a JSON object")
        root = environ.get(ROOT_ENV) or CGROUP_ROOT
        apply(state, limits, Path(root), stand_in=root != CGROUP_ROOT)
    except (HookError, ValueError) as exc:
        print(f"{PROGRAM}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv, sys.stdin, os.environ))
