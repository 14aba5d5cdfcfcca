"""Keep freed memory in the process for the simulator's commands (glibc only).

The simulator allocates and frees the same large tensors every client and round (batches of
photos, trunk features, per-client parameter copies). glibc's default hands every block above a
dynamic threshold back to the kernel (``mmap``/``munmap``, and trimming the heap top), so the next
allocation of the same size faults every page in again: on a whole-folder LFW run a third of the
CPU time was the kernel's (issue 31: 108 of 263 CPU-s). Raising the thresholds keeps those pages
mapped and reused; the numbers do not change (the same tensors, the same kernels), only who
zeroes the pages. A process that sets any ``MALLOC_*`` variable keeps its own choice, and
``FEDFS_MALLOC=default`` turns this off.

Only the commands that run simulations call it (``fedfs simulate``, ``demo``, ``pretrain``,
``bench``): the device runtime keeps the allocator's defaults (a phone's memory is not ours to hold).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3      # glibc's mallopt() parameters
MMAP_THRESHOLD = 1 << 30
"""Blocks below this come from the heap and are reused: a batch of 512 dlib chips is 138 MB."""
MMAP_THRESHOLD_FALLBACK = 32 << 20
"""glibc before 2.35 refuses more than 32 MiB on 64-bit."""
TRIM_THRESHOLD = -1
"""Never return the heap's free top to the kernel (glibc: ``-1`` disables trimming). A finite
threshold is not enough: ``mallopt`` takes an ``int`` (≤ 2 GiB), and a whole-folder LFW run freed
2–2.7 GB at the heap's top 30 times, each trimmed and faulted in again (48 GB of ``brk`` growth,
13 M page faults, ~70 s of system time at a 1 GiB threshold). The heap's peak is unchanged: only
memory it already reached stays mapped."""
TOP_PAD = 256 << 20
"""Extra memory asked for whenever the heap grows (fewer ``brk`` calls)."""


def keep_freed_memory(environ: dict[str, str] | None = None) -> dict[str, int] | None:
    """Raise glibc's trim / top-pad / mmap thresholds (module docstring); returns what was set,
    None where nothing was (not glibc, turned off, or the environment already tunes malloc)."""
    env = os.environ if environ is None else environ
    if env.get("FEDFS_MALLOC", "").lower() == "default" or any(k.startswith("MALLOC_") for k in env):
        return None
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):          # musl and others have no mallopt: nothing to tune
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    wanted = {"mmap_threshold": (M_MMAP_THRESHOLD, MMAP_THRESHOLD), "trim_threshold": (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
              "top_pad": (M_TOP_PAD, TOP_PAD)}
    # mallopt returns 1 on success, 0 when it refused the value: report only what took effect
    done = {name: value for name, (param, value) in wanted.items() if mallopt(param, value) == 1}
    if "mmap_threshold" not in done and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_FALLBACK) == 1:
        done["mmap_threshold"] = MMAP_THRESHOLD_FALLBACK
    return done


__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "TOP_PAD"]
