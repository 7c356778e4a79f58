"""A child process run to its end within a deadline: what the doctor's probe, the sandbox's podman and the demo's
image builds share; and a host's helper program (the toolkit's hook, macOS's ioreg) run with bounded output, whose
whole process group is ended at its deadline."""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

PIPE = asyncio.subprocess.PIPE
# How long a helper that has exited may still write, through what it left running, before its output counts as
# whole.
EXITED_GRACE_S = 0.1


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


class HelperFailed(Exception):
    """A helper program could not start, or outlived its deadline (then it and its children were killed)."""


def run_helper(argv: Sequence[str], timeout: float, limit: int) -> tuple[int, bytes]:
    """``argv``'s exit status and the first ``limit`` bytes of its output (stdout and stderr together; the rest is
    read and dropped). It runs in a session of its own, so that at the deadline the children it left behind, which
    would otherwise hold its output open, are killed with it. Blocks: call from a thread. Raises HelperFailed."""
    try:
        process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        raise HelperFailed(f"{argv[0]} cannot run: {exc.strerror or exc}") from None
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    kept = bytearray()
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HelperFailed(f"{argv[0]} gave no whole answer within {timeout:g}s (killed)")
                if not selector.select(min(left, EXITED_GRACE_S)):
                    if process.poll() is not None:
                        break  # it has ended, and what it left running holds its output open: enough
                    continue
                piece = os.read(process.stdout.fileno(), 65536)
                if not piece:
                    break
                kept += piece[:max(0, limit - len(kept))]
            code = process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise HelperFailed(f"{argv[0]} did not exit within {timeout:g}s (killed)") from None
    finally:
        # Whatever the helper left in its session goes with it: nothing of it outlives the call.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.stdout.close()
        process.wait()
    return code, bytes(kept)
