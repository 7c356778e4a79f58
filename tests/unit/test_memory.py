"""Giving freed memory back: after a burst, the heap's free pages leave the process's resident memory."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# In a fresh interpreter, whose heap no earlier test has shaped: 64 MiB in blocks glibc's heap holds (above
# pymalloc's 512 bytes, below mmap's 128 KiB), each followed by a small block that stays, so that the heap's top is
# pinned and nothing goes back by itself when the burst is freed. Prints the resident memory once the burst is
# freed, and then once more after the call (or not) under test.
BURST = """
import sys
from gpuppetti.base.memory import give_back_free_memory

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096

burst, kept = [], []
for _ in range(1024):
    burst.append(bytes(65536))
    kept.append(bytearray(600))
del burst
before = resident()
if sys.argv[1] == "give back":
    give_back_free_memory()
print(before, resident(), len(kept))
"""


def _burst(how: str) -> int:
    """How much the resident memory fell after the burst was freed, in bytes."""
    ran = subprocess.run([sys.executable, "-c", BURST, how], capture_output=True, text=True, check=True)
    before, after, _ = (int(word) for word in ran.stdout.split())
    return before - after


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's; elsewhere nothing is done")
def test_the_free_pages_of_a_burst_go_back_to_the_system() -> None:
    assert _burst("keep") < 8 * 2**20, "freed, the burst's pages stay resident by themselves"
    assert _burst("give back") > 32 * 2**20, "given back, they are no longer resident"


# In a fresh interpreter: a block a thread allocates (above pymalloc's 512 bytes, so the C library's), and whether
# it lies in the main heap ([heap] in /proc/self/maps) or in a heap of the thread's own.
THREAD_BLOCK = """
import ctypes, sys, threading
from gpuppetti.base.memory import one_heap

if sys.argv[1] == "one heap":
    one_heap()
blocks = []
thread = threading.Thread(target=lambda: blocks.append(bytearray(600)))
thread.start()
thread.join()
address = ctypes.addressof((ctypes.c_char * 600).from_buffer(blocks[0]))
with open("/proc/self/maps") as maps:
    for line in maps:
        if line.rstrip().endswith("[heap]"):
            low, high = (int(bound, 16) for bound in line.split()[0].split("-"))
            print(low <= address < high)
"""


def _in_main_heap(how: str) -> bool:
    ran = subprocess.run([sys.executable, "-c", THREAD_BLOCK, how], capture_output=True, text=True, check=True)
    return ran.stdout.split() == ["True"]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's; elsewhere nothing is done")
def test_with_one_heap_a_threads_blocks_come_from_the_main_heap() -> None:
    assert not _in_main_heap("as it is"), "a thread has a heap of its own by default"
    assert _in_main_heap("one heap")
