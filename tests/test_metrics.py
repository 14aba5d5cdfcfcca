"""Metric functions against hand-computed cases."""
from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import roc_curve

from device_sim import metrics as M
from fedfs_sdk.errors import InputError, InsufficientWarmupError


def test_auroc_perfect_reversed_ties() -> None:
    assert M.auroc([2, 3, 4], [0, 1]) == 1.0
    assert M.auroc([0, 1], [2, 3, 4]) == 0.0
    assert M.auroc([1, 1], [1, 1, 1]) == 0.5             # all tied: ½ per pair
    # genuine {1, 3}, impostor {1, 2}: pairs (1,1)=½ (1,2)=0 (3,1)=1 (3,2)=1 → 2.5/4
    assert M.auroc([1, 3], [1, 2]) == pytest.approx(0.625)


def test_auroc_random_is_half() -> None:
    rng = np.random.default_rng(0)
    g, i = rng.normal(size=2000), rng.normal(size=2000)
    # sd of AUROC under H0 for n=m=2000 is sqrt((n+m+1)/(12nm)) ≈ 0.0065 → 5 sd bound
    assert abs(M.auroc(g, i) - 0.5) < 0.033


def test_tar_at_far_hand_case() -> None:
    imp = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0]
    gen = [0.95, 0.85, 0.75, 0.65]
    # FAR 0.1 → one false accept allowed → threshold just above 0.8 → accept 0.85, 0.95
    assert M.tar_at_far(gen, imp, 0.1) == 0.5
    t = M.threshold_at_far(imp, 0.1)
    assert 0.8 < t < 0.85 and np.mean(np.asarray(imp) >= t) == 0.1
    # FAR 0.25 → two allowed → above 0.7
    assert M.tar_at_far(gen, imp, 0.25) == 0.75
    # FAR below resolution (1/10) → no impostor accepted → above 0.9
    assert M.tar_at_far(gen, imp, 0.01) == 0.25
    assert M.tar_at_far(gen, imp, 1.0) == 1.0


def test_tar_at_far_ties_rejected_together() -> None:
    # three impostors tie at the top; FAR 0.2 (2 of 10) cannot split the tie → 0 accepted
    imp = [0.9, 0.9, 0.9] + [0.1] * 7
    gen = [0.9, 0.95]
    assert M.threshold_at_far(imp, 0.2) > 0.9
    assert M.tar_at_far(gen, imp, 0.2) == 0.5           # the genuine 0.9 ties too: rejected
    assert M.tar_at_far(gen, imp, 0.3) == 1.0           # now all three may be accepted


def test_tar_at_far_is_roc_upper_envelope() -> None:
    rng = np.random.default_rng(1)
    g = np.round(rng.normal(1.0, 1.0, 300), 1)          # rounded: many ties
    i = np.round(rng.normal(0.0, 1.0, 1000), 1)
    fpr, tpr, _ = roc_curve(np.r_[np.ones(g.size), np.zeros(i.size)], np.r_[g, i])
    for far in (0.1, 0.01, 0.001, 0.0):
        assert M.tar_at_far(g, i, far) == pytest.approx(tpr[fpr <= far + 1e-12].max())


def test_eer_cases() -> None:
    assert M.eer([2, 3], [0, 1]) == 0.0
    assert M.eer([0, 1], [2, 3]) == 1.0
    # gen {1,2,3,4}, imp {0,1,2,3}: at t=3 (FPR .25, FNR .5), at t=2 (FPR .5, FNR .25);
    # FNR − FPR goes +.25 → −.25, so the crossing is midway: EER = .375
    assert M.eer([1, 2, 3, 4], [0, 1, 2, 3]) == pytest.approx(0.375)


def test_verification_metrics_dict() -> None:
    m = M.verification_metrics([3, 4], [0, 1, 2, 5], fars=(0.0, 0.25))
    assert m["auroc"] == pytest.approx(6 / 8)
    # FAR 0: threshold above 5 → nothing; FAR .25: 5 may pass, threshold above 2 → both
    assert m["tar_at_far"] == {0.0: 0.0, 0.25: 1.0}
    assert m["n_genuine"] == 2 and m["n_impostor"] == 4 and m["far_resolution"] == 0.25


def test_bad_scores_raise() -> None:
    with pytest.raises(InputError, match="empty"):
        M.auroc([], [1.0])
    with pytest.raises(InputError, match="NaN"):
        M.auroc([1.0, math.nan], [0.0])


def test_identification_scores_rank1() -> None:
    sim = np.array([[0.9, 0.1],    # mated to 0, rank-1 correct
                    [0.8, 0.7],    # mated to 1, but 0 outranks it → never identified
                    [0.2, 0.6],    # non-mated, best 0.6
                    [0.3, 0.1]])   # non-mated, best 0.3
    mated, non = M.identification_scores(sim, [0, 1, -1, -1])
    assert mated[0] == 0.9 and mated[1] == -np.inf
    assert np.array_equal(non, [0.6, 0.3])
    # FPIR 0.5 → one non-mated may pass → threshold just above 0.3 → probe 0 passes
    assert M.tpir_at_fpir(mated, non, fpirs=(0.5,)) == {0.5: 0.5}
    # FPIR 1 → every non-mated passes (threshold −inf), but a rank-1 failure is still a miss
    assert M.tpir_at_fpir(mated, non, fpirs=(1.0,)) == {1.0: 0.5}


