"""The verification runtime as an app installs it: ``pip install fedfs`` — no torch.

These tests run twice: in the full suite (torch installed; the device path is still checked to
never import torch) and in .ci/run's second stage, an install of the core package alone on a
second Python (3.12), where torch, FastAPI and the training extras are genuinely absent. That
stage cannot export a model, so it reads one from ``FEDFS_RUNTIME_FIXTURE``
(tests/runtime_only/make_fixture.py, run by the full install first).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("FEDFS_RUNTIME_FIXTURE")
    if given:
        return Path(given)
    if not HAS_TORCH:
        pytest.fail("FEDFS_RUNTIME_FIXTURE is not set and torch is absent: build the fixture with the full "
                    "install first (python tests/runtime_only/make_fixture.py DIR)")
    folder = tmp_path_factory.mktemp("runtime-fixture")
    subprocess.run([sys.executable, str(ROOT / "tests/runtime_only/make_fixture.py"), str(folder)], check=True)
    return folder


def fedfs(*args: str, cwd: Path, block_torch: bool = True) -> subprocess.CompletedProcess[str]:
    """``fedfs ARGS`` in a subprocess of this interpreter; with ``block_torch`` any import of torch
    fails in it (a no-op where torch is not installed), and the process checks it never loaded."""
    code = ("import sys\n"
            + ("sys.modules['torch'] = None\n" if block_torch else "")
            + "from fedfs_sdk.cli.main import main\n"
            + f"rc = main({list(args)!r})\n"
            + "assert not isinstance(sys.modules.get('torch'), type(sys)), 'torch was imported'\n"
            + "sys.exit(rc)\n")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_enroll_and_verify_with_onnx_without_torch(fixture_dir: Path, tmp_path: Path) -> None:
    enr, key = tmp_path / "owner.enr", tmp_path / "owner.key"
    r = fedfs("enroll", "--model", str(fixture_dir / "verifier.onnx"), "--images", str(fixture_dir / "owner"),
              "--out", str(enr), "--key-file", str(key), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "enrolled from 12 images" in r.stdout
    # the owner's own image is accepted (exit 0) — the model is recorded, so no --model
    r = fedfs("verify", "--enrollment", str(enr), "--key-file", str(key), str(fixture_dir / "owner" / "03.png"),
              cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ACCEPT")
    # six other identities: every one rejected (exit 1), one line each
    r = fedfs("verify", "--enrollment", str(enr), "--key-file", str(key), str(fixture_dir / "other"), cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.count("REJECT") == 6 and "0 of 6 accepted" in r.stdout


def test_python_api_never_imports_torch(fixture_dir: Path, tmp_path: Path) -> None:
    code = f"""
import sys
sys.modules['torch'] = None
from pathlib import Path
from fedfs_sdk import OnnxBackend, enroll, generate_key, load_enrollment, save_enrollment, verify
backend = OnnxBackend({str(fixture_dir / 'verifier.onnx')!r})
owner = sorted(str(p) for p in Path({str(fixture_dir / 'owner')!r}).glob('*.png'))
e = enroll(backend, owner, q=0.9)
key = generate_key()
save_enrollment({str(tmp_path / 'a.enr')!r}, e, key)
loaded = load_enrollment({str(tmp_path / 'a.enr')!r}, key)
# the warm-up threshold keeps ≥ q of the owner's images (FedUV Alg. 2); no other identity passes
accepted = sum(verify(backend, loaded, p).accepted for p in owner)
assert accepted >= 0.9 * len(owner) - 1, accepted
others = sorted(Path({str(fixture_dir / 'other')!r}).glob('*.png'))
assert not any(verify(backend, loaded, str(p)).accepted for p in others)
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize(("command", "extra"), [("info", "train"), ("demo", "sim"), ("serve", "server")])
def test_a_command_whose_extra_is_missing_says_what_to_install(command: str, extra: str, tmp_path: Path) -> None:
    """Without torch (blocked here; absent in the runtime-only stage) a command that needs an extra
    prints one line naming the pip install that adds it, and exits 2 — no traceback."""
    r = fedfs(command, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"pip install 'fedfs[{extra}]'" in lines[0] and "'torch'" in lines[0]
    assert "Traceback" not in r.stderr


def test_a_torch_checkpoint_in_the_runtime_names_the_train_extra(fixture_dir: Path, tmp_path: Path) -> None:
    """``fedfs enroll --model X.safetensors`` needs torch: one line naming ``fedfs[train]``."""
    fake = tmp_path / "model.safetensors"
    fake.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")   # a valid, empty safetensors header
    r = fedfs("enroll", "--model", str(fake), "--images", str(fixture_dir / "owner"), "--out",
              str(tmp_path / "e.enr"), "--key-file", str(tmp_path / "k"), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'fedfs[train]'" in r.stderr and "Traceback" not in r.stderr
