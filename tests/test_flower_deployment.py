"""fedfs+feduv on Flower's deployment engine: a real ``flower-superlink`` and two
``flower-supernode`` processes on 127.0.0.1 (insecure mode, loopback only), the run submitted
with ``flwr run``. The global model of each round equals fedfs's own aggregation of the
updates the ServerApp received, and each node's θ_c / codeword stayed in its state folder."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'fedfs[flower]'")

from conftest_flower import build_federation, check_node_states, check_rounds_match_fedfs, run_config  # noqa: E402
from conftest_server import ROOT, free_port  # noqa: E402

pytestmark = pytest.mark.slow

NODES, ROUNDS = 2, 2
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found next to {sys.executable} nor on PATH (pip install 'fedfs[flower]')")
    return path


def _env(flwr_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")   # the SuperLink starts flower-superexec by name
    env["FLWR_HOME"] = str(flwr_home)                            # Flower's config and installed FABs: this test's
    env["OMP_NUM_THREADS"] = "1"
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    return env


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process group (SuperLink/SuperNode and the SuperExec they started), then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)    # leftovers of the group (superexec) too
        except ProcessLookupError:
            pass
        p.wait()


def test_deployment_rounds_equal_fedfs_aggregation(tmp_path):
    from fedfs_flower.project import write_app

    superlink, supernode, flwr = _tool("flower-superlink"), _tool("flower-supernode"), _tool("flwr")
    paths = build_federation(tmp_path, NODES)
    cfg = run_config(paths, ROUNDS, NODES)
    del cfg["data-root"], cfg["state-root"]              # each SuperNode names its own folders
    app = tmp_path / "app"
    write_app(app, cfg)
    home = tmp_path / "flwr_home"
    home.mkdir()
    link_port = free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "fedfs-test"\n\n'
        f'[superlink.fedfs-test]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n')
    env = _env(home)
    procs: list[subprocess.Popen] = []
    logs = {}

    def start(name: str, *args: str) -> subprocess.Popen:
        logs[name] = tmp_path / f"{name}.log"
        p = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=logs[name].open("wb"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        procs.append(p)
        return p

    try:
        link = start("superlink", superlink, "--insecure", "--host", "127.0.0.1", "--port", str(link_port),
                     "--disable-runtime-dependency-installation")
        _wait_port(link_port, link, logs["superlink"])
        folders = sorted(p for p in paths["data"].iterdir())
        nodes = []
        for i, folder in enumerate(folders):        # start both, then wait: their start-ups overlap
            port = free_port()
            nodes.append((port, f"supernode{i}", start(
                f"supernode{i}", supernode, "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                "--host", "127.0.0.1", "--port", str(port),
                "--node-config", f'data-dir="{folder}" state-dir="{paths["state"] / f"node-{i}"}"')))
        for port, name, node in nodes:
            _wait_port(port, node, logs[name])
        run = subprocess.run([flwr, "run", str(app), "fedfs-test", "--stream"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=240)
        final = paths["out"] / f"global_round{ROUNDS:03d}.safetensors"
        if not final.is_file():
            tails = "\n".join(f"--- {n}\n{p.read_text()[-2000:]}" for n, p in logs.items())
            pytest.fail(f"no round-{ROUNDS} model published; flwr run exited {run.returncode}:\n"
                        f"{run.stdout[-3000:]}\n{run.stderr[-2000:]}\n{tails}")
    finally:
        _stop(procs)
    check_rounds_match_fedfs(paths, ROUNDS, NODES)
    check_node_states(paths, ROUNDS, NODES)
