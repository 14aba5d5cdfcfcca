"""Warm-up threshold (FedUV Alg. 2), enroll/verify, encrypted enrollment storage."""
from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from fedfs_sdk.runtime.codes import make_codeword
from fedfs_sdk.runtime.enrollment import (Enrollment, enroll, generate_key, load_enrollment, min_warmup_images,
                                  save_enrollment, score, verify, warmup_threshold)
from fedfs_sdk.errors import (EnrollmentError, EnrollmentExistsError, InputError,
                              InsufficientWarmupError)
from fedfs_sdk.runtime.inference import TorchBackend
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet


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


def _embeddings_and_uv(backend: TorchBackend, images: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The model's outputs computed here with torch directly (not through enroll/score)."""
    from fedfs_sdk.runtime.preprocess import preprocess

    x = torch.from_numpy(preprocess(images, backend.input_size))
    with torch.no_grad():
        emb, uv = backend.verifier(x)
    return emb.double().numpy(), uv.double().numpy()


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_enroll_template_and_codeword_and_verify(backend: TorchBackend) -> None:
    owner, other = _faces(12, 1), _faces(12, 2)
    emb, uv = _embeddings_and_uv(backend, owner)
    e = enroll(backend, owner, q=0.9)
    assert e.mode == "template" and e.n_warmup == 12
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    template = unit.mean(0) / np.linalg.norm(unit.mean(0))
    np.testing.assert_allclose(e.template, template, atol=1e-6)
    loo = sorted(_cos(unit[j], np.delete(unit, j, 0).mean(0)) for j in range(12))
    assert e.threshold == pytest.approx(loo[0], abs=2e-6)          # i = ⌊12·0.1⌋ = 1 → smallest (− 1e-6)
    own = score(backend, e, owner)
    np.testing.assert_allclose(own, [_cos(u, template) for u in unit], atol=1e-6)
    assert (own >= e.threshold).all()           # each image is closer to the full template than to its LOO one
    assert score(backend, e, owner).mean() > score(backend, e, other).mean()
    v, _ = make_codeword(5, 127)
    ec = enroll(backend, owner, q=0.9, codeword=v)
    assert ec.mode == "codeword" and np.array_equal(ec.codeword, v)
    code_scores = np.array([sum(float(v[k]) * uv[j, k] for k in range(127)) / 127 for j in range(12)])
    assert ec.threshold == pytest.approx(np.sort(code_scores)[0], abs=2e-6)
    s = score(backend, ec, owner)
    np.testing.assert_allclose(s, code_scores, atol=1e-6)
    impostor = _embeddings_and_uv(backend, other)[1] @ v.astype(np.float64) / 127
    # every warm-up image is accepted alone (i = 1), the one AT τ included: enroll scores each
    # warm-up image as verify does, so the ~1e-7 batch-vs-single float noise cannot reject it
    for img, ind, genuine in ([(owner[j], code_scores[j], True) for j in range(12)]
                              + [(other[j], impostor[j], False) for j in range(12)]):
        r = verify(backend, ec, img)
        assert r.score == pytest.approx(ind, abs=1e-6) and r.threshold == ec.threshold
        assert r.accepted == (genuine or bool(ind > ec.threshold))
    assert ec.meta["dropped"] == [] and ec.meta["outlier_rule"].startswith("mad")


def test_warmup_scores_are_leave_one_out(backend: TorchBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The template-mode warm-up scores handed to the threshold rule are cos(x_j, template of
    the OTHER images); scoring against a template that contains x_j would inflate them."""
    import fedfs_sdk.runtime.enrollment as enr

    seen: list[np.ndarray] = []
    real = enr.warmup_threshold
    monkeypatch.setattr(enr, "warmup_threshold", lambda sc, q: (seen.append(np.asarray(sc)), real(sc, q))[1])
    owner = _faces(10, 7)
    enroll(backend, owner, q=0.9)
    (got,) = seen
    emb, uv = _embeddings_and_uv(backend, owner)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    loo = np.array([_cos(unit[j], unit[[i for i in range(10) if i != j]].sum(0)) for j in range(10)])
    with_self = np.array([_cos(unit[j], unit.sum(0)) for j in range(10)])
    assert np.abs(loo - with_self).min() > 1e-4            # the test can tell the two apart
    np.testing.assert_allclose(got, loo, rtol=0, atol=1e-6)    # one image per forward vs batched: ~1e-7
    seen.clear()
    v, _ = make_codeword(11, 127)
    enroll(backend, owner, q=0.9, codeword=v)              # codeword mode: no template, plain Eq. 5
    np.testing.assert_allclose(seen[0], (uv * v).mean(1), rtol=0, atol=1e-6)


def test_q_is_the_decimal_written() -> None:
    scores = np.arange(10.0)
    # np.float32(0.8) is 0.800000011920929: read naively, n(1−q) = 1.99999988 and i = 1
    assert warmup_threshold(scores, np.float32(0.8)) == 1.0            # i = ⌊10·0.2⌋ = 2
    assert warmup_threshold(scores, np.float64(0.8)) == 1.0
    assert min_warmup_images(np.float32(0.8)) == 5 and min_warmup_images(np.float32(0.95)) == 20
    from decimal import Decimal
    from fractions import Fraction
    assert min_warmup_images(Fraction(9, 10)) == 10 and min_warmup_images(Decimal("0.9")) == 10
    # close to 1: exact, no rounding to 1 (which divided by zero)
    assert min_warmup_images(0.9999999999) == 10_000_000_000
    with pytest.raises(InsufficientWarmupError, match="at least 10000000000 images"):
        warmup_threshold(scores, 0.9999999999)
    for bad in (1.0, 0.0, -0.5, 1.5, float("nan"), float("inf"), 0.99999999999999999, np.float32(1.0)):
        with pytest.raises(InputError, match=r"q must be (a number )?in \(0, 1\), got"):
            min_warmup_images(bad)
    for bad in ("0.9", None, True):
        with pytest.raises(InputError, match="must be a number"):
            warmup_threshold(scores, bad)


def test_enroll_with_numpy_q_stores_a_plain_float(backend: TorchBackend) -> None:
    e = enroll(backend, _faces(10, 4), q=np.float32(0.8))
    assert type(e.q) is float and e.q == 0.8
    assert Enrollment.from_json(e.to_json()).q == 0.8


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
    with pytest.raises(EnrollmentExistsError, match=r"overwrite=True \(`fedfs enroll --overwrite`\)"):
        save_enrollment(p, _enrollment(), key)
    assert p.read_bytes() == original                         # untouched
    with pytest.raises(InputError, match="16, 24 or 32 bytes"):
        save_enrollment(tmp_path / "x.enr", e, b"short")
    assert not (tmp_path / "x.enr").exists()
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []   # no temp leftovers
    save_enrollment(p, _enrollment(), key, overwrite=True)
    assert p.read_bytes() != original


# ---- TorchBackend output mapping -------------------------------------------------------------

@pytest.mark.parametrize("proj_dim,code_length", [(32, 127), (None, 127), (32, None), (None, None)])
def test_torch_backend_maps_facenet_outputs_by_name(proj_dim, code_length) -> None:
    torch.manual_seed(1)
    net = FaceNet(ModelConfig("tiny", proj_dim=proj_dim, code_length=code_length)).eval()
    x = np.random.default_rng(0).uniform(-1, 1, (3, 3, 32, 32)).astype(np.float32)
    out = TorchBackend(net, "m").run(x)
    ref = TorchBackend(VerifierNet(net.backbone, net.uv_head), "m").run(x)
    assert set(out) == set(ref) == ({"embedding", "uv"} if code_length else {"embedding"})
    with torch.no_grad():
        direct = net(torch.from_numpy(x))
    np.testing.assert_allclose(out["embedding"], direct.embedding.numpy(), rtol=0, atol=0)
    if code_length:
        np.testing.assert_allclose(out["uv"], direct.uv.numpy(), rtol=0, atol=0)
        np.testing.assert_allclose(out["uv"], ref["uv"], rtol=0, atol=0)
        assert out["uv"].shape == (3, 127)                 # not the projection [3, 32]
    v, _ = make_codeword(5, 127)
    faces = _faces(10, 5)
    if code_length:
        assert enroll(TorchBackend(net, "m"), faces, codeword=v).threshold == pytest.approx(
            enroll(TorchBackend(VerifierNet(net.backbone, net.uv_head), "m"), faces, codeword=v).threshold, abs=1e-6)


def test_torch_backend_rejects_unexpected_outputs() -> None:
    class Three(torch.nn.Module):
        input_size = 32

        def forward(self, x):
            e = x.flatten(1)[:, :8]
            return e, e, e

    class NoUV(torch.nn.Module):
        input_size = 32
        uv_head = torch.nn.Linear(8, 4)

        def forward(self, x):
            return {"embedding": x.flatten(1)[:, :8], "uv": None}

    x = np.zeros((1, 3, 32, 32), np.float32)
    with pytest.raises(InputError, match="returned 3 outputs"):
        TorchBackend(Three(), "m").run(x)
    with pytest.raises(InputError, match="returned no 'uv' output"):
        TorchBackend(NoUV(), "m").run(x)
    with pytest.raises(InputError, match="needs a torch module"):
        TorchBackend(object(), "m")


def test_head_template_enrollment_is_a_cosine_template_of_w_g(backend: TorchBackend, tmp_path: Path) -> None:
    """template_output='uv': the template is the mean unit σ(W g), whose cosine is that of W·g
    (σ only rescales each row) — the fedfs+feduv head-template verifier."""
    own, other = _faces(12, 0), _faces(3, 7)
    e = enroll(backend, own, q=0.9, template_output="uv", outliers="none")
    assert e.mode == "template" and e.template_output == "uv" and e.template.shape == (127,)
    emb, _ = _embeddings_and_uv(backend, own)
    w = backend.verifier.uv_head.weight.detach().double().numpy()
    wg = emb @ w.T                                                # W·g, no σ
    unit = wg / np.linalg.norm(wg, axis=1, keepdims=True)
    t = unit.sum(0) / np.linalg.norm(unit.sum(0))
    assert np.allclose(e.template, t, atol=1e-5)
    g_probe, _ = _embeddings_and_uv(backend, other[:1])
    assert float(score(backend, e, other[:1])[0]) == pytest.approx(_cos(g_probe[0] @ w.T, t), abs=1e-4)
    key = generate_key()
    save_enrollment(tmp_path / "h.enr", e, key)
    again = load_enrollment(tmp_path / "h.enr", key)
    assert again.template_output == "uv"
    assert float(score(backend, again, own[:1])[0]) == pytest.approx(float(score(backend, e, own[:1])[0]), abs=1e-9)
    with pytest.raises(InputError, match="template_output"):
        enroll(backend, own, q=0.9, template_output="logits")
