"""Run in the venus guest, inside a container given a slice: wgpu (from PyPI) on Venus, in one process, since each
Python start with wgpu costs tens of seconds on the guest's emulated CPU. Prints one JSON line:

    {"info": ..., "double": ..., "fill": ...}

with tests/apps/wgpu_app.py's reports (it is copied beside this file): the adapter and its limits, a compute
shader's result over 1 MiB, and buffers of 32 MiB until wgpu reports an error or twice the slice is held (then
freed, and 4 MiB doubled again). ``--mapped`` instead maps buffers of 32 MiB at creation, up to 2 GiB, and says
what it obtained before the VM's host-visible window was full, and whether the device still works after.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

MIB = 2**20


def fill_mapped(wgpu: Any, device: Any, chunk_mib: int, limit_mib: int) -> dict[str, Any]:
    """Buffers mapped at creation (and written) until wgpu reports an error or ``limit_mib`` are held; then whether
    the device still works (a failed map can lose it)."""
    held: list[Any] = []
    error: dict[str, str] | None = None
    usage = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC
    while len(held) * chunk_mib < limit_mib:
        try:
            buffer = device.create_buffer(size=chunk_mib * MIB, usage=usage, mapped_at_creation=True)
            buffer.write_mapped(b"\x01" * MIB, 0)
            buffer.unmap()
        except wgpu.GPUError as failed:
            error = {"class": type(failed).__name__, "message": " ".join(str(failed).split())[:400]}
            break
        held.append(buffer)
    obtained = len(held) * chunk_mib * MIB
    for buffer in held:
        buffer.destroy()
    try:
        device.create_buffer(size=MIB, usage=wgpu.BufferUsage.STORAGE).destroy()
        after = None
    except wgpu.GPUError as failed:
        after = " ".join(str(failed).split())[:400]
    return {"obtained": obtained, "error": error, "device_error_after": after}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slice-mib", type=int, default=0, help="the slice (0: none): fill up to twice it")
    parser.add_argument("--mapped", action="store_true", help="only fill, with buffers mapped at creation")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    app: Any = importlib.import_module("wgpu_app")
    wgpu: Any = importlib.import_module("wgpu")
    report: dict[str, Any] = {}
    if args.mapped:
        _, device = app.device_for(wgpu)
        report["mapped"] = fill_mapped(wgpu, device, 32, 2048)
    else:
        report["info"] = app.info(wgpu)
        _, device = app.device_for(wgpu)
        report["double"] = app.double(wgpu, device, 1, args.seed)
        report["fill"] = app.fill(wgpu, device, 32, 2 * args.slice_mib, False, args.seed, None)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
