"""The server's round state survives a restart at every step (fedfs_sdk.federation.secagg.persist):
a server rebuilt from its JSON snapshot after each message finishes the round correctly."""
import numpy as np
import pytest

from fedfs_sdk.federation.secagg import (BadMessageError, DevicePolicy, ReplayError, SecAggDevice, SecAggParams, SecAggServer, from_json,
                              restore, snapshot, to_json)

DIM = 30


def _reborn(p, srv):
    return restore(p, from_json(to_json(snapshot(srv))))


@pytest.mark.parametrize("drop", [(), (3,)])
def test_restart_after_every_message(drop):
    p = SecAggParams(round_id=12, dim=DIM)
    devs = {u: SecAggDevice(p, u, policy=DevicePolicy.honest_but_curious()) for u in range(1, 7)}
    srv = SecAggServer(p)
    for d in devs.values():
        srv.receive(d.advertise())
        srv = _reborn(p, srv)
    roster = srv.close_advertise()
    srv = _reborn(p, srv)
    for d in devs.values():
        srv.receive(d.share_keys(roster))
        srv = _reborn(p, srv)
    inboxes = srv.close_share_keys()
    srv = _reborn(p, srv)
    assert all(to_json(srv.inbox(u)) == to_json(inboxes[u]) for u in inboxes)   # re-served after restart
    w = {u: (np.full(DIM, 0.01 * u, np.float32), 10 * u) for u in devs}
    for u, d in devs.items():
        m = d.masked_input(srv.inbox(u), *w[u])
        if u not in drop:
            srv.receive(m)
            srv = _reborn(p, srv)
    with pytest.raises(ReplayError, match="device 6 already sent"):   # the restored server remembers
        srv.receive(m)
    request = srv.close_masked()
    srv = _reborn(p, srv)
    for u in request["survivors"]:
        srv.receive(devs[u].unmask(request))
        srv = _reborn(p, srv)
    res = srv.finalize()
    surv = [u for u in devs if u not in drop]
    exact = sum(0.01 * u * 10 * u for u in surv) / sum(10 * u for u in surv)
    assert res.survivors == surv and res.total_samples == sum(10 * u for u in surv)
    assert np.allclose(res.mean, exact, atol=1e-6)


def test_snapshot_of_another_round_rejected():
    srv = SecAggServer(SecAggParams(round_id=1, dim=DIM))
    with pytest.raises(BadMessageError, match="round 1"):
        restore(SecAggParams(round_id=2, dim=DIM), snapshot(srv))
    with pytest.raises(BadMessageError, match="snapshot"):
        restore(SecAggParams(round_id=1, dim=DIM), {"format": "x"})
