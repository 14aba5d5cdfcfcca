"""The `fedfs` command line as a user runs it: real processes, real files."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from fedfs_sdk.checkpoint import save_verifier
from fedfs_sdk.model import FaceNet, ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def fedfs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "fedfs_sdk.cli.main", *args], capture_output=True,
                          text=True, env=e, timeout=300)


def _write_faces(folder: Path, seed: int, n: int) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, size=(48, 48, 3))
    for i in range(n):
        img = np.clip(base + rng.normal(0, 10, base.shape), 0, 255).astype(np.uint8)
        cv2.imwrite(str(folder / f"{i:02d}.png"), img)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    m = FaceNet(ModelConfig("tiny")).eval()
    save_verifier(d / "verifier.safetensors", m.backbone, m.config)
    _write_faces(d / "owner", 1, 12)
    _write_faces(d / "other", 2, 3)
    return d


def test_help_and_info() -> None:
    r = fedfs("--help")
    assert r.returncode == 0 and "enroll" in r.stdout and "simulate" in r.stdout
    r = fedfs("info")
    assert r.returncode == 0, r.stderr
    assert "mobilefacenet" in r.stdout and "1,003,136" in r.stdout


def test_enroll_then_verify_exit_codes(workspace: Path) -> None:
    d = workspace
    r = fedfs("enroll", "--model", str(d / "verifier.safetensors"), "--images", str(d / "owner"),
              "--out", str(d / "owner.enr"), "--key-file", str(d / "key"))
    assert r.returncode == 0, r.stderr
    assert "mode=template" in r.stdout and (d / "key").stat().st_size == 32
    ok = fedfs("verify", "--enrollment", str(d / "owner.enr"), "--key-file", str(d / "key"),
               str(d / "owner" / "00.png"))
    assert ok.returncode == 0 and ok.stdout.startswith("ACCEPT"), ok.stdout + ok.stderr
    scores = []
    for f in sorted((d / "other").iterdir()):
        r = fedfs("verify", "--enrollment", str(d / "owner.enr"), str(f), env={"FEDFS_KEY_FILE": str(d / "key")})
        assert r.returncode in (0, 1), r.stderr
        scores.append(float(r.stdout.split("score=")[1].split()[0]))
    assert max(scores) < float(ok.stdout.split("score=")[1].split()[0])


def test_cli_errors_are_clear_and_keep_state(workspace: Path) -> None:
    d = workspace
    key = d / "errors.key"
    r = fedfs("enroll", "--model", str(d / "verifier.safetensors"), "--images", str(d / "owner"),
              "--out", str(d / "errors.enr"), "--key-file", str(key))
    assert r.returncode == 0, r.stderr                      # this test's own enrollment and key
    before = (d / "errors.enr").read_bytes()
    r = fedfs("enroll", "--model", str(d / "verifier.safetensors"), "--images", str(d / "other"),
              "--out", str(d / "x.enr"), "--key-file", str(key))
    assert r.returncode == 2 and "at least 10" in r.stderr and "Traceback" not in r.stderr
    assert not (d / "x.enr").exists()
    r = fedfs("verify", "--enrollment", str(d / "errors.enr"), "--key-file", str(key), str(d / "missing.png"))
    assert r.returncode == 2 and "image not found" in r.stderr and "Traceback" not in r.stderr
    (d / "wrong.key").write_bytes(os.urandom(32))
    r = fedfs("verify", "--enrollment", str(d / "errors.enr"), "--key-file", str(d / "wrong.key"),
              str(d / "owner" / "00.png"))
    assert r.returncode == 2 and "tampered with or the key is wrong" in r.stderr
    r = fedfs("enroll", "--model", str(d / "nope.safetensors"), "--images", str(d / "owner"),
              "--out", str(d / "y.enr"), "--key-file", str(key))
    assert r.returncode == 2 and "model not found" in r.stderr
    r = fedfs("enroll", "--model", str(d / "verifier.safetensors"), "--images", str(d / "owner"),
              "--out", str(d / "errors.enr"), "--key-file", str(key))
    assert r.returncode == 2 and "overwrite" in r.stderr and "Traceback" not in r.stderr
    assert (d / "errors.enr").read_bytes() == before       # refused, untouched
    assert fedfs("verify", "--enrollment", str(d / "errors.enr"), "--key-file", str(key),
                 str(d / "owner" / "00.png")).returncode == 0
