"""A wgpu program, run inside the test containers (with the cache venv's Python): it prints one JSON line.

    wgpu_app.py info                        the adapter as wgpu reports it: its info and limits
    wgpu_app.py double --mib N --seed S     a compute shader doubles N MiB of uint32s; the output's SHA-256
    wgpu_app.py fill --chunk C --limit L    buffers of C MiB (mapped at creation with --mapped) until wgpu reports an
                                            error or L MiB are held; then all are freed and 4 MiB are doubled
                                            (--hold FILE: write FILE when full, wait for FILE.release)
    wgpu_app.py busy --batches N --rounds R [--queued]
                                            N compute passes of R rounds of arithmetic each, timed by the GPU's
                                            timestamps: each waited for before the next (a frame at a time), or all
                                            submitted at once (--queued); the GPU time and the wall time they took

Nothing here judges the result: the tests do, against what they compute themselves. wgpu is imported by name, so
that this file type-checks where wgpu is not installed (the repository's own venv).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import random
import struct
import sys
import time
from pathlib import Path
from typing import Any

MIB = 2**20
SHADER = """
@group(0) @binding(0) var<storage, read> data_in: array<u32>;
@group(0) @binding(1) var<storage, read_write> data_out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.y * 65535u * 64u + id.x;
    if (i < arrayLength(&data_in)) {
        data_out[i] = data_in[i] * 2u;
    }
}
"""
# Work that keeps the GPU busy and touches little memory: each invocation steps a linear congruential generator.
BUSY_SHADER = """
@group(0) @binding(0) var<storage, read_write> data: array<u32>;
struct Params { rounds: u32 }
@group(0) @binding(1) var<uniform> params: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    var x = data[id.x] + id.x;
    for (var i = 0u; i < params.rounds; i = i + 1u) {
        x = x * 1664525u + 1013904223u;
    }
    data[id.x] = x;
}
"""
BUSY_INVOCATIONS = 65536
# wgpu resolves a query set into a buffer at offsets of this alignment (QUERY_RESOLVE_BUFFER_ALIGNMENT).
RESOLVE_ALIGNMENT = 256


def values(size: int, seed: int) -> bytes:
    """The input: ``size`` bytes of Python's seeded generator (the test computes what doubling them gives)."""
    return random.Random(seed).randbytes(size)


def device_for(wgpu: Any) -> tuple[Any, Any]:
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    # The adapter's own limits, not WebGPU's defaults: as large a buffer as the adapter allows.
    limits = {name: adapter.limits[name] for name in ("max-buffer-size", "max-storage-buffer-binding-size")}
    return adapter, adapter.request_device_sync(required_limits=limits)


def info(wgpu: Any) -> dict[str, Any]:
    adapter, device = device_for(wgpu)
    return {
        "wgpu": wgpu.__version__,
        "adapter": {key: adapter.info[key] for key in ("vendor", "device", "description", "adapter_type",
                                                       "backend_type")},
        "limits": dict(adapter.limits),
        "device_limits": dict(device.limits),
    }


