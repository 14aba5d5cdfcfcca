"""Evaluation: per-client verifiers, consistency with the SDK's enrollment, vmap == loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest_sim import xi  # noqa: F401
from device_sim.datasets import SynthDataset
from device_sim import metrics
from device_sim.evaluate import EvalConfig, _Scorer, embed, embed_stacked, evaluate
from device_sim.executors import LocalConfig
from device_sim.federation import Federation, FederationConfig
from device_sim.methods import parse_method
from device_sim.population import Population
from device_sim.splits import make_splits
from device_sim.synthfaces import SynthFaces
from fedfs_sdk.runtime.enrollment import enroll
from fedfs_sdk.runtime.inference import TorchBackend


@pytest.fixture(scope="module")
def pop() -> Population:
    ds = SynthDataset(SynthFaces(seed=0, image_size=32), images_per_identity=14, num_identities=12)
    return Population(ds, make_splits(ds, num_public=0, num_clients=5, num_new=2, train_per_client=10,
                                      test_per_client=4, seed=0))


@pytest.fixture(scope="module")
def trained(xi, pop) -> Federation:
    f = Federation(parse_method("fedfs+feduv"), pop, xi,
                   FederationConfig(rounds=1, participation=0.6, local=LocalConfig(batch_size=5)))
    f.run()
    return f


def test_result_shape_and_ranges(trained, pop) -> None:
    r = evaluate(trained.method, trained.global_weights, trained.private_weights, pop, EvalConfig(batch_size=64))
    assert r["clients_evaluated"] == 5 and r["impostor_pool"] == 20 and r["new_user_images"] == 28
    v = r["verification"]
    assert v["auroc"]["n"] == 5 and 0 <= v["auroc"]["mean"] <= 1 and len(v["per_client_auroc"]) == 5
    assert set(v["tar_at_far"]) == {"0.1", "0.01", "0.001"}
    assert set(r["identification"]["tpir_at_fpir"]) == {"0.1", "0.01", "0.001"}
    assert all(len(v) == 5 for v in r["identification"]["per_client"].values())
    ic = r["identification_clients"]
    assert set(ic["tpir_at_fpir"]) == {"0.1", "0.01", "0.001"} and ic["tpir_at_fpir"]["0.1"]["n"] == 5
    assert all(len(v) == 5 for v in ic["per_client"].values())
    assert r["clients"] == [0, 1, 2, 3, 4] and 0 <= r["pairwise"]["auroc"]["mean"] <= 1
    assert 0 <= r["warmup"]["tpr"]["mean"] <= 1 and "fpr_new_users" in r["warmup"]
    assert r["new_users"]["users"] == 2 and r["new_users"]["n_insufficient"] == 0
    assert len(r["roc"]["fpr"]) == len(r["roc"]["tpr"])


@pytest.mark.parametrize("spec", ["fedfs", "fedfs+feduv"])
def test_warmup_threshold_matches_sdk_enrollment(spec: str, xi, pop) -> None:
    """The simulator's warm-up is the SDK's enroll() on the same images and model."""
    f = Federation(parse_method(spec), pop, xi, FederationConfig(rounds=1, participation=1.0,
                                                                  local=LocalConfig(batch_size=5)))
    f.run()
    r = evaluate(f.method, f.global_weights, f.private_weights, pop, EvalConfig(batch_size=64))
    assert r["warmup"]["tpr"]["n"] == 5
    c = 2
    spec_c = f.method.verifier(f.client_state(c), f.global_weights, f.private_weights(c))
    spec_c.net.load_state_dict(spec_c.weights)
    # The simulator's warm-up applies no outlier rule (a client's enrollment images are its
    # own by construction), so it equals enroll() with the rule off.
    e = enroll(TorchBackend(spec_c.net, "m"), pop.train_images(c).numpy(), q=0.9, codeword=spec_c.codeword,
               outliers="none")
    # this client's warm-up scores as evaluate() computes them give the SDK's threshold
    s = _Scorer(spec_c, embed(spec_c, pop.train_images(c), torch.device("cpu")))
    # enroll() lowers τ by WARMUP_TOLERANCE (1e-6) so the image at τ is accepted alone
    assert metrics.warmup_outcome(s.warmup, [1.0], [0.0]).threshold == pytest.approx(e.threshold, abs=1e-5)


def test_vmap_embedding_equals_loop(trained, pop) -> None:
    specs = [trained.method.verifier(trained.client_state(c), trained.global_weights, trained.private_weights(c))
             for c in range(3)]
    x = pop.test_images(0)
    stacked = embed_stacked(specs, x, torch.device("cpu"))
    for s, got in zip(specs, stacked):
        ref = embed(s, x, torch.device("cpu"))
        assert all(torch.allclose(ref[k], got[k], atol=1e-5) for k in ref)
    a = evaluate(trained.method, trained.global_weights, trained.private_weights, pop, EvalConfig(batched=True))
    b = evaluate(trained.method, trained.global_weights, trained.private_weights, pop, EvalConfig(batched=False))
    assert np.allclose(a["verification"]["per_client_auroc"], b["verification"]["per_client_auroc"])
    assert np.allclose(a["pairwise"]["per_client_auroc"], b["pairwise"]["per_client_auroc"])


def _recording_scorer(monkeypatch) -> list[dict]:
    """Replace evaluate's _Scorer with one that records how many images each role scores."""
    import device_sim.evaluate as ev

    calls: list[dict] = []

    class Recording(ev._Scorer):
        def __init__(self, spec, warm, fresh=None) -> None:
            super().__init__(spec, warm, fresh)
            calls.append({"enroll": len(warm["embedding"]), "fresh": None if fresh is None else len(fresh["embedding"]),
                          "warmup": len(self.warmup), "scored": [], "scores": []})

        def __call__(self, feats):
            out = super().__call__(feats)
            if calls:
                calls[-1]["scored"].append(len(out))
                calls[-1]["scores"].append(out)
            return out

    monkeypatch.setattr(ev, "_Scorer", Recording)
    return calls


