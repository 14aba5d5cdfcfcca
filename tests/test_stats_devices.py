"""Device agents run the defaults' full rule against a real ``fedfs serve`` process (issue 29):

``fedfs serve --xi … --rounds 1 --secure-aggregation --secagg-ca ca.pub`` opens the statistics rounds
by itself — ξ's moments before the weight round, the check results after it — under ``fedfs-secagg/2``;
ten :class:`DeviceAgent` s (one test process, each its own state folder and certified identity, the
default :class:`DeviceConfig` apart from the CA they pin) take part in both without extra flags, and at
enrollment choose with the in-domain check, ``norm-adapt`` ξ as a candidate and the federation's
verdict — half of them torch devices, half artifact-only phones (``fedfs export``'s default ORT artifacts
of the server's model). Each device's choice is the simulator rule's (:func:`fedfs_sdk.stats.in_domain.decide` on the
simulator's checks, :class:`device_sim.methods.selection.SimSelection`'s functions) recomputed from the
published sums, the device's own contribution and its photos; the published sums equal the sums of the
devices' own contributions (:func:`fedfs_sdk.stats.sum_contributions`, the simulator's sum).
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from conftest_server import ADMIN, start_server, write_images
from fedfs_sdk.nn.checkpoint import save_checkpoint
from fedfs_sdk.nn.model import FaceNet, ModelConfig

pytestmark = [pytest.mark.timeout(300)]
N = 10
TRAIN = {"lr": 0.05, "local_epochs": 1, "batch_size": 4}


def test_ten_devices_run_the_statistics_rounds_and_the_in_domain_rule(tmp_path):
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.device_identity import identity_request
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.secagg import CaPublicKey, DevicePolicy
    from fedfs_sdk.federation.secagg.identity import CertificateAuthority
    from fedfs_sdk.federation.server_client import ServerClient
    from fedfs_sdk.stats import sum_contributions
    from fedfs_sdk.stats.in_domain import CHECKS, EMBEDDING, FEATURES

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # ten agents in threads on a shared machine: no intra-op oversubscription
    save_checkpoint(tmp_path / "xi.safetensors", FaceNet(ModelConfig("tiny")), ModelConfig("tiny"))
    ca = CertificateAuthority.generate()
    _, pub = ca.save(tmp_path / "ca")
    # the public impostor set the server ships: 20 people × 4 photos (the tail's directions)
    from fedfs_sdk.runtime.impostors import save_impostors
    from test_operating_point import _impostor_set

    save_impostors(tmp_path / "public.npz", _impostor_set(ModelConfig("tiny").resolved().input_size, 20, 4))
    srv = start_server(tmp_path / "server", "--xi", str(tmp_path / "xi.safetensors"), "--rounds", "1",
                       "--impostors", str(tmp_path / "public.npz"),
                       "--min-participants", str(N), "--secure-aggregation", "--secagg-ca", str(pub),
                       "--secagg-phase-timeout", "60", "--round-timeout", "120", "--train", json.dumps(TRAIN))
    events: dict[int, list] = {d: [] for d in range(N)}
    states = [DeviceState(tmp_path / f"dev{d}") for d in range(N)]
    try:
        # the odd devices are phones: `fedfs export`'s default artifacts of the server's model, no torch in
        # their computation (ONNX Runtime: trunk.onnx, the top's training graph, onnx/top.onnx, the verifiers)
        from export.pipeline import ExportOptions, run_export
        from fedfs_sdk.federation.ort_runtime import OrtRuntime

        with ServerClient(srv.url, ADMIN) as admin0:
            (tmp_path / "v1.safetensors").write_bytes(admin0.request("GET", "/v1/models/1").content)
        run_export(tmp_path / "v1.safetensors", tmp_path / "phone", ExportOptions(
            formats=("onnx", "ort-training"), xi=str(tmp_path / "xi.safetensors"), methods=("fedfs+feduv",), train=TRAIN))
        agents = []
        for d in range(N):
            cert = ca.sign_request(identity_request(states[d], f"dev{d}"))
            cert.save(tmp_path / f"cert{d}.json")
            images = [str(p) for p in write_images(tmp_path / f"img{d}", 8, seed=40 + d)]
            phone = d % 2 == 1
            cfg = DeviceConfig(rounds=1, enroll=True, q=0.8, far=1e-2, wait_timeout_s=200, artifacts=tmp_path / "phone" if phone else None,
                               secagg=DevicePolicy(ca=CaPublicKey.load(pub)), identity_certificate=tmp_path / f"cert{d}.json")
            agents.append(DeviceAgent(ServerClient(srv.url), states[d], images, cfg,
                                      runtime=OrtRuntime(tmp_path / "phone", intra_op_threads=1) if phone else None,
                                      on_event=lambda n, f, d=d: events[d].append((n, f))))
        with ThreadPoolExecutor(N) as pool:
            reports = list(pool.map(lambda a: a.run(), agents))

        import os
        if os.environ.get("DEVSTATS_DEBUG"):
            open(os.environ["DEVSTATS_DEBUG"], "w").write("\n".join(str(e)[:600] for e in events[0]))
        admin = ServerClient(srv.url, ADMIN)
        xi_round, check_round = (admin.request("GET", f"/v1/admin/stats-round/{i}").json() for i in (1, 2))
        assert xi_round["state"] == "published" and xi_round["count"] == N, xi_round
        assert check_round["state"] == "published" and check_round["count"] == N, (check_round, "\n".join(str(e)[:400] for e in events[0] if e[0].startswith(("stats", "model"))))
        client = ServerClient(srv.url, states[0].token)
        pub_xi, pub_checks = (client.request("GET", f"/v1/stats/{i}").json() for i in (1, 2))
        assert client.request("GET", "/v1/stats/rounds").json() == {"published_rounds": [1, 2]}
        newest = client.request("GET", "/v1/stats").json()     # the newest, with every id (served from the cache)
        assert newest == {**pub_checks, "published_rounds": [1, 2]} and pub_xi["published_rounds"] == [1, 2]
        assert pub_checks["task"]["extra"]["candidates"] == ["xi", "norm-adapt", "global", "personalized"]
        # the server's sum is the sum of the devices' own contributions (what the simulator sums)
        own = [dict(np.load(tmp_path / f"dev{d}" / "stats" / "stats-own-r000001.npz")) for d in range(N)]
        want = sum_contributions(own)
        for k in (EMBEDDING, FEATURES):
            # each device's packed vector is rounded to 2^-46 of max_photos·bound² (bound 1e3)
            assert np.allclose(pub_xi["sums"][k], want.sums[k], rtol=0, atol=N * 64 * 1e6 * 2.0 ** -46)
        # the check-results round also carried ξ's tail along the 20 public people (.device_tail): its sum is
        # the devices' own contributions', each device's histogram counts its training photos once per person
        from fedfs_sdk.stats.tail import TAIL, TAIL_BINS

        assert pub_checks["task"]["extra"]["impostors_sha256"] and len(pub_checks["sums"][TAIL]) == 20 * TAIL_BINS
        own2 = [dict(np.load(tmp_path / f"dev{d}" / "stats" / "stats-own-r000002.npz")) for d in range(N)]
        assert np.allclose(pub_checks["sums"][TAIL], sum_contributions(own2).sums[TAIL], rtol=0, atol=1e-6)
        for d in range(N):
            counts = own2[d][TAIL].reshape(20, TAIL_BINS).sum(1)
            assert np.all(counts == len(agents[d].holdout_split()[0])), (d, counts)
        # phones and torch devices bin their photos alike: the same ξ, trunk and top (ORT vs torch)
        _tail_alike(agents[0], agents[1], srv.url, tmp_path, pub_xi)

        for d, rep in enumerate(reports):
            sel = rep.enrollment.meta["selection"]
            assert sel["check"] == "in-domain" and sel["in_stats_round"] and "fallback" not in sel, sel
            assert rep.enrollment.meta["runtime"] == ("ort" if d % 2 else "torch")
            assert [c["name"] for c in sel["checks"]] == ["xi", "norm-adapt", "global", "personalized"]
            assert sel["verdict"] == f"published over {N} devices"
            # FAR 1e-2 from the federation's tail: the 80-photo public set cannot set it alone
            op = rep.enrollment.meta["operating_point"]
            assert op["far_evidence"] == "federation-statistics" and op["in_domain"]["contributors"] == N, op
            names = [n for n, _ in events[d]]
            assert names.count("stats_round_done") == 2, names
            # the round's model came as its top alone, ξ's trunk put under it (federation/model_top.py)
            downloads = [f for n, f in events[d] if n == "model_downloaded"]
            assert "model_top_refused" not in names and downloads and downloads[0]["top_only"], names
            # the simulator's rule on the same numbers: its verdicts from the same published check sum
            from fedfs_sdk.stats import verdict_from_sum
            from fedfs_sdk.stats.in_domain import decide
            from fedfs_sdk.training.selection import CandidateCheck

            checks = [CandidateCheck(**{k: c[k] for k in CandidateCheck.__dataclass_fields__}) for c in sel["checks"]]
            again = decide(checks, np.asarray(pub_checks["sums"][CHECKS]), pub_checks["task"]["extra"]["candidates"])
            assert again.chosen == sel["chosen"] == rep.enrollment.meta["model_choice"]
            verdicts = verdict_from_sum(np.asarray(pub_checks["sums"][CHECKS]), ["norm-adapt", "global", "personalized"])
            assert all(v.n == N for v in verdicts.values())
        _simulator_builds_the_same_xi_candidates(tmp_path, agents[0], reports[0], pub_xi)

        # the default's norm_init: version 2 is the initial model with ξ's normalization re-fitted to the
        # published embedding moments (the simulator's init_global), and round 1 trained from it
        from conftest_server import read_safetensors
        from fedfs_sdk.nn.checkpoint import load_checkpoint
        from fedfs_sdk.stats import norm_fold_from_sum

        auto = admin.request("GET", "/v1/admin/stats-rounds").json()["automatic"]
        assert auto[f"norm_init:{pub_xi['task']['extra']['xi_sha256']}"]["version"] == 2, auto
        assert admin.request("GET", "/v1/rounds/1").json()["model_version"] == 2
        v2 = read_safetensors(admin.request("GET", "/v1/models/2").content)[0]
        xi_sd = load_checkpoint(tmp_path / "xi.safetensors")[0].state_dict()
        mu, sd = norm_fold_from_sum(np.asarray(pub_xi["sums"][EMBEDDING]))
        want_b = (xi_sd["backbone.embed_norm.bias"].double().numpy() - mu) / np.maximum(sd, 1e-6)
        assert np.allclose(v2["backbone.embed_norm.bias"], want_b, rtol=1e-5, atol=1e-5)

        # a device that was offline during the rounds still enrolls with the published sums (its photos were
        # in none of them: the others' moments are the whole sum); it trained nothing, so no θ_c candidate
        late = DeviceState(tmp_path / "late")
        states.append(late)
        cert = ca.sign_request(identity_request(late, "late"))
        cert.save(tmp_path / "cert-late.json")
        cfg = DeviceConfig(rounds=1, enroll=True, q=0.8, wait_timeout_s=60, secagg=DevicePolicy(ca=CaPublicKey.load(pub)),
                           identity_certificate=tmp_path / "cert-late.json")
        rep = DeviceAgent(ServerClient(srv.url), late, [str(p) for p in write_images(tmp_path / "img-late", 8, seed=99)],
                          cfg).run()
        sel = rep.enrollment.meta["selection"]
        assert rep.rounds == [] and rep.finished_by_server
        assert sel["check"] == "in-domain" and not sel["in_stats_round"] and sel["verdict"] == f"published over {N} devices"
        assert [c["name"] for c in sel["checks"]] == ["xi", "norm-adapt", "global"]
        ledger = json.loads((tmp_path / "dev0" / "stats" / "stats_contributed.json").read_text())
        assert sorted(ledger) == sorted(pub_xi["task"] and [f"{EMBEDDING}@xi:{pub_xi['task']['extra']['xi_sha256']}",
                                                              f"{FEATURES}@xi:{pub_xi['task']['extra']['xi_sha256']}",
                                                              f"{CHECKS}@model:{pub_checks['task']['model_version']}",
                                                              f"{TAIL}@xi:{pub_xi['task']['extra']['xi_sha256']}"])
    finally:
        torch.set_num_threads(threads)
        for s in states:
            s.close()
        srv.stop()


def _simulator_builds_the_same_xi_candidates(tmp_path, agent, report, pub_xi) -> None:
    """ξ and norm-adapt ξ as the simulator builds them (``device_sim``: ``verifier_net``,
    ``fold_standardization`` of the round's embedding sum) and the simulator's draws (the published
    feature sum minus the device's own contribution) give the device's recorded checks."""
    from device_sim.methods.base import verifier_net
    from device_sim.methods.reference import fold_standardization
    from device_sim.methods.selection import top_verifier
    from fedfs_sdk.nn.checkpoint import load_checkpoint
    from fedfs_sdk.stats import norm_fold_from_sum
    from fedfs_sdk.stats.in_domain import EMBEDDING, FEATURES, in_domain_draws
    from fedfs_sdk.training.selection import check_candidate

    xi = load_checkpoint(tmp_path / "xi.safetensors")[0]
    cfg = xi.config.resolved()
    w = {k: v for k, v in xi.state_dict().items() if k.startswith("backbone.")}
    mu, sd = norm_fold_from_sum(np.asarray(pub_xi["sums"][EMBEDDING]), "standardize")
    own = dict(np.load(tmp_path / "dev0" / "stats" / "stats-own-r000001.npz"))
    drawn = torch.from_numpy(in_domain_draws(np.asarray(pub_xi["sums"][FEATURES]), own[FEATURES]))
    train, hold = agent.holdout_split()
    x = torch.from_numpy(agent.all_images_array(int(cfg.input_size)))
    recorded = {c["name"]: c for c in report.enrollment.meta["selection"]["checks"]}
    for name, weights in (("xi", w), ("norm-adapt", fold_standardization(
            w, torch.from_numpy(mu).float(), torch.from_numpy(sd).float()))):
        net = verifier_net(cfg, with_head=False).eval()
        net.load_state_dict(weights)
        with torch.no_grad():
            tr, ho = (net(x[i])[0].double().numpy() for i in (train, hold))
            im = top_verifier(net)(drawn)[0].double().numpy()
        ck = check_candidate(name, tr, ho, im, far=1e-3)
        for key in ("margin", "auroc", "threshold", "tar"):
            assert np.isclose(getattr(ck, key), recorded[name][key], rtol=1e-4, atol=1e-5), (name, key)


def _tail_alike(torch_agent, phone, url, tmp_path, pub_xi) -> None:
    """A torch device's and a phone's ``xi.tail`` of the same photos agree (the bins of scores equal to
    float32 rounding: at most a count or two moves across a bin edge)."""
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_tail import tail_contribution
    from fedfs_sdk.federation.server_client import ServerClient
    from fedfs_sdk.stats.tail import TAIL_BINS
    from fedfs_sdk.stats.transport import StatsTask

    task = StatsTask.from_json(json.loads((tmp_path / "dev0" / "stats" / "stats-r000002.json").read_text())["task"])
    same_photos = DeviceAgent(ServerClient(url, phone.state.token), phone.state, torch_agent.images, phone.config, runtime=phone.runtime)
    from fedfs_sdk.stats.in_domain import FEATURES

    got = [tail_contribution(a, task, 20 * TAIL_BINS, np.asarray(pub_xi["sums"][FEATURES])) for a in (torch_agent, same_photos)]
    assert got[0].sum() == got[1].sum() > 0 and np.abs(got[0] - got[1]).sum() <= 4, np.abs(got[0] - got[1]).sum()
