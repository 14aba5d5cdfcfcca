"""False accepts under control: τ for a FAR on a public impostor set (hand-computed cases), its
refusals, ``enroll(far=…)`` end to end and the impostor-set file."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfs_sdk.errors import InputError, OperatingPointError
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet
from fedfs_sdk.runtime.enrollment import enroll, verify
from fedfs_sdk.runtime.impostors import ImpostorSet, build_impostor_set, load_impostors, save_impostors
from fedfs_sdk.runtime.inference import TorchBackend
from fedfs_sdk.runtime.operating_point import FAR_TOLERANCE, describe, far_threshold, min_impostors, operating_point


def test_far_threshold_hand_computed() -> None:
    s = np.array([0.10, 0.90, 0.30, 0.70, 0.20, 0.80, 0.40, 0.60, 0.50])      # n = 9
    # far = 0.2: k = ⌊0.2·10⌋ − 1 = 1 impostor may pass; τ just above the 2nd largest (0.8)
    t = far_threshold(s, 0.2)
    assert (t.k, t.n) == (1, 9) and t.tau == pytest.approx(0.8 + FAR_TOLERANCE)
    assert t.bound == pytest.approx(2 / 10)                                     # (k+1)/(n+1)
    assert int((s >= t.tau).sum()) == 1
    # far = 0.1: k = ⌊0.1·10⌋ − 1 = 0 → above the largest, nobody passes, bound 1/10
    t = far_threshold(s, 0.1)
    assert (t.k, t.tau, t.bound) == (0, pytest.approx(0.9 + FAR_TOLERANCE), pytest.approx(0.1))
    # ties at the excluded score are excluded together
    t = far_threshold([0.5, 0.5, 0.5, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], 0.2)
    assert t.k == 0 and t.tau > 0.5
    assert min_impostors(1e-3) == 999 and min_impostors(0.1) == 9


def test_far_threshold_refuses_a_set_too_small() -> None:
    with pytest.raises(OperatingPointError, match="needs at least 999"):
        far_threshold(np.linspace(0, 1, 500), 1e-3)
    far_threshold(np.linspace(0, 1, 999), 1e-3)            # exactly enough: far·(n+1) = 1
    with pytest.raises(OperatingPointError, match="in \\(0, 1\\)"):
        far_threshold(np.zeros(10), 1.5)


def test_conformal_bound_holds_on_exchangeable_impostors() -> None:
    """Accept rate of fresh impostors from the same distribution stays ≤ (k+1)/(n+1) on average."""
    rng = np.random.default_rng(0)
    rates, bounds = [], []
    for _ in range(400):
        t = far_threshold(rng.normal(size=1999), 1e-3)          # k = 1, bound 2/2000
        rates.append(float((rng.normal(size=20000) >= t.tau).mean()))
        bounds.append(t.bound)
    assert np.mean(rates) <= bounds[0] * 1.15                  # the expectation bound, with MC slack


def test_operating_point_refuses_when_both_targets_cannot_hold() -> None:
    warm = np.array([0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45])
    imp = np.r_[np.full(998, 0.1), [0.62]]                     # one impostor as high as the owner's 7th photo
    tau, rec = operating_point(warm, 0.5, 1e-3, imp, tau_q=0.45)
    assert tau == pytest.approx(0.62 + FAR_TOLERANCE) and rec["warmup_tpr"] == pytest.approx(0.6)
    assert rec["far_public"] == 0 and rec["far_bound"] == pytest.approx(1e-3)
    with pytest.raises(OperatingPointError, match=r"cannot meet both targets.*60\.0%.*q = 0.9"):
        operating_point(warm, 0.9, 1e-3, imp, tau_q=0.45)
    tau, rec = operating_point(warm, 0.9, None, imp, tau_q=0.45)     # no FAR target: FedUV's τ, FAR measured
    assert tau == 0.45 and rec["far_public"] == pytest.approx(1 / 999)
    assert "FAR 0.0010 on the 999 public impostor photos" in describe({"operating_point": {**rec, "n_warmup": 10}})
    with pytest.raises(OperatingPointError, match="needs a public impostor set"):
        operating_point(warm, 0.9, 1e-3, None, tau_q=0.45)


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    torch.manual_seed(0)
    m = FaceNet(ModelConfig("tiny")).eval()
    return TorchBackend(VerifierNet(m.backbone), "model-far")


def _person(seed: int, n: int, noise: float = 12.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, size=(40, 40, 3))
    return [np.clip(base + rng.normal(0, noise, base.shape), 0, 255).astype(np.uint8) for _ in range(n)]


def _impostor_set(size: int, people: int, per: int) -> ImpostorSet:
    from fedfs_sdk.runtime.preprocess import preprocess

    imgs = [im for p in range(people) for im in _person(100 + p, per)]
    x = preprocess(imgs, size)
    u8 = np.rint(x.transpose(0, 2, 3, 1) * 127.5 + 127.5).astype(np.uint8)
    return ImpostorSet(u8, np.repeat(np.arange(people), per).astype(np.int64), [f"p{i}" for i in range(people)])


def test_enroll_with_far_sets_tau_on_the_impostor_set(backend: TorchBackend, tmp_path) -> None:
    owner = _person(1, 12)
    imp = _impostor_set(backend.input_size, 50, 20)              # 1,000 photos: enough for 1e-3
    save_impostors(tmp_path / "imp.npz", imp)
    imp = load_impostors(tmp_path / "imp.npz")
    assert len(imp) == 1000 and imp.num_identities == 50
    e = enroll(backend, owner, q=0.5, far=1e-3, impostors=imp)
    op = e.meta["operating_point"]
    # recompute the impostor scores by hand: cosine to the stored template
    with torch.no_grad():
        emb = backend.verifier(torch.from_numpy(imp.batch(backend.input_size)))[0].double().numpy()
    s = emb / np.linalg.norm(emb, axis=1, keepdims=True) @ e.template.astype(np.float64)
    k = int(np.floor(1e-3 * 1001)) - 1                             # = 0
    assert e.threshold == pytest.approx(np.sort(s)[::-1][k] + FAR_TOLERANCE, abs=1e-6)
    assert op["far_public"] == 0 and op["far_bound"] == pytest.approx(1 / 1001)
    assert op["impostor_set"]["photos"] == 1000 and op["n_warmup"] == 12
    assert sum(verify(backend, e, im).accepted for im in [im for p in range(3) for im in _person(100 + p, 20)]) == 0
    assert "FAR ≤ 0.001" in describe(e.meta)
    with pytest.raises(OperatingPointError, match="needs at least 999"):
        enroll(backend, owner, q=0.5, far=1e-3, impostors=_impostor_set(backend.input_size, 10, 20))


def test_enroll_refuses_when_the_owner_looks_like_the_impostors(backend: TorchBackend) -> None:
    imp = _impostor_set(backend.input_size, 50, 20)
    owner = _person(100, 12, noise=40.0)                           # the owner IS one of the set's people, noisier
    with pytest.raises(OperatingPointError, match="cannot meet both targets"):
        enroll(backend, owner, q=0.9, far=1e-3, impostors=imp)


def test_impostor_set_from_a_folder(tmp_path) -> None:
    import cv2

    for p in range(3):
        (tmp_path / "pub" / f"person{p}").mkdir(parents=True)
        for j, im in enumerate(_person(p, 4)):
            cv2.imwrite(str(tmp_path / "pub" / f"person{p}" / f"{j}.png"), im)
    (tmp_path / "pub" / "person1" / "bad.jpg").write_bytes(b"not an image")
    imp = build_impostor_set(tmp_path / "pub", 32, exclude=["person2"])
    assert len(imp) == 8 and imp.names == ["person0", "person1"] and imp.input_size == 32
    assert [s["path"].endswith("bad.jpg") for s in imp.meta["skipped"]] == [True]     # named, not silent
    assert len(build_impostor_set(tmp_path / "pub", 32, per_identity=2, exclude=["person1"])) == 4
    with pytest.raises(InputError, match="32px faces but the model takes 112px"):
        imp.batch(112)
    (tmp_path / "x.npz").write_bytes(b"junk")
    with pytest.raises(InputError, match="not a fedfs impostor set"):
        load_impostors(tmp_path / "x.npz")


def test_cli_impostors_enroll_far_and_verify_print_the_operating_point(tmp_path, capsys) -> None:
    import cv2

    from fedfs_sdk.cli.main import main
    from fedfs_sdk.nn.checkpoint import save_verifier

    torch.manual_seed(0)
    m = FaceNet(ModelConfig("tiny")).eval()
    save_verifier(tmp_path / "v.safetensors", m.backbone, m.config)
    for p in range(50):
        d = tmp_path / "public" / f"p{p}"
        d.mkdir(parents=True)
        for j, im in enumerate(_person(100 + p, 20)):
            cv2.imwrite(str(d / f"{j}.png"), im)
    (tmp_path / "owner").mkdir()
    for j, im in enumerate(_person(1, 12)):
        cv2.imwrite(str(tmp_path / "owner" / f"{j}.png"), im)
    assert main(["impostors", "--images", str(tmp_path / "public"), "--model", str(tmp_path / "v.safetensors"),
                 "--out", str(tmp_path / "imp.npz")]) == 0
    assert "1000 photos of 50 public identities" in capsys.readouterr().out
    base = ["enroll", "--model", str(tmp_path / "v.safetensors"), "--images", str(tmp_path / "owner"),
            "--key-file", str(tmp_path / "key"), "--q", "0.5"]
    assert main(base + ["--out", str(tmp_path / "a.enr"), "--far", "1e-3"]) == 2       # --far without a set
    assert "--far needs a public impostor set" in capsys.readouterr().err
    assert main(base + ["--out", str(tmp_path / "a.enr"), "--far", "1e-3", "--impostors", str(tmp_path / "imp.npz")]) == 0
    out = capsys.readouterr().out
    assert "operating point:" in out and "FAR ≤ 0.001" in out and "50 public people" in out
    assert main(["verify", "--enrollment", str(tmp_path / "a.enr"), "--key-file", str(tmp_path / "key"),
                 str(tmp_path / "owner" / "0.png")]) in (0, 1)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(("ACCEPT", "REJECT")) and lines[-1].startswith("operating point: TAR")
