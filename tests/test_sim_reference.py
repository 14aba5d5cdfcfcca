"""Honest personalization references (local-compact, norm-adapt, oracle), the head-template
verifier, methods that train only some parameter groups, and scenario data."""
from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch

from conftest_sim import RandomClients, setup_method, xi  # noqa: F401
from device_sim import cli_simulate
from device_sim.experiment import ExperimentConfig
from device_sim.experiment_data import build_data, build_pretrain_data
from device_sim.experiment_resolve import experiment_from_args
from device_sim.executors import LocalConfig
from device_sim.federation import Federation, FederationConfig
from device_sim.methods import parse_method
from device_sim.methods.reference import compact_loss, fold_standardization, pooled_embedding_stats
from device_sim.methods.base import backbone_weights, verifier_net
from fedfs_sdk.errors import InputError


def test_compact_loss_matches_hand_computation() -> None:
    e = torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    u = e / e.norm(dim=1, keepdim=True)
    c = u.mean(0) / u.mean(0).norm()
    expect = float((1 - u @ c).mean())
    assert float(compact_loss(e)) == pytest.approx(expect, abs=1e-6)
    # the padded row is ignored (mask), so the loss equals the unpadded one
    padded = torch.cat([e, torch.tensor([[-5.0, 7.0]])])
    assert float(compact_loss(padded, torch.tensor([1, 1, 1, 0]))) == pytest.approx(expect, abs=1e-6)
    # no gradient through the centre: the gradient is that of a constant centre
    e2 = e.clone().requires_grad_(True)
    compact_loss(e2).backward()
    e3 = e.clone().requires_grad_(True)
    u3 = e3 / e3.norm(dim=1, keepdim=True)
    (1 - u3 @ c).mean().backward()
    assert torch.allclose(e2.grad, e3.grad, atol=1e-6)


def _fed(spec: str, xi, data, rounds: int = 2, executor: str = "sequential") -> Federation:
    cfg = FederationConfig(rounds=rounds, participation=0.5, local=LocalConfig(batch_size=4), seed=0,
                           executor=executor)
    return Federation(parse_method(spec), data, xi, cfg)


