"""The simulator's commands keep freed memory mapped (fedfs_sdk.malloc_policy, issue 31): set on
glibc, never where the environment already tunes malloc or asks for the default."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedfs_sdk.malloc_policy import MMAP_THRESHOLD, TOP_PAD, TRIM_THRESHOLD, keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]


def _glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def test_the_environment_wins() -> None:
    assert keep_freed_memory({"FEDFS_MALLOC": "default"}) is None
    assert keep_freed_memory({"MALLOC_ARENA_MAX": "2"}) is None


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt only")
def test_glibc_takes_every_threshold_in_a_fresh_process() -> None:
    code = "from fedfs_sdk.malloc_policy import keep_freed_memory as k; print(sorted(k({}).items()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(sorted({"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD,
                                             "top_pad": TOP_PAD}.items()))


_HEAP_TOP_PROBE = """
import ctypes, sys
from fedfs_sdk.malloc_policy import keep_freed_memory
keep_freed_memory({})
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
# three 900 MB blocks (below the mmap threshold: from the heap, never touched, so nothing is
# faulted in) freed at the heap's top: 2.7 GB of free top, above any finite int threshold
blocks = [libc.malloc(900 << 20) for _ in range(3)]
assert all(blocks), "malloc failed"
grown = libc.sbrk(0)
for b in reversed(blocks):
    libc.free(b)
print(grown - libc.sbrk(0))
"""


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt only")
def test_a_freed_heap_top_stays_mapped() -> None:
    # a whole-folder run freed 2-2.7 GB at the heap's top again and again; each trim made the
    # next round fault it all in again (issue 31). The break must not move back.
    out = subprocess.run([sys.executable, "-c", _HEAP_TOP_PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == 0, f"the heap gave back {int(out.stdout) >> 20} MiB when freed"