def test_each_role_scores_the_right_images(trained, pop, monkeypatch) -> None:
    """Per client: enrolled on its 10 train images, genuine = its 4 test images, impostors =
    the 4 test images of each of the 4 other clients (never its own: the whole 20-image pool
    is scored once and the client's own 4 dropped), non-mated = the 2 new users' 14 images
    each; the warm-up scores the train images (leave-one-out). The template AUROC and both
    TPIR variants come from exactly these scores."""
    import device_sim.evaluate as ev

    calls = _recording_scorer(monkeypatch)
    cfg = EvalConfig(batch_size=64)
    r = evaluate(trained.method, trained.global_weights, trained.private_weights, pop, cfg)
    owner = ev._probes(pop, np.arange(5), cfg).pool_owner
    participants = calls[:5]                              # then one scorer per new user
    for c, rec in enumerate(participants):
        assert rec["enroll"] == 10 and rec["fresh"] is None and rec["warmup"] == 10
        assert rec["scored"][:3] == [4, 20, 28]           # genuine, the pool, non-mated
        genuine, pool, new = rec["scores"][:3]
        impostor = pool[owner != c]
        assert impostor.size == 16
        assert r["verification"]["per_client_auroc"][c] == pytest.approx(metrics.auroc(genuine, impostor))
        for f in (0.1, 0.01):
            assert r["identification_clients"]["per_client"][f"{f:g}"][c] == metrics.tpir_at_fpir(genuine, impostor, (f,))[f]
            assert r["identification"]["per_client"][f"{f:g}"][c] == metrics.tpir_at_fpir(genuine, new, (f,))[f]


@pytest.mark.parametrize("spec", ["fedfs+feduv", "fedfs"])
def test_pairwise_auroc_uses_the_clients_embeddings(spec: str, xi, pop, trained) -> None:
    """Pairwise 1:1 AUROC of client c = own test pairs vs own test × other clients' pool
    images, cosine of c's verifier's embedding output (codeword mode included)."""
    import device_sim.evaluate as ev

    if spec == "fedfs+feduv":
        f = trained
    else:
        f = Federation(parse_method(spec), pop, xi, FederationConfig(rounds=1, participation=0.6,
                                                                      local=LocalConfig(batch_size=5)))
        f.run()
    cfg = EvalConfig(batch_size=64)
    r = evaluate(f.method, f.global_weights, f.private_weights, pop, cfg)
    assert r["clients"] == [0, 1, 2, 3, 4]
    assert r["pairwise"]["auroc"]["n"] == 5 and len(r["pairwise"]["per_client_auroc"]) == 5
    probes = ev._probes(pop, np.arange(5), cfg)
    for c in (0, 3):
        s = f.method.verifier(f.client_state(c), f.global_weights, f.private_weights(c))
        own = embed(s, pop.test_images(c), torch.device("cpu"))["embedding"].numpy()
        pool = embed(s, probes.pool, torch.device("cpu"))["embedding"].numpy()[probes.pool_owner != c]
        g, i = metrics.pairwise_scores(own, pool)
        assert g.size == 6 and i.size == 4 * 16
        assert r["pairwise"]["per_client_auroc"][c] == pytest.approx(metrics.auroc(g, i), abs=1e-6)


def test_fresh_warmup_images_set_the_threshold(xi, monkeypatch) -> None:
    """A split with warm-up images: τ comes from those fresh captures, not the training images."""
    ds = SynthDataset(SynthFaces(seed=0, image_size=32), images_per_identity=17, num_identities=8)
    pop = Population(ds, make_splits(ds, num_public=0, num_clients=4, num_new=1, train_per_client=10,
                                     test_per_client=4, warmup_per_user=3, seed=0))
    assert pop.warmup_images(0).shape[0] == 3
    f = Federation(parse_method("feduv"), pop, xi, FederationConfig(rounds=1, participation=1.0,
                                                                     local=LocalConfig(batch_size=5)))
    f.run()
    calls = _recording_scorer(monkeypatch)
    evaluate(f.method, f.global_weights, f.private_weights, pop, EvalConfig(batch_size=64, q=0.5))
    assert all(rec["fresh"] == 3 and rec["warmup"] == 3 for rec in calls[:4])
