"""The federation's tail (fedfs_sdk.stats.tail / .evidence) and a FAR-targeted τ set from it:
hand-checked histogram bins and quantiles, the evidence rules of ``operating_point``, and
``enroll(far=1e-3)`` end to end from a summed statistics file on a tiny torch model."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import norm

from fedfs_sdk.errors import InputError, OperatingPointError
from fedfs_sdk.stats import (TAIL, TAIL_BINS, calibrated_threshold, feature_moments, public_directions,
                             sum_contributions, tail_histogram, tail_z)
from fedfs_sdk.runtime.operating_point import describe, operating_point


def test_tail_histogram_bins_by_hand() -> None:
    dirs = np.array([[1.0, 0.0], [0.0, 1.0]])
    e = np.array([[1.0, 0.0], [0.6, 0.8], [-1.0, 0.0]])        # scores on dir 0: 1, 0.6, −1; on dir 1: 0, 0.8, 0
    h = tail_histogram(e, dirs).reshape(2, TAIL_BINS)
    assert h.sum(1).tolist() == [3, 3]
    # bin of s: ⌊(s + 1)/2 · 400⌋, the last bin closed at 1
    assert h[0, 399] == 1 and h[0, 320] == 1 and h[0, 0] == 1
    assert h[1, 200] == 2 and h[1, 360] == 1
    many = np.tile(e, (40, 1))                                    # 120 photos: only the first 64 count
    assert tail_histogram(many, dirs).reshape(2, TAIL_BINS).sum(1).tolist() == [64, 64]
    with pytest.raises(InputError, match="do not match"):
        tail_histogram(e, np.ones((2, 3)))


def test_tail_z_is_the_pooled_standardized_quantile() -> None:
    """Two directions whose scores are normal with different location and scale: standardized by
    them, the pooled quantile is the normal one."""
    rng = np.random.default_rng(0)
    dirs_loc, dirs_sd = np.array([0.1, -0.2]), np.array([0.05, 0.1])
    h = np.zeros((2, TAIL_BINS))
    for p in range(2):
        s = rng.normal(dirs_loc[p], dirs_sd[p], 200_000)
        h[p] = np.bincount(((s + 1) / 2 * TAIL_BINS).astype(int), minlength=TAIL_BINS)
    for far in (1e-3, 1e-2, 0.1):
        assert tail_z(h, dirs_loc, dirs_sd, far) == pytest.approx(norm.isf(far), abs=0.03)
    # a model that puts the location too low by one SD: z* absorbs it
    assert tail_z(h, dirs_loc - dirs_sd, dirs_sd, 0.01) == pytest.approx(norm.isf(0.01) + 1, abs=0.03)
    with pytest.raises(InputError, match="too few"):
        tail_z(h / 1000, dirs_loc, dirs_sd, 1e-3)                 # 200 scores per direction cannot say 1e-3
    assert calibrated_threshold(np.array([0.0, 0.2]), 2.0) == pytest.approx(0.1 + 0.1 * 2.0)


def test_public_directions_are_unit_templates() -> None:
    e = np.array([[2.0, 0.0], [0.0, 1.0], [0.0, 3.0], [0.0, 0.5], [1.0, 1.0]])
    d = public_directions(e, np.array([0, 0, 1, 1, 2]))            # person 2 has one photo: left out
    assert d.shape == (2, 2)                                       # unit mean of unit embeddings
    assert np.allclose(d[0], [1 / np.sqrt(2), 1 / np.sqrt(2)]) and np.allclose(d[1], [0.0, 1.0])


class _Evidence:
    """A stand-in InDomainEvidence: z* fixed per far (the rules, not the estimator, are tested here)."""

    record = {"estimator": "test", "contributors": 12}

    def z(self, far: float) -> float:
        return 3.0 if far == 1e-3 else 2.0


def test_operating_point_picks_and_records_its_evidence() -> None:
    warm = np.linspace(0.5, 0.9, 10)
    draws = np.array([0.0, 0.2] * 50)                             # m = 0.1, s = 0.1
    small = np.linspace(-0.2, 0.2, 644)                           # a public set too small for 1e-3
    tau, rec = operating_point(warm, 0.9, 1e-3, small, 0.5, in_domain=(draws, _Evidence()))
    assert tau == pytest.approx(0.1 + 0.1 * 3.0) and rec["far_evidence"] == "federation-statistics"
    assert rec["in_domain"]["z"] == 3.0 and rec["far_public"] == 0.0 and rec["far_bound"] is None
    assert "predicted for impostors in the federation's capture conditions" in describe(
        {"operating_point": {**rec, "n_warmup": 10}})
    big = np.linspace(-0.2, 0.2, 1999)                            # large enough: the public set sets τ (auto)
    tau, rec = operating_point(warm, 0.9, 1e-3, big, 0.5, in_domain=(draws, _Evidence()))
    assert rec["far_evidence"] == "public-set" and rec["tau_federation"] == pytest.approx(0.4)
    tau, rec = operating_point(warm, 0.9, 1e-3, big, 0.5, in_domain=(draws, _Evidence()), far_evidence="federation")
    assert rec["far_evidence"] == "federation-statistics"
    with pytest.raises(OperatingPointError, match="needs at least 999.*--far-stats"):
        operating_point(warm, 0.9, 1e-3, small, 0.5)              # no statistics: the public set's refusal
    with pytest.raises(OperatingPointError, match="public impostor set of ≥ 999 photos or the federation's"):
        operating_point(warm, 0.9, 1e-3, None, 0.5)
    with pytest.raises(OperatingPointError, match="far_evidence='federation' but no statistics"):
        operating_point(warm, 0.9, 1e-3, big, 0.5, far_evidence="federation")
    with pytest.raises(OperatingPointError, match="cannot meet both targets.*federation"):
        operating_point(warm, 0.9, 1e-3, None, 0.5, in_domain=(draws + 0.8, _Evidence()))


def write_tail_stats(path, verifier, pub, photos: int, devices: int = 12):
    """A published sum of ``devices`` devices' ``xi.features`` and ``xi.tail`` under ``verifier``'s trunk and
    top (torch; ``photos`` generated photos each), written to ``path`` as a statistics file; returns it."""
    from fedfs_sdk.runtime.preprocess import preprocess
    from fedfs_sdk.stats.evidence import FEATURES, tail_directions, torch_top, torch_trunk
    from tests.test_operating_point import _person

    trunk, top = torch_trunk(verifier), torch_top(verifier)
    size = int(verifier.input_size)
    feats = [trunk(preprocess(_person(300 + d, photos), size)) for d in range(devices)]
    total = sum_contributions({FEATURES: feature_moments(f)} for f in feats)
    dirs = tail_directions(trunk(pub.batch(size)), pub.identity, lambda f: top(f)["embedding"], total.sums[FEATURES])
    stats = sum_contributions({FEATURES: feature_moments(f), TAIL: tail_histogram(top(f)["embedding"], dirs)}
                              for f in feats)
    path.write_text(json.dumps({"task": {}, **stats.to_dict()}))
    return stats


def test_enroll_far_from_a_published_statistics_file(tmp_path, capsys) -> None:
    """Devices contribute ξ's feature moments and tail histograms; the summed file sets τ for a
    FAR 1e-2 that the 60-photo public set cannot (its refusal alone: the operating-point test above);
    the record says which evidence set it; 1e-3 is refused: 12 devices' photos cannot say it."""
    from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet
    from fedfs_sdk.runtime.enrollment import enroll, verify
    from fedfs_sdk.runtime.inference import TorchBackend
    from fedfs_sdk.stats.evidence import evidence_for_backend, torch_top, torch_trunk
    from tests.test_operating_point import _impostor_set, _person

    torch.manual_seed(0)
    m = FaceNet(ModelConfig("tiny")).eval()
    backend = TorchBackend(VerifierNet(m.backbone), "model-far")
    pub = _impostor_set(backend.input_size, 20, 3)                # 60 photos: too few for 1e-2 on their own
    stats = write_tail_stats(tmp_path / "stats.json", backend, pub, photos=12)
    assert stats.count == 12
    ev = evidence_for_backend(tmp_path / "stats.json", backend, backend, pub)
    assert ev.record["contributors"] == 12 and ev.record["tail_directions"] == 20
    owner = _person(1, 12)
    with pytest.raises(InputError, match="too few to estimate FAR 0.001"):
        enroll(backend, owner, q=0.5, far=1e-3, impostors=pub, in_domain=ev)
    e = enroll(backend, owner, q=0.5, far=1e-2, impostors=pub, in_domain=ev)
    op = e.meta["operating_point"]
    assert op["far_evidence"] == "federation-statistics" and op["in_domain"]["model_id"] == "model-far"
    s = ev.draws["embedding"] / np.linalg.norm(ev.draws["embedding"], axis=1, keepdims=True) @ e.template
    assert e.threshold == pytest.approx(s.mean() + s.std() * op["in_domain"]["z"], abs=1e-6)
    assert verify(backend, e, owner[0]).accepted

    # the CLI: fedfs enroll --far --far-stats (same weights from a file), and its refusals
    import cv2

    from fedfs_sdk.cli.main import main
    from fedfs_sdk.nn.checkpoint import save_verifier
    from fedfs_sdk.runtime.impostors import save_impostors

    save_verifier(tmp_path / "v.safetensors", m.backbone, m.config)
    save_impostors(tmp_path / "imp.npz", pub)
    (tmp_path / "owner").mkdir()
    for j, im in enumerate(owner):
        cv2.imwrite(str(tmp_path / "owner" / f"{j}.png"), im)
    base = ["enroll", "--model", str(tmp_path / "v.safetensors"), "--images", str(tmp_path / "owner"), "--key-file",
            str(tmp_path / "key"), "--q", "0.5", "--far", "1e-2", "--out", str(tmp_path / "a.enr")]
    assert main(base + ["--far-stats", str(tmp_path / "stats.json")]) == 2              # no public set: no directions
    assert "--far needs a public impostor set" in capsys.readouterr().err
    assert main(base + ["--far-stats", str(tmp_path / "stats.json"), "--impostors", str(tmp_path / "imp.npz")]) == 0
    assert "predicted for impostors in the federation's capture conditions" in capsys.readouterr().out

    # the device agent's ξ (a checkpoint): trunk then top is its backbone, exactly
    from fedfs_sdk.nn.checkpoint import save_checkpoint
    from fedfs_sdk.stats.evidence import xi_verifier

    save_checkpoint(tmp_path / "xi.safetensors", m, m.config)
    x = pub.batch(backend.input_size)[:4]
    xi = xi_verifier(tmp_path / "xi.safetensors")
    with torch.no_grad():
        ref = m.backbone(torch.from_numpy(x)).double().numpy()
    assert np.allclose(torch_top(xi)(torch_trunk(xi)(x))["embedding"], ref, atol=1e-6)


