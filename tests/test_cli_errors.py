"""Operating-system refusals (a file where a folder is needed, a full or read-only device)
end a ``fedfs`` command with ``fedfs <cmd>: error: <message>`` and exit code 2 — never a
traceback. Real subprocesses, as a user runs them (``fedfs serve``'s refusal, before its bind, in
this process on a held port: :func:`conftest_server.refused_serve`)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest_server import ROOT, refused_serve, subprocess_env, write_images

pytestmark = pytest.mark.timeout(120)


def fedfs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedfs_sdk.cli.main", *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=90)


def assert_clean_error(r: subprocess.CompletedProcess, command: str, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"fedfs {command}: error: "), r.stderr[-2000:]
    assert all(w in last for w in words), last


def test_serve_on_a_file(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    assert_clean_error(refused_serve("--state", str(f), "--init-backbone", "tiny", "--code-length", "127"),
                       "serve", str(f), "not a directory")


def test_simulate_out_is_a_file(tmp_path):
    f = tmp_path / "results"
    f.write_text("x")
    assert_clean_error(fedfs("simulate", "--method", "pretrained", "--clients", "2", "--rounds", "0",
                             "--out", str(f), "--quiet"), "simulate", str(f))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_enroll_out_on_an_impossible_path(tmp_path):
    """Not caught by the command itself: the generic OSError handler of ``fedfs``."""
    from fedfs_sdk.nn.checkpoint import save_checkpoint
    from fedfs_sdk.nn.model import FaceNet, ModelConfig

    model = FaceNet(ModelConfig("tiny", code_length=127))
    save_checkpoint(tmp_path / "m.safetensors", model, model.config, {})
    write_images(tmp_path / "imgs", 12, seed=1, size=32)
    r = fedfs("enroll", "--model", str(tmp_path / "m.safetensors"), "--images", str(tmp_path / "imgs"),
              "--out", "/dev/full/x.enr", "--key-file", str(tmp_path / "k.key"))
    assert_clean_error(r, "enroll", "/dev/full is a file, not a folder")


def test_os_error_message_format(monkeypatch, capsys):
    from fedfs_sdk.cli import main as cli_main

    def boom(_args):
        raise PermissionError(13, "Permission denied", "/root/secret")

    monkeypatch.setattr("device_sim.cli_bench.run", boom)
    assert cli_main.main(["bench"]) == 2
    assert capsys.readouterr().err.strip() == "fedfs bench: error: /root/secret: Permission denied"
