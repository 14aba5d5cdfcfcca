"""The peer-framework harness gives fedfs the other engines' work (issue 32): no do-no-harm
statistics round, no new-user evaluation; and its scheduler sampler reads real /proc entries."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("peer_frameworks")
import peer_flower  # noqa: E402
import peer_frameworks  # noqa: E402


def _args() -> argparse.Namespace:
    return argparse.Namespace(method="fedfs", clients=50, participation=0.2, rounds=2, images=20, batch_size=10,
                              backbone="mobilefacenet", image_size=112, xi_file="xi.safetensors",
                              fedfs_python=sys.executable)


def _opt(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("workers,torchrun", [(1, False), (2, False), (2, True)])
def test_fedfs_command_runs_the_other_engines_work(tmp_path: Path, workers: int, torchrun: bool) -> None:
    cmd = peer_frameworks.fedfs_command(_args(), tmp_path, workers, 1, torchrun)
    assert _opt(cmd, "--method") == "fedfs:select=off"        # no hold-out, no statistics round
    assert _opt(cmd, "--new-users") == "0"                     # no new-user evaluation
    assert _opt(cmd, "--train-per-client") == "20" and _opt(cmd, "--rounds") == "2"
    assert ("--distributed" in cmd) == torchrun
    if not torchrun:
        assert _opt(cmd, "--workers") == str(workers)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or not Path("/proc/self/schedstat").exists(),
                    reason="needs Linux /proc with schedstat")
def test_sched_sampler_reads_each_thread_of_a_real_process() -> None:
    # a child that burns CPU briefly then sleeps: its main thread's on-CPU time is positive
    p = subprocess.Popen([sys.executable, "-c", "import time\nx=sum(range(3_000_000))\ntime.sleep(30)"])
    try:
        seen: dict = {}
        for _ in range(200):
            peer_flower._sched({p.pid}, seen)
            if seen.get((p.pid, p.pid), (0, 0))[0] > 0 and open(f"/proc/{p.pid}/stat").read().split(") ")[1][0] == "S":
                break
            time.sleep(0.05)
        run, wait = seen[(p.pid, p.pid)]
        assert run > 0 and wait >= 0
        _, _, pids = peer_flower._tree(os.getpid())
        assert p.pid in pids
    finally:
        p.kill()
        p.wait()