def test_device_config_checks_far_stats_before_it_registers(tmp_path) -> None:
    from fedfs_sdk.federation.device_config import DeviceConfig

    with pytest.raises(InputError, match="not a file"):
        DeviceConfig(far=1e-3, far_stats=tmp_path / "missing.json")
    (tmp_path / "s.json").write_text("{}")
    with pytest.raises(InputError, match="give far"):
        DeviceConfig(far_stats=tmp_path / "s.json")
    assert DeviceConfig(far=1e-3, far_stats=tmp_path / "s.json").far_stats == tmp_path / "s.json"


def test_the_check_round_asks_for_the_tail_only_where_it_can_be_read(tmp_path) -> None:
    """``server_agg.stats_auto.tail_spec``: ``P·400`` counts for the shipped set's people with ≥ 2 photos,
    and no tail without a public set, without ξ's published feature moments, under statistics DP, for a
    backbone that does not split, or a second time for the same ξ."""
    from types import SimpleNamespace

    from fedfs_sdk.runtime.impostors import ImpostorSet, save_impostors
    from fedfs_sdk.stats.tail import TAIL
    from server_agg import stats_auto
    from server_agg.impostor_store import IMPOSTORS_FILE, META_KEY

    ids = np.concatenate([np.repeat(np.arange(5), 3), [5]])          # 5 people × 3 photos, one person × 1
    save_impostors(tmp_path / IMPOSTORS_FILE, ImpostorSet(np.zeros((16, 8, 8, 3), np.uint8), ids.astype(np.int64),
                                                          [f"p{i}" for i in range(6)]))
    meta = {"xi_sha256": "ab" * 32, META_KEY: "cd" * 32}

    class Db:
        def get_meta(self, key):
            return meta.get(key)

    coord = SimpleNamespace(db=Db(), layout=SimpleNamespace(root=tmp_path),
                            policy=SimpleNamespace(stats_dp_noise_multiplier=None))
    desk = SimpleNamespace(outcomes=lambda: {"1": {"state": "published", "names": ["xi.embedding", "xi.features"]}})
    shape = {"features": 512}
    spec = stats_auto.tail_spec(coord, desk, shape)
    assert (spec.name, spec.kind, spec.length) == (TAIL, "tail", 5 * TAIL_BINS)
    assert stats_auto.tail_spec(coord, desk, {"features": None}) is None
    assert stats_auto.tail_spec(coord, SimpleNamespace(outcomes=lambda: {}), shape) is None
    coord.policy.stats_dp_noise_multiplier = 0.5
    coord.policy.stats_dp_noise, coord.policy.stats_dp_delta = "central", None
    assert stats_auto.tail_spec(coord, desk, shape) is None
    coord.policy.stats_dp_noise_multiplier = None
    meta[stats_auto.STATE] = json.dumps({f"tail:{meta['xi_sha256']}": {"checks_round": "checks:v3"}})
    assert stats_auto.tail_spec(coord, desk, shape) is None
    del meta[stats_auto.STATE], meta[META_KEY]
    assert stats_auto.tail_spec(coord, desk, shape) is None


