"""DP on the statistics sums (fedfs_sdk.stats.privacy): the noise's scale, the distributed shares,
the consumers of a noisy sum, the device's floor, and a real `fedfs serve` publishing a noisy sum
with its mechanism.

Statistical checks use a fixed seed and many draws with a bound ≥ 8 standard errors wide: a
wrong formula (a √k missing, σ² for σ, the share not divided by m) fails them by far more.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg import DevicePolicy
from fedfs_sdk.stats import (clamp_count, embedding_moments, feature_length, feature_moments, moments_of,
                             norm_fold_from_sum, psd_project, sensitivity, sum_contributions, variance_floor,
                             verdict_from_sum)
from fedfs_sdk.stats.privacy import StatsDp, add_noise, device_noise, mechanism, noise_std, packed_std
from fedfs_sdk.stats.transport import StatsDevicePolicy, StatSpec, StatsTask, unpack

D, F, P, B = 4, 3, 8, 2.0
SPECS = (StatSpec("e", "embedding", 2 * D + 1, B), StatSpec("f", "features", feature_length(F), B),
         StatSpec("c", "checks", 8, 1.0))


def test_sensitivity_bounds_one_device_and_noise_std_is_z_times_it() -> None:
    # hand values: Σe ≤ P·B, Σe² ≤ P·B², n ≤ P; checks per segment: (8, 64, 1, 1)·√c
    segs = sensitivity("embedding", 2 * D + 1, B, P)
    assert [d for _, d in segs] == [P * B, P * B * B, P]
    assert [d for _, d in sensitivity("checks", 8, 1.0, P)] == pytest.approx([8 * 2 ** .5, 64 * 2 ** .5, 2 ** .5, 2 ** .5])
    # a device at the bounds reaches them: every photo the same one-channel vector of norm B
    x = np.zeros((P + 5, D))
    x[:, 0] = B                            # more photos than the cap
    c = embedding_moments(x, bound=B, max_photos=P)
    for idx, d in segs:
        assert np.linalg.norm(c[idx]) == pytest.approx(d)
    fm = feature_moments(np.full((P, F), B / F ** .5), bound=B, max_photos=P)
    for idx, d in sensitivity("features", feature_length(F), B, P):
        assert np.linalg.norm(fm[idx]) <= d * (1 + 1e-12)
    # σ per segment = z·√k·Δ_j
    z = 0.7
    std = noise_std("embedding", 2 * D + 1, B, P, z)
    assert std[:D] == pytest.approx(z * 3 ** .5 * P * B) and std[D:2 * D] == pytest.approx(z * 3 ** .5 * P * B * B)
    assert std[-1] == pytest.approx(z * 3 ** .5 * P)
    # the added noise has that std: 4000 draws per element, pooled per segment (SE of a std ≈ 0.5 %)
    rng = np.random.default_rng(7)
    zeros = {s.name: np.zeros(s.length) for s in SPECS}
    draws = {k: [] for k in zeros}
    for _ in range(4000):
        for k, v in add_noise(zeros, SPECS, P, z, rng).items():
            draws[k].append(v)
    for s in SPECS:
        got = np.asarray(draws[s.name])
        want = noise_std(s.kind, s.length, s.bound, P, z)
        for idx, _ in sensitivity(s.kind, s.length, s.bound, P):
            ratio = got[:, idx].std() / want[idx[0]]
            assert abs(ratio - 1) < 0.05, (s.name, idx, ratio)
            assert abs(got[:, idx].mean()) < 0.1 * want[idx[0]]


def test_distributed_shares_sum_to_the_central_variance() -> None:
    task = StatsTask(1, 0, SPECS, max_photos=P, dp={"noise_multiplier": 1.3, "noise": "distributed"})
    m = 7
    central = packed_std(task, 1.3)
    # exact: m shares of variance σ²/m each
    share = packed_std(task, 1.3) / math.sqrt(m)
    assert np.allclose(m * share ** 2, central ** 2)
    # statistical, in the sum's own units: 1500 rounds of m devices (SE of a std ≈ 1.8 %; a missing √m is ×2.6)
    rng = np.random.default_rng(11)
    sums = np.stack([unpack(sum(device_noise(task, 1.3, m, rng) for _ in range(m)), task)["e"] for _ in range(1500)])
    want = noise_std("embedding", 2 * D + 1, B, P, 1.3)
    assert np.allclose(sums.std(0) / want, 1.0, atol=0.1)
    with pytest.raises(InputError, match="min_inputs"):
        device_noise(task, 1.3, 0, rng)


def test_psd_projection_on_hand_made_matrices() -> None:
    a = np.array([[1.0, 2.0], [2.0, 1.0]])        # eigenvalues 3 (1,1)/√2 and −1 (1,−1)/√2
    assert np.allclose(psd_project(a), [[1.5, 1.5], [1.5, 1.5]])
    good = np.array([[2.0, 0.5], [0.5, 1.0]])
    assert np.array_equal(psd_project(good), good)     # already PSD: unchanged
    assert np.allclose(psd_project(np.array([[1.0, 3.0], [1.0, 1.0]])), [[1.5, 1.5], [1.5, 1.5]])   # symmetrized
    assert np.allclose(psd_project(np.diag([4.0, -1.0, 0.5]), floor=1.0), np.diag([4.0, 1.0, 1.0]))
    # a noisy feature-moment sum: moments_of gives a PSD covariance
    rng = np.random.default_rng(3)
    v = feature_moments(rng.normal(size=(20, F)), bound=10.0)
    spec = StatSpec("f", "features", v.size, 10.0)
    noisy = add_noise({"f": v}, [spec], 20, 0.05, rng)["f"]
    noisy[-1] = 20.0
    _, cov, _ = moments_of(noisy)
    assert np.linalg.eigvalsh(cov).min() >= -1e-9


def test_noisy_count_clamp_variance_floor_and_verdict() -> None:
    assert clamp_count(-3.0) == 1.0 and clamp_count(0.2) == 1.0 and clamp_count(5.5) == 5.5
    assert np.allclose(variance_floor(np.array([4.0, -1.0, 2.0, 0.0])), [4.0, 0.03, 2.0, 0.03])   # 1 % of median 3
    # norm-adapt from a sum whose count came out 0.7 and one channel's Σe² below n·μ²
    v = np.array([1.4, 0.7, 0.1, 0.4, 0.7])        # D = 2: Σe, Σe², n = 0.7 → read as 1
    mu, sd = norm_fold_from_sum(v)
    assert np.allclose(mu, [1.4, 0.7]) and np.all(sd > 0)
    with pytest.raises(InputError, match="at least one photo"):
        norm_fold_from_sum(np.array([1.0, 1.0, 1.0, 1.0, -4.0]))
    # checks: a count pushed negative is "no verdict", not a division by a negative count
    out = verdict_from_sum(np.array([3.0, 1.0, 0.1, -5.0]), ["g"])
    assert out["g"].n == 0 and not out["g"].helps
    # a count of 9.6 reads 10 devices: the same verdict rule (mean 0.1, SE from Σx²)
    s = verdict_from_sum(np.array([1.0, 0.2, 0.0, 9.6]), ["g"])["g"]
    assert s.n == 10 and s.mean_margin_gain == pytest.approx(1.0 / 9.6)


def test_device_floor_refuses_a_round_without_or_below_its_dp() -> None:
    policy = StatsDevicePolicy(secagg=DevicePolicy(min_noise_multiplier=1.0))
    plain = StatsTask(1, 0, SPECS[:1])
    with pytest.raises(InputError, match="without differential privacy"):
        policy.check(plain)
    with pytest.raises(InputError, match="below this device's minimum"):
        policy.check(StatsTask(1, 0, SPECS[:1], dp={"noise_multiplier": 0.5}))
    policy.check(StatsTask(1, 0, SPECS[:1], dp={"noise_multiplier": 1.0, "noise": "distributed"}))
    StatsDevicePolicy().check(plain)                  # no floor: no DP needed (as in weight rounds)
    with pytest.raises(InputError, match="distributed DP noise needs"):
        StatsTask(1, 0, SPECS[:1], transport="plain-sum-reveals-each-device", dp={"noise_multiplier": 1.0,
                                                                                 "noise": "distributed"})
    with pytest.raises(InputError, match="unknown field"):
        StatsDp.from_json({"noise_multiplier": 1.0, "sigma": 2})


def test_round_epsilon_composes_the_statistics() -> None:
    pytest.importorskip("dp_accounting")
    from fedfs_sdk.federation.dp_account import epsilon

    rec = mechanism(SPECS[:2], P, StatsDp(2.0), 12, 1e-5)
    # two statistics at z = 2 are one Gaussian mechanism at z/√2 (RDP composes additively)
    assert rec["epsilon"] == pytest.approx(epsilon([(1.0, 2.0 / 2 ** .5, 1)], 1e-5), rel=1e-3)
    assert rec["statistics"]["e"]["std"][0] == pytest.approx(2.0 * 3 ** .5 * P * B)
    assert mechanism(SPECS[:1], P, StatsDp(0.0), 12, 1e-5)["epsilon"] == "inf"


# ---- the server: central noise in the round, distributed noise over HTTP ----------------------
def test_central_noise_is_added_once_to_the_unmasked_sum() -> None:
    pytest.importorskip("dp_accounting")
    from server_agg.stats_round import StatsRound
    from fedfs_sdk.stats.transport import PLAIN, pack

    task = StatsTask(1, 0, SPECS[:2], transport=PLAIN, min_contributors=3, max_photos=P,
                     dp={"noise_multiplier": 0.5})
    rng = np.random.default_rng(5)
    own = {u: {"e": embedding_moments(rng.normal(size=(6, D)), B, P), "f": feature_moments(rng.normal(size=(6, F)), B, P)}
           for u in range(4)}
    rnd = StatsRound(task, [str(u) for u in own], allow_plain=PLAIN)
    for u, c in own.items():
        rnd.contribute_plain(str(u), pack(c, task))
    pub = rnd.close_plain()
    want = sum_contributions(own.values())
    rec = pub["dp"]
    assert rec["noise"] == "central" and rec["contributors"] == 4 and rec["min_inputs"] is None
    assert rec["statistics"]["e"]["std"] == pytest.approx([0.5 * 3 ** .5 * P * B, 0.5 * 3 ** .5 * P * B * B,
                                                          0.5 * 3 ** .5 * P])
    assert rec["delta"] == pytest.approx(4 ** -1.1) and 0 < rec["epsilon"] < 100
    for k, v in want.sums.items():
        assert np.abs(np.asarray(pub["sums"][k]) - v).max() > 0.1     # noised (σ ≥ 6.9 here)


def test_server_publishes_a_distributed_noise_sum_with_its_mechanism(tmp_path) -> None:
    from test_stats_http import STATS, _all, _devices, _own

    from conftest_server import ADMIN, start_server
    from fedfs_sdk.federation.server_client import ServerClient
    from fedfs_sdk.stats.client import StatsParticipant

    pytest.importorskip("dp_accounting")
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--secagg-phase-timeout", "20")
    try:
        n = 5                                          # the fewest that keep a threshold below the roster (fast)
        devs = _devices(srv, tmp_path, StatsDevicePolicy.honest_but_curious(), n=n)
        admin = ServerClient(srv.url, ADMIN)
        r = admin.request("POST", "/v1/admin/stats-round", json_body={
            "stats": STATS, "min_contributors": n, "dp": {"noise_multiplier": 0.5, "noise": "distributed"}}).json()
        assert r["task"]["dp"] == {"noise_multiplier": 0.5, "noise": "distributed", "delta": None}
        # a device whose floor is above z refuses before anything leaves
        (tmp_path / "strict").mkdir()
        strict = StatsParticipant(devs[0].client, lambda task: _own(0), StatsDevicePolicy(
            secagg=DevicePolicy.honest_but_curious(min_noise_multiplier=1.0)), state_dir=tmp_path / "strict")
        with pytest.raises(InputError, match="below this device's minimum"):
            strict.take_part(devs[0].view())
        assert not (tmp_path / "strict" / "stats_contributed.json").exists()
        _all(devs, lambda d: d.take_part())
        pub = devs[0].fetch_published()
        rec = pub["dp"]
        assert pub["count"] == n and rec["noise"] == "distributed" and rec["contributors"] == n
        m = rec["min_inputs"]
        assert m == 4                                  # ⌊2·5/3⌋ + 1: the threshold of the 5 invited
        grow = math.sqrt(n / m)                        # n shares of σ²/m
        assert rec["statistics"]["xi.embedding"]["std"] == pytest.approx(
            [0.5 * 3 ** .5 * 64 * 10 * grow, 0.5 * 3 ** .5 * 64 * 100 * grow, 0.5 * 3 ** .5 * 64 * grow])
        assert 0 < rec["epsilon"] < 100 and rec["delta"] == pytest.approx(n ** -1.1)
        want = sum_contributions(_own(u) for u in range(n))
        for k, v in want.sums.items():
            diff = np.asarray(pub["sums"][k]) - v
            assert np.abs(diff).max() > 1.0            # noised: far beyond the fixed point's resolution
            assert abs(diff[-1]) < 8 * 0.5 * 3 ** .5 * 64 * grow     # the count's noise: within 8 σ
        out = admin.request("GET", f"/v1/admin/stats-round/{r['round_id']}").json()
        assert out["state"] == "published" and out["dp"]["noise_multiplier"] == 0.5
    finally:
        srv.stop()


def test_serve_flags_give_the_automatic_rounds_their_dp() -> None:
    import argparse
    from dataclasses import replace

    from server_agg.config import RoundPolicy
    from server_agg.serve_flags import add_arguments, policy_overrides
    from server_agg.stats_auto import round_dp

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--state", "s", "--stats-dp-noise-multiplier", "1.5", "--stats-dp-noise", "distributed",
                         "--stats-bound", "9"])
    policy = replace(RoundPolicy(), **policy_overrides(args))
    assert round_dp(policy) == {"noise_multiplier": 1.5, "noise": "distributed", "delta": None}
    assert policy.stats_bound == 9.0 and round_dp(RoundPolicy()) is None
    with pytest.raises(InputError, match="need stats_dp_noise_multiplier"):
        replace(RoundPolicy(), stats_dp_noise="distributed")
    with pytest.raises(InputError, match="noise_multiplier"):
        replace(RoundPolicy(), stats_dp_noise_multiplier=-1.0)
