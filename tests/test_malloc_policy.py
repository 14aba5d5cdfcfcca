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