def test_a_tail_statistic_packs_and_bounds_by_hand() -> None:
    """Counts pack by ``max_photos`` (a device's count per bin is at most that); DP's sensitivity is one
    device's worst case: every photo in one bin of each direction, ``P_photos·√P``."""
    from fedfs_sdk.stats.contributions import sensitivity
    from fedfs_sdk.stats.transport import StatSpec, StatsTask, pack

    (idx, delta), = sensitivity("tail", 2 * TAIL_BINS, 1.0, 64)
    assert delta == pytest.approx(64 * np.sqrt(2)) and idx.size == 2 * TAIL_BINS
    with pytest.raises(InputError, match="400 counts per public direction"):
        sensitivity("tail", 2 * TAIL_BINS + 1, 1.0, 64)
    task = StatsTask(1, 1, (StatSpec("xi.tail", "tail", 2 * TAIL_BINS),), extra={"xi_sha256": "ab" * 32})
    h = np.zeros(2 * TAIL_BINS)
    h[[3, TAIL_BINS + 7]] = 64
    assert np.array_equal(pack({"xi.tail": h}, task)[[3, TAIL_BINS + 7]], [1.0, 1.0])
    assert task.keys() == [f"xi.tail@xi:{'ab' * 32}"]       # computed under ξ: one contribution per ξ


