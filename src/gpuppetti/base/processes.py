"""A child process run to its end within a deadline: what the doctor's probe, the sandbox's podman and the demo's
image builds share."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

PIPE = asyncio.subprocess.PIPE


async def run_within(argv: Sequence[str], timeout: float, *, env: Mapping[str, str] | None = None,
                     stdin: Any = None, stdout: Any = PIPE, stderr: Any = PIPE) -> tuple[int, bytes, bytes]:
    """``argv``'s exit status and output. Raises OSError where it cannot start, and TimeoutError once a process
    that outlived ``timeout`` is killed and reaped (never left behind as a zombie)."""
    process = await asyncio.create_subprocess_exec(*argv, stdin=stdin, stdout=stdout, stderr=stderr,
                                                   env=None if env is None else dict(env))
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode or 0, out or b"", err or b""
