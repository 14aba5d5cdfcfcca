"""The statistics round over HTTP with a real `fedfs serve` process on 127.0.0.1: ten devices send
their secure-sum messages, the server publishes the sum of their statistics (equal to the plain sum
of the device functions' contributions); only masked vectors cross the wire; a plain round is opened
only by naming it and refused by a device that requires secure aggregation."""
from __future__ import annotations

import numpy as np
import pytest

from conftest_server import ADMIN, start_server
from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.server_client import ServerClient
from fedfs_sdk.stats import embedding_moments, feature_length, feature_moments, sum_contributions
from fedfs_sdk.stats.client import StatsParticipant
from fedfs_sdk.stats.transport import PLAIN, SECURE, StatsDevicePolicy

N = 10
STATS = [{"name": "xi.embedding", "kind": "embedding", "length": 2 * 8 + 1, "bound": 10.0},
         {"name": "xi.features", "kind": "features", "length": feature_length(12), "bound": 10.0}]


def _own(u: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + u)
    return {"xi.embedding": embedding_moments(rng.normal(size=(6, 8)), bound=10.0),
            "xi.features": feature_moments(rng.normal(size=(6, 12)), bound=10.0)}


@pytest.fixture()
def server(tmp_path):
    srv = start_server(tmp_path / "server")
    yield srv
    srv.stop()


def _devices(srv, policy=StatsDevicePolicy.honest_but_curious()):
    out = []
    for u in range(N):
        reg = ServerClient(srv.url).register()
        c = ServerClient(srv.url, reg["token"])
        out.append((u, StatsParticipant(c, lambda task, u=u: _own(u), policy)))
    return out


def test_secure_statistics_round_over_http(server, tmp_path) -> None:
    admin = ServerClient(server.url, ADMIN)
    devs = _devices(server)
    r = admin.request("POST", "/v1/admin/stats-round", json_body={"stats": STATS, "min_contributors": N}).json()
    rid = r["round_id"]
    assert r["phase"] == "advertise" and r["task"]["transport"] == SECURE
    for phase in ("advertise", "share_keys", "masked", "unmask"):
        for _, d in devs:
            assert d.step() == phase
        admin.request("POST", f"/v1/admin/stats-round/{rid}/advance")
    pub = devs[0][1].fetch_published(tmp_path / "device0-stats.json")
    want = sum_contributions(_own(u) for u in range(N))
    assert pub["count"] == N
    for k, v in want.sums.items():
        assert np.allclose(pub["sums"][k], v, rtol=0, atol=1e-4)
    assert (tmp_path / "device0-stats.json").is_file()
    # what crossed the wire from each device: keys, encrypted shares, the masked vector, unmasking shares
    dim = 2 * 8 + 1 + feature_length(12)
    assert all(d.bytes_sent > 8 * (dim + 1) for _, d in devs)


def test_plain_round_is_named_and_refused_by_a_secure_device(server) -> None:
    admin = ServerClient(server.url, ADMIN)
    devs = _devices(server, StatsDevicePolicy(require_secure=False))
    strict = _devices(server)[:1]
    r = admin.request("POST", "/v1/admin/stats-round",
                      json_body={"stats": STATS, "transport": PLAIN, "min_contributors": N}).json()
    assert r["phase"] == "plain"
    with pytest.raises(InputError, match="requires secure-sum"):
        strict[0][1].step()
    for _, d in devs:
        assert d.step() == "plain"
    out = admin.request("POST", f"/v1/admin/stats-round/{r['round_id']}/advance").json()
    assert out == {"round_id": r["round_id"], "phase": "published", "count": N}