def test_a_device_that_cannot_bin_its_tail_still_gives_its_checks(monkeypatch) -> None:
    """A device whose ``xi.tail`` fails (here: no published ξ round) contributes zeros for it — the pooled
    tail's shape is unchanged — and its check results still count in the verdict; the event says why."""
    from types import SimpleNamespace

    from fedfs_sdk.federation import device_stats
    from fedfs_sdk.stats.in_domain import CHECKS, check_contributions
    from fedfs_sdk.stats.transport import StatSpec, StatsTask
    from fedfs_sdk.training.selection import CandidateCheck

    checks = [CandidateCheck(n, 1.0, m, 0.99, 0.5, 2, 100) for n, m in (("xi", 0.1), ("global", 0.4))]
    events = []
    agent = SimpleNamespace(_stats_checks=(3, checks), _emit=lambda n, f: events.append((n, f)))
    task = StatsTask(7, 3, (StatSpec(CHECKS, "checks", 4), StatSpec("xi.tail", "tail", 2 * TAIL_BINS)),
                     extra={"candidates": ["xi", "global"], "xi_sha256": "ab" * 32, "impostors_sha256": "cd" * 32})

    def no_round(agent, sha):
        raise device_stats.StatsUnavailable("no statistics of ξ's trunk features were published")
    monkeypatch.setattr(device_stats, "xi_sums", no_round)
    out = device_stats.contribution(agent, task)
    assert np.array_equal(out[CHECKS], check_contributions(checks, ["xi", "global"]))
    assert np.array_equal(out["xi.tail"], np.zeros(2 * TAIL_BINS))
    assert events and events[0][0] == "stats_tail_unavailable" and "published" in events[0][1]["reason"]
