"""The `fedfs` command line as a user runs it: real files; real processes for ``--help``, ``info``
and one enroll and verify (:func:`fedfs`), the CLI's own ``main`` in this process for the rest
(``fedfs_here``: each subprocess spent seconds importing torch again)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from conftest_server import cli_in_process as fedfs_here
from fedfs_sdk.nn.checkpoint import save_verifier
from fedfs_sdk.nn.model import FaceNet, ModelConfig

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
        r = fedfs_here("verify", "--enrollment", str(d / "owner.enr"), str(f), env={"FEDFS_KEY_FILE": str(d / "key")})
        assert r.returncode in (0, 1), r.stderr
        scores.append(float(r.stdout.split("score=")[1].split()[0]))
    assert max(scores) < float(ok.stdout.split("score=")[1].split()[0])


def test_cli_errors_are_clear_and_keep_state(workspace: Path) -> None:
    d = workspace
    key = d / "errors.key"
    r = fedfs_here("enroll", "--model", str(d / "verifier.safetensors"), "--images", str(d / "owner"),
                   "--out", str(d / "errors.enr"), "--key-file", str(key))
    assert r.returncode == 0, r.stderr                      # this test's own enrollment and key
    before = (d / "errors.enr").read_bytes()
    r = fedfs_here("enroll", "--model", str(d / "verifier.safetensors"), "--images", str(d / "other"),
                   "--out", str(d / "x.enr"), "--key-file", str(key))
    assert r.returncode == 2 and "at least 10" in r.stderr and "Traceback" not in r.stderr
    assert not (d / "x.enr").exists()
    r = fedfs_here("verify", "--enrollment", str(d / "errors.enr"), "--key-file", str(key), str(d / "missing.png"))
    assert r.returncode == 2 and "image not found" in r.stderr and "Traceback" not in r.stderr
    (d / "wrong.key").write_bytes(os.urandom(32))
    r = fedfs_here("verify", "--enrollment", str(d / "errors.enr"), "--key-file", str(d / "wrong.key"),
                   str(d / "owner" / "00.png"))
    assert r.returncode == 2 and "tampered with or the key is wrong" in r.stderr
    r = fedfs_here("enroll", "--model", str(d / "nope.safetensors"), "--images", str(d / "owner"),
                   "--out", str(d / "y.enr"), "--key-file", str(key))
    assert r.returncode == 2 and "model not found" in r.stderr
    r = fedfs_here("enroll", "--model", str(d / "verifier.safetensors"), "--images", str(d / "owner"),
                   "--out", str(d / "errors.enr"), "--key-file", str(key))
    assert r.returncode == 2 and "overwrite" in r.stderr and "Traceback" not in r.stderr
    assert (d / "errors.enr").read_bytes() == before       # refused, untouched
    assert fedfs_here("verify", "--enrollment", str(d / "errors.enr"), "--key-file", str(key),
                      str(d / "owner" / "00.png")).returncode == 0


def test_failed_enroll_leaves_no_key_file_and_creates_no_state_folder(workspace: Path) -> None:
    d = workspace
    r = fedfs_here("enroll", "--model", str(d / "verifier.safetensors"), "--images", str(d / "other"),
                   "--out", str(d / "k.enr"), "--key-file", str(d / "new.key"))
    assert r.returncode == 2 and "at least 10" in r.stderr
    assert not (d / "new.key").exists() and not (d / "k.enr").exists()
    r = fedfs_here("enroll", "--model", str(d / "verifier.safetensors"), "--images", str(d / "owner"),
                   "--out", str(d / "k.enr"), "--key-file", str(d / "new.key"), "--device-state", str(d / "typo-state"))
    assert r.returncode == 2 and "no device state" in r.stderr and "Traceback" not in r.stderr
    assert not (d / "typo-state").exists() and not (d / "new.key").exists()


def test_enroll_reads_the_codeword_with_the_device_key(tmp_path: Path) -> None:
    from fedfs_sdk.cli.enroll import _codeword
    from fedfs_sdk.federation.device_state import DeviceKeyError, DeviceState

    app_key = os.urandom(32)
    with DeviceState(tmp_path / "app", key=app_key) as st:       # the app gave its key (--key-file)
        st.save_registration("http://h:1", "da", "da.t", 3)
        v_app = st.codeword(127)
    with DeviceState(tmp_path / "own") as st:                     # no key given: STATE/enrollment.key
        st.save_registration("http://h:1", "do", "do.t", 4)
        v_own = st.codeword(127)
    assert np.array_equal(_codeword(str(tmp_path / "app"), app_key), v_app)
    assert np.array_equal(_codeword(str(tmp_path / "own"), None), v_own)
    assert np.array_equal(_codeword(str(tmp_path / "own"), os.urandom(32)), v_own)   # falls back to the state's key
    with pytest.raises(DeviceKeyError, match="wrong device key"):
        _codeword(str(tmp_path / "app"), os.urandom(32))


def test_device_rejects_negative_rounds(tmp_path: Path) -> None:
    r = fedfs_here("device", "--server", "http://127.0.0.1:9", "--images", str(tmp_path / "img"),
                   "--state", str(tmp_path / "state"), "--rounds", "-1")
    assert r.returncode == 2 and "--rounds must be ≥ 0" in r.stderr and not (tmp_path / "state").exists()


def test_enroll_head_template_then_verify(workspace: Path) -> None:
    """--template-output uv: a cosine template on the FedUV head output of a FedUV verifier;
    a verifier without a head is refused with a clear line."""
    d = workspace
    torch.manual_seed(1)
    m = FaceNet(ModelConfig("tiny", code_length=127)).eval()
    save_verifier(d / "uv_verifier.safetensors", m.backbone, m.config, m.uv_head)
    r = fedfs_here("enroll", "--model", str(d / "uv_verifier.safetensors"), "--images", str(d / "owner"),
                   "--out", str(d / "uv.enr"), "--key-file", str(d / "uv.key"), "--template-output", "uv")
    assert r.returncode == 0, r.stderr
    assert "mode=template on uv" in r.stdout
    ok = fedfs_here("verify", "--enrollment", str(d / "uv.enr"), "--key-file", str(d / "uv.key"),
                    str(d / "owner" / "00.png"))
    assert ok.returncode == 0 and ok.stdout.startswith("ACCEPT"), ok.stdout + ok.stderr
    bad = fedfs_here("enroll", "--model", str(d / "verifier.safetensors"), "--images", str(d / "owner"),
                     "--out", str(d / "nohead.enr"), "--key-file", str(d / "uv.key"), "--template-output", "uv")
    assert bad.returncode == 2 and "FedUV head" in bad.stderr and not (d / "nohead.enr").exists()
