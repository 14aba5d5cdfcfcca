"""Warm-up threshold (FedUV Alg. 2), enroll/verify, encrypted enrollment storage."""
from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from fedfs_sdk.codes import make_codeword
from fedfs_sdk.enrollment import (Enrollment, enroll, generate_key, load_enrollment, min_warmup_images,
                                  save_enrollment, score, verify, warmup_threshold)
from fedfs_sdk.errors import (EnrollmentError, EnrollmentExistsError, InputError,
                              InsufficientWarmupError)
from fedfs_sdk.inference import TorchBackend
from fedfs_sdk.model import FaceNet, ModelConfig, VerifierNet


# ---- FedUV warm-up rule: τ = i-th smallest, i = ⌊n(1−q)⌋ -------------------------------

def test_threshold_hand_cases() -> None:
    scores = [0.5, 0.1, 0.9, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 0.0]       # n = 10
    assert warmup_threshold(scores, 0.9) == 0.0    # i = ⌊10·0.1⌋ = 1 → smallest
    assert warmup_threshold(scores, 0.8) == 0.1    # i = 2
    assert warmup_threshold(scores, 0.5) == 0.4    # i = 5
    assert warmup_threshold(list(range(20)), 0.9) == 1   # i = 2 → second smallest
    assert warmup_threshold(list(range(19)), 0.9) == 0   # i = ⌊1.9⌋ = 1


def test_threshold_float_trap_n_times_one_minus_q() -> None:
    # 10 * (1 - 0.9) = 0.9999999999999998 in floats; the rule must still give i = 1
    assert warmup_threshold(np.arange(10.0), 0.9) == 0.0
    assert min_warmup_images(0.9) == 10
    assert min_warmup_images(0.95) == 20
    assert min_warmup_images(0.5) == 2


def test_threshold_too_few_says_how_many() -> None:
    with pytest.raises(InsufficientWarmupError, match="at least 10 images are needed"):
        warmup_threshold([0.1] * 9, 0.9)          # n(1−q) = 0.9 < 1
    with pytest.raises(InsufficientWarmupError, match="at least 10"):
        warmup_threshold([], 0.9)
    with pytest.raises(InputError, match=r"q must be in \(0, 1\)"):
        warmup_threshold([0.1] * 10, 1.0)


def test_threshold_achieves_target_on_warmup_with_ties() -> None:
    rng = np.random.default_rng(0)
    for n in (10, 17, 50, 101):
        e = np.round(rng.normal(size=n), 1)       # many ties
        tau = warmup_threshold(e, 0.9)
        assert (e >= tau).mean() >= 0.9


# ---- enroll / verify -------------------------------------------------------------------

@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    torch.manual_seed(0)
    m = FaceNet(ModelConfig("tiny", code_length=127)).eval()
    return TorchBackend(VerifierNet(m.backbone, m.uv_head), "model-A")


def _faces(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, size=(40, 40, 3))
    return [np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8) for _ in range(n)]


def test_enroll_template_and_codeword_and_verify(backend: TorchBackend) -> None:
    owner, other = _faces(12, 1), _faces(12, 2)
    e = enroll(backend, owner, q=0.9)
    assert e.mode == "template" and e.n_warmup == 12
    assert np.linalg.norm(e.template) == pytest.approx(1.0, abs=1e-5)
    own = score(backend, e, owner)
    assert (own >= e.threshold).mean() >= 0.9         # τ was chosen on (leave-one-out) warm-up
    assert score(backend, e, owner).mean() > score(backend, e, other).mean()
    v, _ = make_codeword(5, 127)
    ec = enroll(backend, owner, q=0.9, codeword=v)
    assert ec.mode == "codeword" and np.array_equal(ec.codeword, v)
    s = score(backend, ec, owner)
    assert (s >= ec.threshold).mean() >= 0.9
    r = verify(backend, ec, owner[0])
    assert r.accepted == (r.score >= ec.threshold)


def test_enroll_bad_input(backend: TorchBackend) -> None:
    with pytest.raises(InsufficientWarmupError, match="at least 10 are needed"):
        enroll(backend, _faces(5, 0), q=0.9)
    with pytest.raises(InputError, match="shape"):
        enroll(backend, [np.zeros((40, 40, 2), np.uint8)] * 10, q=0.9)
    with pytest.raises(InputError, match="uint8"):
        enroll(backend, [np.zeros((40, 40, 3), np.float64)] * 10, q=0.9)
    with pytest.raises(InputError, match="±1"):
        enroll(backend, _faces(10, 0), q=0.9, codeword=np.zeros(127))
    with pytest.raises(InputError, match="codeword has 255 bits"):
        enroll(backend, _faces(10, 0), q=0.9, codeword=make_codeword(1, 255)[0])


def test_verify_refuses_other_model(backend: TorchBackend) -> None:
    e = enroll(backend, _faces(10, 3), q=0.9)
    e.model_id = "model-B"
    with pytest.raises(EnrollmentError, match="re-enroll"):
        verify(backend, e, _faces(1, 3)[0])


# ---- storage ---------------------------------------------------------------------------

def _enrollment() -> Enrollment:
    v, _ = make_codeword(3, 255)
    return Enrollment("m", "codeword", 0.25, 0.9, 12, codeword=v, meta={"k": 1})


def test_storage_roundtrip_is_encrypted(tmp_path: Path) -> None:
    key, e = generate_key(), _enrollment()
    p = tmp_path / "owner.enr"
    save_enrollment(p, e, key)
    blob = p.read_bytes()
    assert e.to_json() not in blob and b"codeword" not in blob      # nothing readable
    assert oct(p.stat().st_mode & 0o777) == "0o600"
    back = load_enrollment(p, key)
    assert np.array_equal(back.codeword, e.codeword) and back.threshold == e.threshold and back.meta == e.meta
    t = Enrollment("m", "template", 0.5, 0.9, 10, template=np.ones(4, np.float32) / 2)
    save_enrollment(tmp_path / "t.enr", t, key)
    assert np.array_equal(load_enrollment(tmp_path / "t.enr", key).template, t.template)


def test_tampered_or_wrong_key_and_nothing_overwritten(tmp_path: Path) -> None:
    key, e = generate_key(), _enrollment()
    p = tmp_path / "owner.enr"
    save_enrollment(p, e, key)
    original = p.read_bytes()
    with pytest.raises(EnrollmentError, match="tampered with or the key is wrong"):
        load_enrollment(p, generate_key())
    flipped = bytearray(original)
    flipped[-5] ^= 1
    (tmp_path / "bad.enr").write_bytes(bytes(flipped))
    with pytest.raises(EnrollmentError, match="tampered"):
        load_enrollment(tmp_path / "bad.enr", key)
    (tmp_path / "trunc.enr").write_bytes(original[:15])
    with pytest.raises(EnrollmentError, match="truncated"):
        load_enrollment(tmp_path / "trunc.enr", key)
    (tmp_path / "junk.enr").write_bytes(b"hello world, not an enrollment")
    with pytest.raises(EnrollmentError, match="not a fedfs enrollment"):
        load_enrollment(tmp_path / "junk.enr", key)
    with pytest.raises(EnrollmentExistsError, match="overwrite=True"):
        save_enrollment(p, _enrollment(), key)
    assert p.read_bytes() == original                         # untouched
    with pytest.raises(InputError, match="16, 24 or 32 bytes"):
        save_enrollment(tmp_path / "x.enr", e, b"short")
    assert not (tmp_path / "x.enr").exists()
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []   # no temp leftovers
    save_enrollment(p, _enrollment(), key, overwrite=True)
    assert p.read_bytes() != original