def double(wgpu: Any, device: Any, mib: int, seed: int) -> dict[str, Any]:
    count = mib * MIB // 4
    started = time.monotonic()
    data = values(count * 4, seed)
    usage = wgpu.BufferUsage
    source = device.create_buffer_with_data(data=data, usage=usage.STORAGE)
    target = device.create_buffer(size=count * 4, usage=usage.STORAGE | usage.COPY_SRC)
    pipeline = device.create_compute_pipeline(
        layout="auto", compute={"module": device.create_shader_module(code=SHADER), "entry_point": "main"})
    bind_group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": source, "offset": 0, "size": source.size}},
        {"binding": 1, "resource": {"buffer": target, "offset": 0, "size": target.size}},
    ])
    encoder = device.create_command_encoder()
    compute = encoder.begin_compute_pass()
    compute.set_pipeline(pipeline)
    compute.set_bind_group(0, bind_group)
    groups = (count + 63) // 64
    compute.dispatch_workgroups(min(groups, 65535), (groups + 65534) // 65535, 1)
    compute.end()
    device.queue.submit([encoder.finish()])
    result = bytes(device.queue.read_buffer(target))
    source.destroy()
    target.destroy()
    return {"count": count, "sha256": hashlib.sha256(result).hexdigest(), "seconds": time.monotonic() - started}


def fill(wgpu: Any, device: Any, chunk_mib: int, limit_mib: int, mapped: bool, seed: int,
         hold: str | None) -> dict[str, Any]:
    held: list[Any] = []
    error: dict[str, str] | None = None
    usage = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC if mapped else wgpu.BufferUsage.STORAGE
    while len(held) * chunk_mib < limit_mib:
        # wgpu-py raises the device's error for the call that caused it (GPUOutOfMemoryError, GPUValidationError).
        try:
            buffer = device.create_buffer(size=chunk_mib * MIB, usage=usage, mapped_at_creation=mapped)
        except wgpu.GPUError as failed:
            lines = str(failed).strip().splitlines() or [""]
            error = {"class": type(failed).__name__, "message": " ".join(lines)[:400]}
            break
        if mapped:
            # Touch what was mapped: the memory is really there.
            buffer.write_mapped(b"\x01" * MIB, 0)
            buffer.unmap()
        held.append(buffer)
    obtained = len(held) * chunk_mib * MIB
    if hold is not None:
        # Say what was obtained, and keep it until told (the file HOLD.release): meanwhile the container's probe
        # reads what the layer counts.
        Path(f"{hold}.tmp").write_text(json.dumps({"obtained": obtained}))
        Path(f"{hold}.tmp").rename(hold)
        deadline = time.monotonic() + 60
        while not Path(f"{hold}.release").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    for buffer in held:
        buffer.destroy()
    del held
    return {"obtained": obtained, "error": error, "after": double(wgpu, device, 4, seed)}


def busy(wgpu: Any, batches: int, rounds: int, queued: bool) -> dict[str, Any]:
    """GPU time by the passes' own timestamps (wgpu's, which the layer never sees), against the wall time from the
    first submit to the last timestamps read back: the read's own submit is in it, so a wait the client still owes
    at its end is counted."""
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    device = adapter.request_device_sync(required_features=["timestamp-query"])
    usage = wgpu.BufferUsage
    data = device.create_buffer(size=BUSY_INVOCATIONS * 4, usage=usage.STORAGE)
    params = device.create_buffer_with_data(data=struct.pack("<I", rounds), usage=usage.UNIFORM)
    pipeline = device.create_compute_pipeline(
        layout="auto", compute={"module": device.create_shader_module(code=BUSY_SHADER), "entry_point": "main"})
    bind_group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": data, "offset": 0, "size": data.size}},
        {"binding": 1, "resource": {"buffer": params, "offset": 0, "size": params.size}},
    ])
    queries = device.create_query_set(type="timestamp", count=2 * batches)
    stamps = device.create_buffer(size=RESOLVE_ALIGNMENT * batches, usage=usage.QUERY_RESOLVE | usage.COPY_SRC)

    def submit(batch: int) -> None:
        encoder = device.create_command_encoder()
        compute = encoder.begin_compute_pass(timestamp_writes={
            "query_set": queries, "beginning_of_pass_write_index": 2 * batch,
            "end_of_pass_write_index": 2 * batch + 1})
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, bind_group)
        compute.dispatch_workgroups(BUSY_INVOCATIONS // 64)
        compute.end()
        encoder.resolve_query_set(queries, 2 * batch, 2, stamps, RESOLVE_ALIGNMENT * batch)
        device.queue.submit([encoder.finish()])

    # One pass before the clock starts: the pipeline compiled, and the first submit's setup, are not the workload.
    submit(0)
    device.queue.read_buffer(stamps, 0, 16)
    started = time.monotonic()
    for batch in range(batches):
        submit(batch)
        if not queued:
            device.queue.read_buffer(stamps, RESOLVE_ALIGNMENT * batch, 16)
    read = bytes(device.queue.read_buffer(stamps))
    seconds = time.monotonic() - started
    # Nanoseconds per tick: wgpu-py 0.32 has no such call (its resolved timestamps are in nanoseconds, as
    # lavapipe's ticks are); a later one that has it is asked.
    period = device.queue.get_timestamp_period() if hasattr(device.queue, "get_timestamp_period") else 1.0
    ticks = [struct.unpack_from("<2Q", read, RESOLVE_ALIGNMENT * batch) for batch in range(batches)]
    gpu_seconds = sum(end - begin for begin, end in ticks) * period / 1e9
    return {"batches": batches, "queued": queued, "gpu_seconds": gpu_seconds, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("info", "double", "fill", "busy"))
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--limit", type=int, default=1024)
    parser.add_argument("--mapped", action="store_true")
    parser.add_argument("--hold", metavar="FILE", help="fill: write FILE once filled; free when FILE.release is there")
    parser.add_argument("--batches", type=int, default=20, help="busy: compute passes")
    parser.add_argument("--rounds", type=int, default=1000, help="busy: arithmetic rounds per invocation")
    parser.add_argument("--queued", action="store_true", help="busy: submit every pass before waiting for any")
    args = parser.parse_args()
    wgpu = importlib.import_module("wgpu")
    if args.command == "info":
        report = info(wgpu)
    elif args.command == "busy":
        report = busy(wgpu, args.batches, args.rounds, args.queued)
    else:
        _, device = device_for(wgpu)
        if args.command == "double":
            report = double(wgpu, device, args.mib, args.seed)
        else:
            report = fill(wgpu, device, args.chunk, args.limit, args.mapped, args.seed, args.hold)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