@pytest.mark.parametrize("executor", ["sequential", "batched"])
def test_local_compact_lowers_its_loss_and_leaves_the_global_model(xi, executor) -> None:
    data = RandomClients(4)
    fed = _fed("local-compact:lr=0.1,epochs=5", xi, data, rounds=3, executor=executor)
    start = {k: v.clone() for k, v in fed.global_weights.items()}
    fed.run()
    assert fed.round == 1 and fed.history[0].participants == 4          # one pass, every client
    m = fed.history[0].metrics
    assert m["loss_last"] < m["loss_first"]
    for k, v in fed.global_weights.items():                              # no federation: ξ unchanged
        assert torch.allclose(v, start[k], atol=1e-6), k
    moved = max(float((fed.private_weights(0)["personal"][k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-4


def test_norm_adapt_zeroes_its_mismatch_and_folds_exactly(xi) -> None:
    data = RandomClients(5)
    m = setup_method("norm-adapt", xi, num_clients=5)
    m.prepare(data)
    assert m.loss_before > 1e-2 and m.loss_after < 1e-6 * max(1.0, m.loss_before)
    # the folded affine computes (e − μ)/s exactly
    net = verifier_net(xi.config.resolved(), with_head=False)
    w = backbone_weights(xi.state_dict())
    mu, sd, n = pooled_embedding_stats(net, w, data, range(5))
    assert n == sum(len(x) for x in data.x)
    folded = fold_standardization(w, mu, sd)
    x = data.train_images(2)
    from torch.func import functional_call
    e = functional_call(net, w, (x,))[0]
    e2 = functional_call(net, folded, (x,))[0]
    assert torch.allclose(e2, (e - mu) / sd, atol=1e-4)
    centred = setup_method("norm-adapt:mode=center", xi, num_clients=5)
    centred.prepare(data)
    assert centred.loss_after < 1e-8 + 1e-6 * centred.loss_before
    with pytest.raises(InputError, match="mode"):
        parse_method("norm-adapt:mode=whiten")


def test_oracle_lowers_its_supervised_loss(xi) -> None:
    data = RandomClients(4)
    m = setup_method("oracle:epochs=4,lr=0.005,batch_size=8", xi, num_clients=4)
    m.prepare(data)
    assert len(m.losses) == 4 and m.losses[-1] < m.losses[0]
    assert any(not torch.equal(v, xi.state_dict()[k]) for k, v in m.init_global().items())


def test_head_template_verifier_is_the_projection(xi) -> None:
    m = setup_method("fedfs+feduv:score=head-template,verify=personal", xi)
    g = m.init_global()
    spec = m.verifier(m.client_state_init(0), g, m.init_private(g))
    assert spec.codeword is None and spec.mode == "template"
    spec.net.load_state_dict(spec.weights)
    x = RandomClients(1).train_images(0)
    (emb,) = spec.net(x)
    e = spec.net.backbone(x)
    assert torch.allclose(emb, e @ g["uv_head.weight"].t(), atol=1e-5)
    with pytest.raises(InputError, match="FedUV head"):
        parse_method("fedfs:score=head-template")
    assert parse_method("feduv:lr=0.2,epochs=3").default_lr() == 0.2


def _args(**kw) -> ExperimentConfig:
    """The resolved config of a small ``fedfs simulate`` command line with ``kw`` as options."""
    p = argparse.ArgumentParser()
    cli_simulate.add_arguments(p)
    a = p.parse_args(["--clients", "3", "--new-users", "1", "--public", "4", "--train-per-client", "4",
                      "--test-per-client", "2", "--public-images", "4"])
    for k, v in kw.items():
        setattr(a, k, v)
    return experiment_from_args(a)


def test_cross_domain_scenario_data_is_deterministic_and_shifted() -> None:
    a = _args(scenario="cross-domain")
    ds, splits = build_data(a)
    assert a.data.domain == "phone" and a.data.pretrain_domain == "studio"
    src, src_splits = build_pretrain_data(a, ds, splits)
    assert src_splits is splits and src is not ds           # same identities, another look
    u = splits.public[0]
    x_src = src.images(u.identity, u.train)
    x_tgt = ds.images(u.identity, u.train)
    assert x_src.shape == x_tgt.shape and float((x_src - x_tgt).abs().mean()) > 0.05
    ds2, splits2 = build_data(_args(scenario="cross-domain"))
    c = splits.clients[1]
    assert splits2.to_json() == splits.to_json()
    assert torch.equal(ds2.images(c.identity, c.train), ds.images(c.identity, c.train))
    ds3, splits3 = build_data(_args(scenario="cross-domain", split_seed=1))
    assert splits3.to_json() != splits.to_json()


def test_in_domain_scenario_pretrains_on_the_clients_data_and_folder_scenarios_need_paths() -> None:
    a = _args(scenario="in-domain")
    ds, splits = build_data(a)
    assert build_pretrain_data(a, ds, splits) == (ds, splits)
    with pytest.raises(InputError, match="--data PATH"):
        build_data(_args(scenario="synth-to-folder"))
    with pytest.raises(InputError, match="--pretrain-data PATH"):
        build_data(_args(scenario="folder-to-folder", data="/nonexistent"))


def test_synth_xi_for_folder_clients_uses_synth_public_identities(tmp_path) -> None:
    from device_sim.synthfaces import SynthFaces, write_image_folder
    root = write_image_folder(SynthFaces(seed=5, image_size=32), tmp_path / "f", range(4), 6)
    a = _args(scenario="synth-to-folder", data=str(root), clients=0, new_users=0, train_per_client=0,
              pretrain_public=7)
    ds, splits = build_data(a)
    assert len(splits.public) == 0 and splits.num_clients == 4
    src, src_splits = build_pretrain_data(a, ds, splits)
    assert len(src_splits.public) == 7 and "studio" in repr(src)
    assert math.isfinite(float(src.images(src_splits.public[0].identity, src_splits.public[0].train).mean()))
    assert np.all([u.train.size == a.data.public_images for u in src_splits.public])


TINY = ["--clients", "4", "--new-users", "2", "--public", "6", "--train-per-client", "10", "--test-per-client", "3",
        "--public-images", "6", "--width", "4", "--embedding-dim", "16", "--pretrain-epochs", "1",
        "--pretrain-batch-size", "12", "--quiet"]


def test_cli_cross_domain_table_has_references_deltas_and_headroom(tmp_path, capsys) -> None:
    import json

    from fedfs_sdk.cli.main import main
    out = tmp_path / "run"
    assert main(["simulate", "--scenario", "cross-domain", "--method", "pretrained", "local-compact:epochs=1",
                 "norm-adapt", "oracle:epochs=1", "feduv:score=head-template", "--rounds", "1",
                 "--cache-dir", str(tmp_path / "c"), "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert "headroom (oracle − ξ)" in printed and "pairwise AUROC" in printed
    res = json.loads((out / "results.json").read_text())
    labels = [m["label"] for m in res["methods"]]
    assert labels[:3] == ["pretrained", "local-compact", "norm-adapt (standardize)"]
    assert res["settings"]["domain"] == "phone" and res["settings"]["pretrain_domain"] == "studio"
    assert all("template_auroc" in m["delta"] for m in res["methods"][1:])
    assert res["headroom"] is not None and set(res["headroom"]) == {"template_auroc", "pairwise_auroc"}


def test_cli_seeds_combines_runs(tmp_path, capsys) -> None:
    import json

    from fedfs_sdk.cli.main import main
    out = tmp_path / "seeds"
    assert main(["simulate", "--method", "pretrained", "norm-adapt", "--seeds", "2", "--rounds", "0",
                 "--cache-dir", str(tmp_path / "c"), "--out", str(out), *TINY]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["seeds"] == [0, 1] and (out / "seed_1" / "results.json").is_file()
    row = next(r for r in res["methods"] if r["method"] == "norm-adapt")
    assert row["n_seeds"] == 2 and len(row["delta"]["template_auroc"]["values"]) == 2
    assert "seeds" in capsys.readouterr().out


def test_simulated_base_vectors_are_unique_and_codewords_uncorrelated(xi) -> None:
    """b_u = client index made 25 of 127 codeword positions equal for every client (mean
    pairwise cosine 0.20); the simulator now draws b_u like the server: random, unique."""
    from device_sim.methods.sdk_methods import base_vector
    b = [base_vector(0, c) for c in range(50000)]
    assert len(set(b)) == len(b) and max(b) < 1 << 32 and base_vector(1, 7) != base_vector(0, 7)
    m = setup_method("feduv", xi, num_clients=100)
    v = np.stack([m.codeword(c) for c in range(100)]).astype(np.float64)
    cos = v @ v.T / v.shape[1]
    assert abs(cos[~np.eye(100, dtype=bool)].mean()) < 0.02
    assert int((np.abs(v.mean(0)) == 1).sum()) == 0          # no position shared by every client


def test_presets_paper_and_default_and_explicit_overrides() -> None:
    from device_sim.methods.sdk_methods import PRESETS
    paper = parse_method("fedfs:paper")
    assert paper.preset == "paper" and paper.label == "fedfs (paper)" and paper.default_lr() == 5e-3
    assert paper.fedfs_loss.soft_score == "dot"                     # Eq. 5 as printed
    assert parse_method("fedfs+feduv:paper").score == "codeword"
    assert parse_method("fedfs+feduv:paper,lr=0.3").default_lr() == 0.3     # explicit beats the preset
    assert parse_method("fedfs+feduv:preset=paper").preset == "paper"
    for name, presets in PRESETS.items():
        assert set(presets) >= {"paper", "default"}
        parse_method(f"{name}:paper"), parse_method(name)
    with pytest.raises(InputError, match="unknown preset"):
        parse_method("fedfs:bogus")
    with pytest.raises(InputError, match="key=value"):
        parse_method("oracle:paper")            # a bare word is a preset only where presets exist


def test_verify_both_concatenates_personal_and_global_head_embeddings(xi) -> None:
    m = setup_method("fedfs+feduv:score=head-template,verify=both", xi)
    g = m.init_global()
    torch.manual_seed(3)
    personal = {k: v + 0.05 * torch.randn_like(v) for k, v in m.init_private(g)["personal"].items()}
    spec = m.verifier(m.client_state_init(0), g, {"personal": personal})
    spec.net.load_state_dict(spec.weights)
    x = RandomClients(1).train_images(0)
    (emb,) = spec.net(x)
    w = g["uv_head.weight"]
    unit = lambda t: t / t.norm(dim=1, keepdim=True)  # noqa: E731
    q = spec.net.backbone(x) @ w.t()
    r = spec.net.global_backbone(x) @ w.t()
    assert torch.allclose(emb, torch.cat([unit(q), unit(r)], 1), atol=1e-5)
    assert not torch.allclose(q, r, atol=1e-3)                    # the two halves are different models
    with pytest.raises(InputError, match="score=head-template"):
        parse_method("fedfs+feduv:verify=both,score=codeword")


def test_warmup_per_client_draws_fresh_warmup_images(tmp_path) -> None:
    """--warmup-per-client: the warm-up scores images the client never trained on."""
    import json

    from fedfs_sdk.cli.main import main
    a = _args(warmup_per_client=10)
    ds, splits = build_data(a)
    c = splits.clients[0]
    assert c.warmup.size == 10 and not set(c.warmup) & (set(c.train) | set(c.test))
    out = tmp_path / "w"
    assert main(["simulate", "--method", "pretrained", "--rounds", "0", "--warmup-per-client", "10",
                 "--cache-dir", str(tmp_path / "c"), "--out", str(out), *TINY]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["warmup_per_client"] == 10 and res["methods"][0]["eval"]["warmup"]["tpr"]["n"] == 4
