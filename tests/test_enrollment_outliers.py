"""Outlier rejection before the FedUV warm-up threshold, and warm-up scores that verify agrees with.

Real embeddings: a TorchBackend over a small random VerifierNet. An "owner" is one fixed random
image plus pixel noise (the net maps these close together, leave-one-out cosines ≈ 0.97–0.99);
a "stranger" is another such base image (cosine ≈ 0.3–0.7 to the owner's template). A random
net does not separate real identities, so only that much is assumed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from fedfs_sdk.runtime.codes import make_codeword
from fedfs_sdk.runtime.enrollment import (_MAGIC, _NONCE, _VERSION, OUTLIER_MARGIN, WARMUP_TOLERANCE, Enrollment, _aesgcm,
                                  enroll, generate_key, load_enrollment, mad_outliers, min_warmup_images, save_enrollment,
                                  score, verify, warmup_threshold)
from fedfs_sdk.errors import InputError, InsufficientWarmupError
from fedfs_sdk.runtime.inference import TorchBackend
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet
from fedfs_sdk.runtime.preprocess import preprocess


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    torch.manual_seed(0)
    m = FaceNet(ModelConfig("tiny", code_length=127)).eval()
    return TorchBackend(VerifierNet(m.backbone, m.uv_head), "model-A")


def _faces(n: int, seed: int, noise: float = 12) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, size=(40, 40, 3))
    return [np.clip(base + rng.normal(0, noise, base.shape), 0, 255).astype(np.uint8) for _ in range(n)]


def _old_tau(backend: TorchBackend, images: list[np.ndarray], q: float = 0.9) -> float:
    """τ as enroll() computed it before outlier rejection: FedUV's rule on leave-one-out cosines of
    one batched forward (torch directly, not through enroll)."""
    with torch.no_grad():
        emb = backend.verifier(torch.from_numpy(preprocess(images, backend.input_size)))[0].double().numpy()
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    others = [unit[np.arange(len(unit)) != j].sum(0) for j in range(len(unit))]
    loo = [float(unit[j] @ o / np.linalg.norm(o)) for j, o in enumerate(others)]
    return warmup_threshold(loo, q)


def _far(backend: TorchBackend, e: Enrollment, impostors: list[np.ndarray]) -> float:
    return float((score(backend, e, impostors) >= e.threshold).mean())


# ---- the rule itself -------------------------------------------------------------------

def test_mad_rule_hand_cases() -> None:
    tight = [0.98, 0.981, 0.979, 0.982, 0.98, 0.978, 0.983, 0.98, 0.981, 0.97]
    assert not mad_outliers(tight).any()                   # z ≪ −3.5 for 0.97, but only 0.01 below the median
    assert mad_outliers(tight + [0.6]).tolist() == [False] * 10 + [True]
    ties = [0.9] * 8 + [0.85, 0.2]                          # MAD = 0: the margin alone decides
    assert mad_outliers(ties).tolist() == [False] * 9 + [True]
    spread = list(np.linspace(0.3, 0.9, 12))                # wide genuine spread: nothing is 3.5 σ̂ out
    assert not mad_outliers(spread).any()
    assert not mad_outliers([0.9, 0.1]).any()               # too few to estimate a spread
    assert mad_outliers([1.0] * 9 + [0.0], margin=0.05).tolist() == [False] * 9 + [True]
    assert not mad_outliers(tight + [2.0]).any()            # only low scores are outliers
    with pytest.raises(InputError, match="outlier_k"):
        mad_outliers(tight, k=0)


# ---- planted stranger --------------------------------------------------------------------

@pytest.mark.parametrize("owner_seed,stranger_seed", [(1, 3), (4, 9), (7, 3), (11, 9)])
def test_planted_stranger_is_dropped_and_tau_stays(backend: TorchBackend, owner_seed: int,
                                                   stranger_seed: int) -> None:
    owner, stranger = _faces(12, owner_seed), _faces(1, stranger_seed)[0]
    impostors = _faces(40, 2) + _faces(40, 5) + _faces(40, stranger_seed)
    warm = owner[:6] + [stranger] + owner[6:]
    clean = enroll(backend, owner, q=0.9)
    assert clean.dropped == [] and clean.n_warmup == 12 and _far(backend, clean, impostors) == 0.0
    fixed = enroll(backend, warm, q=0.9)
    assert fixed.dropped == [6] and fixed.n_warmup == 12 and fixed.meta["n_given"] == 13
    assert fixed.meta["dropped"][0]["index"] == 6 and fixed.meta["outlier_rule"].startswith("mad")
    assert abs(fixed.threshold - clean.threshold) < 0.01
    np.testing.assert_allclose(fixed.template, clean.template, atol=1e-6)    # re-estimated without it
    assert _far(backend, fixed, impostors) == 0.0
    # without the rule the stranger sets τ (i = ⌊13·0.1⌋ = 1) and the door opens
    raw = enroll(backend, warm, q=0.9, outliers="none")
    assert raw.dropped == [] and raw.n_warmup == 13 and raw.threshold < clean.threshold - 0.2
    assert raw.threshold == pytest.approx(fixed.meta["dropped"][0]["score"], abs=0.05)
    assert _far(backend, raw, impostors) > 0.25


@pytest.mark.parametrize("noise", [12, 40])
def test_no_outlier_dropped_on_clean_data(backend: TorchBackend, noise: float) -> None:
    for seed in range(10):
        e = enroll(backend, _faces(12, seed, noise), q=0.9)
        assert e.dropped == [] and e.meta["dropped"] == [] and e.n_warmup == 12, (seed, e.meta)


def test_outliers_none_reproduces_the_old_tau(backend: TorchBackend) -> None:
    for images in (_faces(12, 1), _faces(12, 4)[:6] + _faces(1, 3) + _faces(12, 4)[6:]):
        e = enroll(backend, images, q=0.9, outliers="none")
        assert e.meta["outlier_rule"].startswith("none") and e.dropped == []
        assert e.threshold == pytest.approx(_old_tau(backend, images) - WARMUP_TOLERANCE, abs=5e-7)


def _folder(tmp_path: Path, owner: int, strangers: dict[int, str], at: int = 4) -> list[str]:
    """``owner`` photos of one person written as files, with the ``strangers`` (seed → file name:
    another person's base image) planted from position ``at`` on."""
    files = []
    for j, img in enumerate(_faces(owner, 1)):
        files.append(str(tmp_path / f"owner{j}.png"))
        cv2.imwrite(files[-1], img)
    planted = []
    for seed, name in strangers.items():
        planted.append(str(tmp_path / name))
        cv2.imwrite(planted[-1], _faces(1, seed)[0])
    return files[:at] + planted + files[at:]


def test_exactly_the_minimum_with_a_stranger_enrolls_keeping_it_at_the_floor(backend: TorchBackend,
                                                                              tmp_path: Path) -> None:
    """Deployment bug 3: 10 photos at q = 0.9 (= ⌈1/(1−q)⌉) and the rule flags one — the enrollment
    failed ("9 inliers remain"). Now the rule never drops below the warm-up minimum and says so."""
    paths = _folder(tmp_path, 9, {3: "stranger.png"})
    assert len(paths) == min_warmup_images(0.9) == 10
    e = enroll(backend, paths, q=0.9)
    assert e.n_warmup == 10 and e.dropped == [] and e.meta["n_given"] == 10 and e.meta["min_warmup"] == 10
    assert e.meta["outliers_flagged"] == 1 and e.meta["outliers_kept_at_floor"] == 1     # flagged, kept
    assert [(d["index"], d["file"]) for d in e.meta["kept_at_floor"]] == [(4, "stranger.png")]
    # it is in the warm-up, so it sets τ (i = ⌊10·0.1⌋ = 1) exactly as without the rule
    assert e.threshold == enroll(backend, paths, q=0.9, outliers="none").threshold
    assert e.threshold == pytest.approx(e.meta["kept_at_floor"][0]["score"], abs=1e-5)


def test_two_strangers_over_the_minimum_are_dropped(backend: TorchBackend, tmp_path: Path) -> None:
    paths = _folder(tmp_path, 10, {3: "stranger_a.png", 9: "stranger_b.png"})   # 12 = minimum + 2
    e = enroll(backend, paths, q=0.9)
    assert e.dropped == [4, 5] and [d["file"] for d in e.meta["dropped"]] == ["stranger_a.png", "stranger_b.png"]
    assert e.n_warmup == 10 and e.meta["outliers_flagged"] == 2 and e.meta["outliers_kept_at_floor"] == 0
    assert e.meta["kept_at_floor"] == []
    clean = enroll(backend, [p for p in paths if "owner" in p], q=0.9)
    np.testing.assert_allclose(e.template, clean.template, atol=1e-6)          # the owner's alone
    assert abs(e.threshold - clean.threshold) < 1e-5


def test_the_floor_drops_the_most_outlying_first(backend: TorchBackend, tmp_path: Path) -> None:
    paths = _folder(tmp_path, 9, {3: "stranger_a.png", 9: "stranger_b.png"})    # 11 = minimum + 1
    e = enroll(backend, paths, q=0.9)
    assert e.n_warmup == 10 and e.meta["outliers_flagged"] == 2 and e.meta["outliers_kept_at_floor"] == 1
    gone, kept = e.meta["dropped"], e.meta["kept_at_floor"]
    assert len(gone) == len(kept) == 1 and {gone[0]["index"], kept[0]["index"]} == {4, 5}
    assert gone[0]["score"] < kept[0]["score"]                      # the lower score went


def test_codeword_mode_drops_by_feduv_score() -> None:
    """Codeword mode scores each image alone, e = (1/c) vᵀσ(Wg): a planted row far below is dropped."""
    v, _ = make_codeword(5, 127)

    class Designed:
        input_size, model_id, outputs = 32, "designed", ("embedding", "uv")

        def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
            k = batch[:, 0, 0, 0].astype(np.int64)           # which row: planted in the pixel
            rng = np.random.default_rng(k[:, None] + np.arange(1))
            genuine = (v > 0).astype(np.float32) * 0.8 + 0.1
            half = genuine.copy()
            half[:30] = 1 - half[:30]                        # 98: 30 of 127 bits wrong, a lesser outlier
            uv = np.stack([np.full(v.size, 0.5, np.float32) if i == 99 else half if i == 98
                           else genuine + rng.normal(0, 0.05, v.size).astype(np.float32) for i in k])
            return {"embedding": np.ones((len(k), 4), np.float32), "uv": uv}

    def batch(ids: list[int]) -> np.ndarray:
        b = np.zeros((len(ids), 3, 32, 32), np.float32)
        b[:, 0, 0, 0] = ids
        return b

    clean = enroll(Designed(), batch(list(range(12))), q=0.9, codeword=v)
    planted = enroll(Designed(), batch(list(range(6)) + [99] + list(range(6, 12))), q=0.9, codeword=v)
    assert clean.dropped == [] and planted.dropped == [6] and planted.n_warmup == 12
    assert planted.threshold == clean.threshold
    assert str(OUTLIER_MARGIN["codeword"]) in planted.meta["outlier_rule"]
    assert enroll(Designed(), batch(list(range(6)) + [99] + list(range(6, 12))), q=0.9, codeword=v,
                  outliers="none").threshold < clean.threshold - 0.3
    # the warm-up floor: exactly 10 keeps the planted row; 11 with two planted drops the lower one
    at_min = enroll(Designed(), batch(list(range(4)) + [99] + list(range(4, 9))), q=0.9, codeword=v)
    assert at_min.dropped == [] and at_min.n_warmup == 10 and at_min.meta["outliers_kept_at_floor"] == 1
    assert at_min.meta["kept_at_floor"][0]["index"] == 4 and at_min.threshold < clean.threshold - 0.3
    two = enroll(Designed(), batch(list(range(4)) + [98, 99] + list(range(4, 9))), q=0.9, codeword=v)
    assert two.dropped == [5] and [d["index"] for d in two.meta["kept_at_floor"]] == [4]
    assert two.meta["outliers_flagged"] == 2 and two.n_warmup == 10


def test_bad_outlier_arguments(backend: TorchBackend) -> None:
    with pytest.raises(InputError, match="outliers must be one of mad, none"):
        enroll(backend, _faces(10, 0), outliers="iqr")
    with pytest.raises(InputError, match="outlier_k"):
        enroll(backend, _faces(10, 0), outlier_k=-1)


# ---- the image that sets τ is accepted when verified alone ------------------------------

@pytest.mark.parametrize("mode", ["codeword", "template"])
def test_every_warmup_image_at_or_above_tau_is_accepted_alone(backend: TorchBackend, mode: str) -> None:
    """Batched and single float32 forwards differ by ~1e-7; τ taken from batched scores rejected
    the image at τ, verified alone, for 3 of these 8 owners (codeword mode)."""
    v = make_codeword(5, 127)[0] if mode == "codeword" else None
    for seed in range(8):
        owner = _faces(12, seed)
        for q, n_below in ((0.9, 0), (0.8, 1)):             # i = 1: all accepted; i = 2: one may fall below
            e = enroll(backend, owner, q=q, codeword=v, outliers="none")
            results = [verify(backend, e, img) for img in owner]
            assert sum(r.accepted for r in results) >= 12 - n_below, (seed, q, [r.score - e.threshold for r in results])
            at_tau = min((r for r in results if r.score >= e.threshold), key=lambda r: r.score)
            assert at_tau.accepted
            if mode == "codeword":      # τ is one of the scores verify returns, less WARMUP_TOLERANCE
                assert any(r.score - e.threshold == pytest.approx(WARMUP_TOLERANCE, abs=1e-12) for r in results)


# ---- storage: the record lives in meta, old files load ---------------------------------------

def test_enrollment_without_the_outlier_record_loads(backend: TorchBackend, tmp_path: Path) -> None:
    key = generate_key()
    e = enroll(backend, _faces(12, 1), q=0.9)
    old = json.loads(e.to_json())
    assert set(old) == {"model_id", "mode", "threshold", "q", "n_warmup", "codeword", "template", "created_at",
                        "meta", "code_length"}                # same keys as before: older readers still load it
    old["meta"] = {"model_path": "/somewhere/verifier.safetensors"}           # what enroll wrote before
    header = _MAGIC + bytes([_VERSION])
    nonce = os.urandom(_NONCE)
    p = tmp_path / "old.enr"
    p.write_bytes(header + nonce + _aesgcm(key).encrypt(nonce, json.dumps(old).encode(), header))
    back = load_enrollment(p, key)
    assert back.dropped == [] and back.threshold == e.threshold and back.n_warmup == 12
    assert verify(backend, back, _faces(12, 1)[0]).accepted
    save_enrollment(tmp_path / "new.enr", enroll(backend, _faces(12, 4)[:6] + _faces(1, 3) + _faces(12, 4)[6:]), key)
    new = load_enrollment(tmp_path / "new.enr", key)
    assert new.dropped == [6] and new.meta["dropped"][0]["index"] == 6 and "file" not in new.meta["dropped"][0]


# ---- command line ----------------------------------------------------------------------------

def test_cli_enroll_prints_dropped_files_and_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedfs_sdk.nn.checkpoint import save_verifier
    from fedfs_sdk.cli.main import main

    torch.manual_seed(0)
    m = FaceNet(ModelConfig("tiny")).eval()
    save_verifier(tmp_path / "verifier.safetensors", m.backbone, m.config)
    imgs = tmp_path / "owner"
    imgs.mkdir()
    for j, img in enumerate(_faces(10, 1)):
        cv2.imwrite(str(imgs / f"{j:02d}.png"), img)
    cv2.imwrite(str(imgs / "05_stranger.png"), _faces(1, 3)[0])
    args = ["enroll", "--model", str(tmp_path / "verifier.safetensors"), "--images", str(imgs),
            "--key-file", str(tmp_path / "key")]
    assert main(args + ["--out", str(tmp_path / "a.enr")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("outlier rule: mad")
    assert out[1] == "dropped 1 of 11 warm-up images as outliers (not the owner?): 05_stranger.png"
    assert out[2].startswith("enrolled from 10 images")
    assert main(args + ["--out", str(tmp_path / "b.enr"), "--outliers", "none"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "outlier rule: none (outlier rejection off)" and out[1].startswith("enrolled from 11 images")
    (imgs / "09.png").unlink()                               # 10 given: the floor keeps the stranger
    assert main(args + ["--out", str(tmp_path / "c.enr")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("kept 1 warm-up image(s) the rule flags as outliers, so that 10 remain for q (they may lower "
                      "τ): 05_stranger.png — add photos of the owner, or remove these if they are not the owner")
    assert out[2].startswith("enrolled from 10 images")


def test_device_prints_the_outlier_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from fedfs_sdk.cli.device import _printer

    _printer("enrollment_outliers", {"rule": "mad: …", "n_given": 13,
                                     "dropped": [{"index": 6, "file": "x.jpg", "score": 0.6}]})
    _printer("enrollment_outliers", {"rule": "mad: …", "n_given": 12, "dropped": []})
    _printer("enrollment_outliers", {"rule": "mad: …", "n_given": 10, "dropped": [], "flagged": 1, "min_warmup": 10,
                                     "kept_at_floor": [{"index": 3, "file": "y.jpg", "score": 0.5}]})
    assert capsys.readouterr().err.splitlines() == [
        "[device] enrollment outlier rule: mad: …",
        "[device] enrollment dropped 1 of 13 warm-up images as outliers (not the owner?): x.jpg",
        "[device] enrollment outlier rule: mad: …",
        "[device] enrollment outlier rule: mad: …",
        "[device] enrollment kept 1 warm-up image(s) the rule flags as outliers, so that 10 remain for q (they may "
        "lower τ): y.jpg — add photos of the owner, or remove these if they are not the owner"]


def test_device_config_outlier_rule_is_checked_and_passed_to_the_cli() -> None:
    import argparse

    from fedfs_sdk.cli import device as device_cli
    from fedfs_sdk.federation.device_config import DeviceConfig
    assert DeviceConfig().outliers == "mad" and DeviceConfig(outliers="none").outliers == "none"
    with pytest.raises(InputError, match="outliers"):
        DeviceConfig(outliers="median")
    p = argparse.ArgumentParser()
    device_cli.add_arguments(p)
    args = p.parse_args(["--server", "http://127.0.0.1:1", "--images", "x", "--state", "y", "--outliers", "none"])
    assert args.outliers == "none"
