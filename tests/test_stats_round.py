"""The statistics round (server_agg.stats_round, fedfs_sdk.stats.transport): the secure sum through the
secure-aggregation protocol equals the plain sum of the device functions' contributions; a plain round
needs the operator's named opt-in and is refused by a device that requires secure aggregation; fewer
than min_contributors publish nothing; bytes per device."""
from __future__ import annotations


import numpy as np
import pytest

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg import messages as M
from fedfs_sdk.federation.secagg.device import SecAggDevice
from fedfs_sdk.federation.secagg.errors import RefusedError
from fedfs_sdk.stats import embedding_moments, feature_length, feature_moments, sum_contributions
from fedfs_sdk.stats.transport import PLAIN, SECURE, StatSpec, StatsDevicePolicy, StatsTask, pack, unpack
from server_agg.stats_round import StatsRound, load_published, save_published


def _task(transport: str = SECURE, min_contributors: int = 3) -> StatsTask:
    return StatsTask(7, 3, (StatSpec("xi.embedding", "embedding", 2 * 8 + 1, 10.0),
                            StatSpec("xi.features", "features", feature_length(16), 10.0)),
                     transport=transport, min_contributors=min_contributors)


def _contributions(n: int) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {u: {"xi.embedding": embedding_moments(rng.normal(size=(5, 8)), bound=10.0),
                "xi.features": feature_moments(rng.normal(size=(4 + u % 3, 16)), bound=10.0)} for u in range(1, n + 1)}


def test_pack_unpack_roundtrip_and_bounds() -> None:
    task, c = _task(), _contributions(1)[1]
    p = pack(c, task)
    assert p.shape == (task.dim,) and np.abs(p).max() <= 1.0
    assert all(np.allclose(unpack(p, task)[k], c[k]) for k in c)
    with pytest.raises(InputError, match="length"):
        pack({**c, "xi.embedding": np.zeros(3)}, task)


def test_secure_statistics_round_publishes_the_plain_sum_and_only_masked_vectors_travel(tmp_path) -> None:
    from fedfs_sdk.federation.secagg.http_device import params_from_task
    from fedfs_sdk.stats.transport import stats_context
    from server_agg.config import RoundPolicy
    from server_agg.secagg_rounds import SecAggRound
    from server_agg.stats_round import stats_fields

    task, contribs = _task(), _contributions(6)
    ids = [f"dev{u}" for u in contribs]
    fields = stats_fields(RoundPolicy(), task, len(ids))           # no CA: fedfs-secagg/1
    sr = SecAggRound(task.round_id, ids, fields, tmp_path / "s.json", 0.0, 100.0, stats_context(task, fields))
    rnd = StatsRound(task, ids, secagg=sr)
    params = params_from_task(task.round_id, fields)
    assert params.dim == task.dim and not params.authenticated
    with pytest.raises(RefusedError, match="allow-unauthenticated-secagg"):
        SecAggDevice(params, 1)   # issue 30: secure by default, no silent /1
    devs = {u: SecAggDevice(params, u, policy=StatsDevicePolicy.honest_but_curious().secagg,
                            context=stats_context(task, fields)) for u in contribs}
    sent = {u: 0 for u in contribs}
    core = sr.srv

    def send(u: int, msg: dict) -> None:
        sent[u] += len(M.to_json(msg))
        core.receive(msg)

    for u, d in devs.items():
        send(u, d.advertise())
    roster = core.close_advertise()
    for u, d in devs.items():
        send(u, d.share_keys(roster))
    inboxes = core.close_share_keys()
    masked = {u: d.masked_input(inboxes[u], pack(contribs[u], task), 1) for u, d in devs.items()}
    for u, m in masked.items():
        send(u, m)
        # on the wire: the masked vector, not the device's fixed-point encoding of its statistics
        plain_words = params.fixed_point.encode(pack(contribs[u], task), 1)[0]
        wire = np.frombuffer(m["y"], dtype="<u8")
        assert wire.size == task.dim + 1 and np.mean(wire == plain_words) < 0.01
    request = core.close_masked()
    for u in request["survivors"]:
        send(u, devs[u].unmask(request))
    res = core.finalize()
    assert res.mean.dtype == np.float64        # the statistics' sum keeps the fixed point's resolution
    pub = rnd.finish(res.mean * res.total_samples, res.total_samples)
    want = sum_contributions(contribs.values())
    assert pub["count"] == 6
    for k, v in want.sums.items():   # 2^-46 steps of max_photos·bound² per device
        assert np.allclose(pub["sums"][k], v, rtol=0, atol=6 * 64 * 100 * 2.0 ** -45)
    # the device's bytes: 8 × (dim + 1) for its masked vector, plus keys and shares
    assert all(s > 8 * (task.dim + 1) for s in sent.values())
    with pytest.raises(InputError, match="runs secure-sum"):
        rnd.contribute_plain("dev1", pack(contribs[1], task))


def test_plain_round_needs_the_named_opt_in_and_a_secure_device_refuses_it(tmp_path) -> None:
    task, contribs = _task(PLAIN), _contributions(4)
    with pytest.raises(InputError, match="allow_plain"):
        StatsRound(task, [str(u) for u in contribs])
    with pytest.raises(InputError, match="requires secure-sum"):
        StatsDevicePolicy().check(task)
    StatsDevicePolicy(require_secure=False).check(task)
    rnd = StatsRound(task, [str(u) for u in contribs], allow_plain=PLAIN)
    for u, c in contribs.items():
        rnd.contribute_plain(str(u), pack(c, task))
    with pytest.raises(InputError, match="already contributed"):
        rnd.contribute_plain("1", pack(contribs[1], task))
    pub = rnd.close_plain()
    want = sum_contributions(contribs.values())
    assert pub["count"] == 4 and all(np.allclose(pub["sums"][k], v) for k, v in want.sums.items())
    save_published(tmp_path / "stats.json", pub)                 # what a device keeps for its next enrollment
    t2, s2 = load_published(tmp_path / "stats.json")
    assert t2 == task and s2.count == 4 and np.allclose(s2.sums["xi.features"], want.sums["xi.features"])


def test_too_few_contributors_publish_nothing() -> None:
    task, contribs = _task(PLAIN, min_contributors=3), _contributions(3)
    rnd = StatsRound(task, [str(u) for u in contribs], allow_plain=PLAIN)
    for u in (1, 2):
        rnd.contribute_plain(str(u), pack(contribs[u], task))
    with pytest.raises(InputError, match="2 contributor"):
        rnd.close_plain()
    assert rnd.published is None
    with pytest.raises(InputError, match="min_contributors ≥ 2"):
        _task(min_contributors=1)
