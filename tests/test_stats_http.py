"""The statistics round over HTTP with a real `fedfs serve` process on 127.0.0.1.

* ``--secure-aggregation --secagg-ca``: the round runs the weight rounds' authenticated protocol
  (``fedfs-secagg/2``: certified identities, signed roster, consistency check); ten devices whose
  floor is the default :class:`DevicePolicy` with the pinned CA — no opt-in — publish the sum of their
  statistics (equal to the plain sum of the device functions' contributions). The server refuses a
  second round of the same statistic on the same basis, and a device refuses to contribute it twice.
* no CA: the secure sum runs ``fedfs-secagg/1``, which a default device refuses; the
  honest-but-curious opt-in takes part.
* a plain round is opened only by naming it and refused by a device that requires secure aggregation.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest_server import ADMIN, start_server
from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg import CaPublicKey, DevicePolicy
from fedfs_sdk.federation.secagg.http_device import SecAggRoundLost
from fedfs_sdk.federation.secagg.identity import CertificateAuthority, DeviceIdentity
from fedfs_sdk.federation.server_client import ServerClient, ServerError
from fedfs_sdk.stats import embedding_moments, feature_length, feature_moments, sum_contributions
from fedfs_sdk.stats.client import StatsParticipant
from fedfs_sdk.stats.transport import PLAIN, SECURE, StatsDevicePolicy

pytestmark = [pytest.mark.timeout(120)]

N = 10
STATS = [{"name": "xi.embedding", "kind": "embedding", "length": 2 * 8 + 1, "bound": 10.0},
         {"name": "xi.features", "kind": "features", "length": feature_length(12), "bound": 10.0}]


def _own(u: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + u)
    return {"xi.embedding": embedding_moments(rng.normal(size=(6, 8)), bound=10.0),
            "xi.features": feature_moments(rng.normal(size=(6, 12)), bound=10.0)}


def _devices(srv, tmp_path, policy: StatsDevicePolicy, ca: CertificateAuthority | None = None, n: int = N,
             tag: str = "d"):
    out = []
    for u in range(n):
        reg = ServerClient(srv.url).register()
        ServerClient(srv.url, reg["token"]).task()         # its first poll: only then is it sampled
        ident = None
        if ca is not None:
            ident = DeviceIdentity.generate()
            ident = ident.with_certificate(ca.sign_request(ident.request(f"{tag}{u}")))
        (tmp_path / f"{tag}{u}").mkdir()
        out.append(StatsParticipant(ServerClient(srv.url, reg["token"]), lambda task, u=u: _own(u), policy,
                                    state_dir=tmp_path / f"{tag}{u}", identity=ident, wait_timeout_s=60))
    return out


def _all(devs, fn):
    with ThreadPoolExecutor(len(devs)) as pool:
        return list(pool.map(fn, devs))


def test_authenticated_statistics_round_with_default_device_floors(tmp_path) -> None:
    ca = CertificateAuthority.generate()
    _, pub = ca.save(tmp_path / "ca")
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--secure-aggregation", "--secagg-ca", str(pub),
                       "--secagg-phase-timeout", "20")
    try:
        policy = StatsDevicePolicy(secagg=DevicePolicy(ca=CaPublicKey.load(pub)))   # the weight rounds' floor
        devs = _devices(srv, tmp_path, policy, ca)
        admin = ServerClient(srv.url, ADMIN)
        r = admin.request("POST", "/v1/admin/stats-round", json_body={"stats": STATS, "min_contributors": N}).json()
        assert r["phase"] == "secure" and r["protocol"] == "fedfs-secagg/2" and r["task"]["transport"] == SECURE
        got = _all(devs, lambda d: d.take_part())
        assert all(g["protocol"] == "fedfs-secagg/2" for g in got)
        pub_sum = devs[0].fetch_published()
        want = sum_contributions(_own(u) for u in range(N))
        assert pub_sum["count"] == N and pub_sum["round_id"] == r["round_id"]
        for k, v in want.sums.items():
            assert np.allclose(pub_sum["sums"][k], v, rtol=0, atol=1e-6)
        assert (tmp_path / "d0" / f"stats-r{r['round_id']:06d}.json").is_file()
        # what crossed the wire from each device: keys, certificate, signatures, shares, the masked vector
        dim = 2 * 8 + 1 + feature_length(12)
        assert all(g["bytes_sent"] > 8 * (dim + 1) for g in got)
        # the same statistic on the same basis again: the server refuses, and so would each device
        with pytest.raises(ServerError, match="already summed"):
            admin.request("POST", "/v1/admin/stats-round", json_body={"stats": STATS, "min_contributors": N})
        from fedfs_sdk.stats.transport import StatsTask

        with pytest.raises(InputError, match="already contributed"):
            devs[0]._record(StatsTask.from_json(r["task"]))
    finally:
        srv.stop()


def test_unauthenticated_secure_sum_needs_the_opt_in_and_a_plain_round_is_named(tmp_path) -> None:
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--secagg-phase-timeout", "20")
    try:
        devs = _devices(srv, tmp_path, StatsDevicePolicy.honest_but_curious())
        admin = ServerClient(srv.url, ADMIN)
        r = admin.request("POST", "/v1/admin/stats-round", json_body={"stats": STATS, "min_contributors": N}).json()
        assert r["protocol"] == "fedfs-secagg/1"
        (tmp_path / "strict").mkdir()
        strict = StatsParticipant(devs[0].client, lambda task: _own(0), StatsDevicePolicy(), state_dir=tmp_path / "strict")
        with pytest.raises(SecAggRoundLost, match="allow-unauthenticated-secagg"):
            strict.take_part(devs[0].view())          # the default floor, shown device 1's round
        assert not (tmp_path / "strict" / "stats_contributed.json").exists()    # refused before anything left
        _all(devs, lambda d: d.take_part())
        assert devs[3].fetch_published()["count"] == N

        # a plain sum: only when the operator names it, and refused by a device that requires secure sums
        plain_stats = [{**s, "name": "plain." + s["name"]} for s in STATS]
        r = admin.request("POST", "/v1/admin/stats-round",
                          json_body={"stats": plain_stats, "transport": PLAIN, "min_contributors": N}).json()
        assert r["phase"] == "plain"
        with pytest.raises(InputError, match="requires secure-sum"):
            strict.take_part(devs[0].view())
        lax = [StatsParticipant(d.client, lambda task, u=u: {"plain." + k: v for k, v in _own(u).items()},
                                StatsDevicePolicy(require_secure=False)) for u, d in enumerate(devs)]
        for d in lax:
            assert d.take_part()["transport"] == PLAIN
        out = admin.request("GET", f"/v1/admin/stats-round/{r['round_id']}").json()   # all ten: closed at once
        assert out["state"] == "published" and out["count"] == N
    finally:
        srv.stop()
