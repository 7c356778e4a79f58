"""What the layer's accounting says a slice holds counts only live processes: each holds an open-file-description
lock on its slot's byte, which the kernel drops when the process dies (however it dies, in whatever PID namespace),
and the reader counts a slot only while its lock is held, plus the exported memory that outlives every process."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

from gpuppetti.layer.vulkan import (
    ACCT_FIGURE_LIMIT,
    ACCT_LOCK_BASE,
    ACCT_SLOT_BYTES_OFFSET,
    ACCT_UNOWNED_OFFSET,
    LayerDir,
    read_use,
)

MIB = 2**20
# What a process of the layer does (accounting.c): read-lock its slot's byte, through a description of its own.
HOLDER = """
import fcntl, os, struct, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
lock = struct.pack("@hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, int(sys.argv[2]), 1, 0)
fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
print("holding", flush=True)
time.sleep(600)
"""


def accounting_file(tmp_path: Path) -> Path:
    layer = LayerDir(tmp_path / "vulkan")
    layer.allocations.mkdir(parents=True)
    layer.create("a", [256 * MIB])
    return layer.allocations / "a" / "slice-0.acct"


def write(path: Path, offset: int, value: int) -> None:
    with path.open("r+b") as acct:
        acct.seek(offset)
        acct.write(struct.pack("<q", value))


def holder(path: Path, slot: int) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(ACCT_LOCK_BASE + slot)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "holding\n"
    return process


def test_a_killed_processs_memory_leaves_the_figure_as_it_dies(tmp_path: Path) -> None:
    path = accounting_file(tmp_path)
    write(path, 24, 96 * MIB + 4 * MIB)  # the total, which still counts what the dead held
    write(path, ACCT_SLOT_BYTES_OFFSET + 8 * 3, 96 * MIB)
    write(path, ACCT_SLOT_BYTES_OFFSET + 8 * 7, 4 * MIB)  # a process that died long ago: no lock
    process = holder(path, 3)
    try:
        use = read_use(str(path), 0)
        assert use is not None and use.used == 96 * MIB and use.budget == 256 * MIB
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    use = read_use(str(path), 0)
    assert use is not None and use.used == 0, "a killed container's memory is gone from the figure at once"


def test_exported_memory_counts_with_no_process_left(tmp_path: Path) -> None:
    path = accounting_file(tmp_path)
    write(path, ACCT_UNOWNED_OFFSET, 200 * MIB)
    use = read_use(str(path), 0)
    assert use is not None and use.used == 200 * MIB


def test_a_tenants_numbers_are_clamped(tmp_path: Path) -> None:
    path = accounting_file(tmp_path)
    write(path, 16, -5)
    write(path, ACCT_SLOT_BYTES_OFFSET, 2**63 - 1)
    write(path, ACCT_SLOT_BYTES_OFFSET + 8, 2**63 - 1)
    write(path, ACCT_SLOT_BYTES_OFFSET + 16, -(2**63))
    write(path, ACCT_UNOWNED_OFFSET, 2**63 - 1)
    processes = [holder(path, slot) for slot in range(3)]
    try:
        use = read_use(str(path), 0)
    finally:
        for process in processes:
            process.send_signal(signal.SIGKILL)
            process.wait()
    assert use is not None and use.budget == 0 and use.used == ACCT_FIGURE_LIMIT


def test_a_truncated_file_reads_what_it_still_holds(tmp_path: Path) -> None:
    path = accounting_file(tmp_path)
    write(path, ACCT_SLOT_BYTES_OFFSET, 8 * MIB)
    process = holder(path, 0)
    try:
        os.truncate(path, ACCT_SLOT_BYTES_OFFSET + 8)
        use = read_use(str(path), 0)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert use is not None and use.used == 8 * MIB and use.waited_seconds == 0


def test_a_link_to_an_accounting_file_is_not_followed(tmp_path: Path) -> None:
    path = accounting_file(tmp_path)
    link = tmp_path / "link.acct"
    link.symlink_to(path)
    assert read_use(str(path), 0) is not None
    assert read_use(str(link), 0) is None