def test_tpir_one_identity_gallery_equals_tar() -> None:
    rng = np.random.default_rng(2)
    g, i = rng.normal(1, 1, 50), rng.normal(0, 1, 400)
    sim = np.r_[g, i][:, None]
    mated, non = M.identification_scores(sim, np.r_[np.zeros(50, int), -np.ones(400, int)])
    for f, v in M.tpir_at_fpir(mated, non).items():
        assert v == M.tar_at_far(g, i, f)


def test_template_scores_cosine() -> None:
    gal = np.array([[1.0, 0.0], [2.0, 0.0]])
    probes = np.array([[3.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    assert np.allclose(M.template_scores(gal, probes), [1.0, 0.0, -1.0])


def test_aggregate_and_per_client_degenerate() -> None:
    a = M.aggregate([1.0, math.nan, 0.5])
    assert a["mean"] == 0.75 and a["median"] == 0.75 and a["n"] == 2 and a["n_degenerate"] == 1
    assert math.isnan(M.aggregate([math.nan])["mean"])
    r = M.per_client_verification([([1, 2], [0]), ([], [0.5]), ([0], [1, 2])], fars=(0.5,))
    assert r["auroc"]["mean"] == 0.5 and r["auroc"]["n_degenerate"] == 1
    assert "error" in r["per_client"][1]
    assert r["pooled"]["n_genuine"] == 3
    # FPIR .5 of two non-mated → threshold just above the smaller one
    ident = M.per_client_identification([([1.0], [2.0, 3.0]), ([3.0], [0.0, 1.0])], fpirs=(0.5,))
    assert ident["tpir_at_fpir"][0.5]["mean"] == 0.5


def test_warmup_outcome_ties_and_rates() -> None:
    # n = 10, q = 0.9 → i = ⌊10·0.1⌋ = 1 → τ = smallest warm-up score
    warm = [0.5, 0.6, 0.7, 0.8, 0.9, 0.55, 0.65, 0.75, 0.85, 0.95]
    o = M.warmup_outcome(warm, genuine_scores=[0.5, 0.49, 0.9, 0.7], impostor_scores=[0.5, 0.1, 0.2, 0.3], q=0.9)
    assert o.threshold == 0.5
    assert o.tpr == 0.75            # 0.5 (equal to τ) is accepted, 0.49 is not
    assert o.fpr == 0.25            # the impostor at exactly τ is accepted too
    with pytest.raises(InsufficientWarmupError):
        M.warmup_outcome(warm[:9], [1.0], [0.0], q=0.9)
    agg = M.per_user_warmup([(warm, [0.6], [0.4]), (warm[:5], [1.0], [0.0])], q=0.9)
    assert agg["n_insufficient"] == 1 and agg["tpr"]["mean"] == 1.0 and agg["fpr"]["mean"] == 0.0


def test_mean_roc_perfect_and_envelope() -> None:
    grid, tpr = M.mean_roc([([1, 2], [0]), ([1], [0, 2])], fpr_grid=np.array([0.0, 0.5, 1.0]))
    # client 1 perfect (TPR 1 at FPR 0); client 2: TPR 0 at FPR 0, 1 at FPR 0.5
    assert np.allclose(tpr, [0.5, 1.0, 1.0])


def test_plot_roc_writes_png(tmp_path) -> None:
    from device_sim.plots import plot_roc

    fpr, tpr, _ = M.roc([1, 2, 3], [0, 1.5])
    p = plot_roc({"a": (fpr, tpr)}, tmp_path / "roc.png", mark_fprs=(0.1,))
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p2 = plot_roc({"a": (fpr, tpr)}, tmp_path / "lin.png", log_x=False)
    assert p2.stat().st_size > 1000


def test_pairwise_scores_and_auroc_hand_case() -> None:
    own = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])     # unit: e1, e2, (e1+e2)/√2
    others = np.array([[5.0, 0.0], [-1.0, 0.0]])            # unit: e1, −e1
    r = 1 / math.sqrt(2)
    g, i = M.pairwise_scores(own, others)
    # genuine: every unordered pair i < j of own (no self pairs): (1,2)=0, (1,3)=r, (2,3)=r
    assert np.allclose(g, [0.0, r, r])
    # impostor: each own × each other, row-major
    assert np.allclose(i, [1.0, -1.0, 0.0, 0.0, r, -r])
    # Mann–Whitney by hand: g=0 beats −1, −r and ties 0, 0 → 3; each g=r beats −1, 0, 0, −r
    # and ties r → 4.5; total 3 + 9 = 12 of 3·6 = 18 pairs
    assert M.pairwise_auroc(own, others) == pytest.approx(12 / 18)


def test_pairwise_degenerate_and_bad_input() -> None:
    with pytest.raises(InputError, match="≥ 2 own"):
        M.pairwise_auroc(np.ones((1, 3)), np.ones((4, 3)))
    with pytest.raises(InputError, match="empty"):
        M.pairwise_auroc(np.eye(3), np.zeros((0, 3)))
    with pytest.raises(InputError, match="dimension"):
        M.pairwise_scores(np.eye(3), np.ones((2, 4)))
    with pytest.raises(InputError, match="NaN"):
        M.pairwise_scores(np.array([[1.0, math.nan], [1.0, 0.0]]), np.ones((2, 2)))


def test_tpir_with_other_clients_as_nonmated_hand_case() -> None:
    mated = [0.9, 0.6, 0.4]                                  # client 0's own test images
    pool = [0.95, 0.8, 0.5, 0.3, 0.2, 0.7]
    owner = [0, 1, 1, 2, 2, 0]                               # 0.95 and 0.7 are client 0's own: dropped
    # non-mated = 0.8, 0.5, 0.3, 0.2. FPIR 0.25: ⌊0.25·4⌋ = 1 may pass → threshold just above
    # 0.5 → 0.9, 0.6 identified. FPIR 0: above 0.8 → 0.9 only. FPIR 0.5: above 0.3 → all.
    # (with client 0's own pool images as non-mated, FPIR 0.25 would give 1/3)
    got = M.tpir_other_clients(mated, pool, owner, client=0, fpirs=(0.0, 0.25, 0.5))
    assert got == {0.0: pytest.approx(1 / 3), 0.25: pytest.approx(2 / 3), 0.5: 1.0}
    # client 1's view of the same pool: non-mated = 0.95, 0.3, 0.2, 0.7 → FPIR 0.25 above 0.7
    assert M.tpir_other_clients(mated, pool, owner, client=1, fpirs=(0.25,)) == {0.25: pytest.approx(1 / 3)}
    with pytest.raises(InputError, match="length"):
        M.tpir_other_clients(mated, pool, owner[:-1], client=0)
    # per-client lists are kept next to the aggregate
    ident = M.per_client_identification([([1.0], [2.0, 3.0]), ([3.0], [0.0, 1.0]), ([], [1.0])], fpirs=(0.5,))
    assert ident["per_client"][0.5][:2] == [0.0, 1.0] and math.isnan(ident["per_client"][0.5][2])
    assert ident["tpir_at_fpir"][0.5]["n_degenerate"] == 1


def test_paired_delta_hand_numbers() -> None:
    a = [0.9, 0.8, math.nan, 0.7, 0.6]
    b = [0.8, 0.85, 0.5, 0.6, math.nan]
    d = M.paired_delta(a, b)
    # pairs 0, 1, 3 are finite: Δ = 0.1, −0.05, 0.1 → mean 0.05; deviations .05, −.1, .05 →
    # var (ddof=1) = 0.015 / 2 = 0.0075 → se = √(0.0075 / 3) = 0.05
    assert d["n"] == 3 and d["wins"] == 2 and d["losses"] == 1
    assert d["mean"] == pytest.approx(0.05) and d["se"] == pytest.approx(0.05)
    tie = M.paired_delta([1.0, 2.0], [1.0, 1.0])            # a zero Δ is neither a win nor a loss
    assert tie == {"mean": 0.5, "se": pytest.approx(0.5), "n": 2, "wins": 1, "losses": 0}
    one = M.paired_delta([1.0, None], [0.5, 0.5])
    assert one["n"] == 1 and one["mean"] == 0.5 and math.isnan(one["se"])
    none = M.paired_delta([math.nan], [1.0])
    assert none["n"] == 0 and math.isnan(none["mean"]) and math.isnan(none["se"])
    with pytest.raises(InputError, match="length"):
        M.paired_delta([1.0, 2.0], [1.0])


def test_roc_and_auroc_are_scikit_learns_bit_for_bit() -> None:
    # device_sim computes the curve itself (scikit-learn's per-call validation was the cost): the
    # same sort, cumulative sums and dropped collinear points, so the very same floats
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(7)
    for n_g, n_i, levels in ((3, 50, 0), (40, 400, 12), (1, 2, 3), (200, 2000, 0)):
        g, i = rng.normal(1.0, 1.0, n_g), rng.normal(0.0, 1.0, n_i)
        if levels:                                   # ties within and across the classes
            g, i = np.round(g * levels) / levels, np.round(i * levels) / levels
        y, s = np.r_[np.ones(n_g), np.zeros(n_i)], np.r_[g, i]
        fpr, tpr, thr = M.roc(g, i)
        ref = roc_curve(y, s, drop_intermediate=False)
        assert all(np.array_equal(a, b) for a, b in zip((fpr, tpr, thr), ref))
        assert M.auroc(g, i) == float(roc_auc_score(y, s))
