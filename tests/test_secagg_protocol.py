"""Secure aggregation end to end in-process (fedfs_sdk.federation.secagg + device_sim.secagg_sim):
the unmasked sum is the weighted FedAvg of the survivors, with dropouts up to n − t."""
import numpy as np
import pytest

from device_sim.secagg_sim import gaussian_updates, run_round
from fedfs_sdk.federation.secagg import RoundFailedError, SecAggParams, default_threshold, neighbours

N = 10
T = default_threshold(N)          # 7: tolerates N − T = 3 dropouts
DIM = 300


def _check(rep, survivors):
    assert rep.result.survivors == sorted(survivors)
    fp = rep.server.params.fixed_point
    tol = fp.error_bound() + np.abs(rep.expected) * 2.0**-24      # fixed point + float32 cast
    assert np.all(np.abs(rep.result.mean.astype(np.float64) - rep.expected) <= tol)
    upd = gaussian_updates(DIM)
    assert rep.result.total_samples == sum(upd(u)[1] for u in survivors)


def test_threshold_default():
    assert T == 7 and default_threshold(100) == 67 and default_threshold(1000) == 667


@pytest.mark.parametrize("step", ["masked_input", "unmask"])
@pytest.mark.parametrize("n_drop", [0, 1, N - T])
def test_dropouts_after_masking(step, n_drop):
    dropped = list(range(2, 2 + n_drop))
    rep = run_round(SecAggParams(round_id=3, dim=DIM), range(1, N + 1), gaussian_updates(DIM), {step: dropped})
    # a device dropping at masked_input sends no y: it is not in the sum; one dropping at
    # unmask sent y: it is, and its self-mask is rebuilt from the others' shares
    survivors = [u for u in range(1, N + 1) if step == "unmask" or u not in dropped]
    _check(rep, survivors)
    assert rep.result.dropped[step] == dropped


@pytest.mark.parametrize("n_drop", [1, N - T])
def test_dropouts_at_share_keys(n_drop):
    dropped = list(range(5, 5 + n_drop))
    rep = run_round(SecAggParams(round_id=3, dim=DIM), range(1, N + 1), gaussian_updates(DIM), {"share_keys": dropped})
    _check(rep, [u for u in range(1, N + 1) if u not in dropped])


def test_mixed_dropouts_over_all_steps():
    drop = {"share_keys": [1], "masked_input": [4], "unmask": [9]}
    rep = run_round(SecAggParams(round_id=3, dim=DIM), range(1, N + 1), gaussian_updates(DIM), drop)
    _check(rep, [u for u in range(1, N + 1) if u not in (1, 4)])


@pytest.mark.parametrize("step", ["share_keys", "masked_input", "unmask"])
def test_one_drop_too_many_fails_cleanly(step):
    dropped = list(range(1, N - T + 2))       # 4 of 10, threshold 7
    with pytest.raises(RoundFailedError, match=f"only 6 devices survived {step}, the threshold is 7") as ei:
        run_round(SecAggParams(round_id=3, dim=DIM), range(1, N + 1), gaussian_updates(DIM), {step: dropped})
    assert ei.value.status == 410 and ei.value.survivors == 6 and ei.value.threshold == 7


def test_configured_threshold_and_minimum(monkeypatch):
    """The server accepts a configured threshold down to a strict majority (⌊m/2⌋ + 1); devices
    accept it only with the honest-but-curious rule (``threshold_rule="majority"``) — by default
    they need two thirds, and refuse the roster (test_secagg_attacks.py has the reason)."""
    from fedfs_sdk.federation.secagg import DevicePolicy, RefusedError

    with pytest.raises(RefusedError, match="threshold 6 is below this device's floor 7"):
        run_round(SecAggParams(round_id=1, dim=50, threshold=6), range(1, 11), gaussian_updates(50))
    rep = run_round(SecAggParams(round_id=1, dim=50, threshold=6), range(1, 11), gaussian_updates(50),
                    {"masked_input": [1, 2, 3, 4]},
                    policy=DevicePolicy(threshold_rule="majority", allow_unauthenticated=True))
    assert len(rep.result.survivors) == 6
    with pytest.raises(RoundFailedError, match="below the minimum 6"):
        run_round(SecAggParams(round_id=1, dim=50, threshold=5), range(1, 11), gaussian_updates(50))


def test_via_json_and_odd_ids():
    ids = [7, 13, 1000, 2**31 - 2, 42]
    rep = run_round(SecAggParams(round_id=9, dim=64), ids, gaussian_updates(64), {"masked_input": [13]}, via_json=True)
    assert rep.result.survivors == [7, 42, 1000, 2**31 - 2]
    assert rep.max_abs_error <= 1e-6


def test_clipping_reported():
    def upd(u):
        w = np.zeros(8, np.float32)
        w[0] = 1000.0 if u == 2 else 1.0
        return w, 1
    rep = run_round(SecAggParams(round_id=1, dim=8), range(1, 5), upd)
    assert rep.n_clipped == 1
    assert rep.result.mean[0] == pytest.approx((256.0 + 3.0) / 4)


def test_secaggplus_graph_is_k_regular_and_sums():
    p = SecAggParams(round_id=5, dim=DIM, neighbours=6)
    ids = list(range(1, 41))
    g = neighbours(p, ids)
    assert all(len(v) == 6 and u not in v for u, v in g.items())
    assert all(u in g[v] for u in ids for v in g[u])          # symmetric
    assert g != neighbours(SecAggParams(round_id=6, dim=DIM, neighbours=6), ids)   # fresh per round
    rep = run_round(p, ids, gaussian_updates(DIM), {"masked_input": [3], "unmask": [30]})
    assert len(rep.result.survivors) == 39
    assert rep.max_abs_error <= 1e-6
    assert max(rep.steps["share_keys"].sent) < 0.25 * max(
        run_round(SecAggParams(round_id=5, dim=DIM), ids, gaussian_updates(DIM)).steps["share_keys"].sent)
