"""Local trainer: one step lowers the loss, determinism, what leaves the device, bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfs_sdk.runtime.codes import make_codeword
from fedfs_sdk.errors import FedFSError, InputError, TrainingError
from fedfs_sdk.nn.model import FaceNet, ModelConfig
from fedfs_sdk.training.objective import ObjectiveConfig, local_objective
from fedfs_sdk.training.trainer import LocalTrainer, TrainConfig, initial_global_weights

XI = None


def _xi() -> FaceNet:
    torch.manual_seed(123)
    return FaceNet(ModelConfig("tiny")).eval()


def _setup(method: str):
    xi = _xi()
    mc = ModelConfig("tiny", proj_dim=32 if method != "feduv" else None,
                     code_length=127 if method != "fedfs" else None)
    w = initial_global_weights(mc, xi if method != "feduv" else None)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 3, 32, 32, generator=g)
    x = (base + 0.3 * torch.randn(16, 3, 32, 32, generator=g)).clamp(-1, 1)
    v, _ = make_codeword(9, 127, rng=np.random.default_rng(0))
    return xi, mc, w, x, v


@pytest.mark.parametrize("method", ["fedfs", "feduv", "fedfs+feduv"])
def test_one_local_step_lowers_objective_on_fixed_batch(method: str) -> None:
    xi, mc, w, x, v = _setup(method)
    cfg = TrainConfig(method=method, local_epochs=1, batch_size=16)   # the papers' learning rates
    trainer = LocalTrainer(mc, cfg, xi=xi if method != "feduv" else None)

    def objective(weights, personal):
        trainer._load(trainer.global_model, weights, "global")
        if trainer.personal_model is not None:
            trainer._load(trainer.personal_model, personal, "personal")
        with torch.no_grad():
            loss, _ = local_objective(method, ObjectiveConfig(), x, trainer.global_model,
                                      personal_model=trainer.personal_model, xi=trainer.xi,
                                      codeword=torch.tensor(v, dtype=torch.float32))
        return loss.item()

    personal0 = {k: t for k, t in w.items() if not k.startswith("uv_head.")}
    before = objective(w, personal0)
    res = trainer.train(w, x, codeword=v)         # one step: one epoch of one full batch
    after = objective(res.weights, res.personal_weights)
    assert after < before


def test_training_is_deterministic_with_seed() -> None:
    xi, mc, w, x, v = _setup("fedfs+feduv")
    cfg = TrainConfig(method="fedfs+feduv", batch_size=8, seed=3)
    a = LocalTrainer(mc, cfg, xi=xi).train(w, x, codeword=v)
    b = LocalTrainer(mc, cfg, xi=xi).train(w, x, codeword=v)
    # one code path run twice with one seed in one process (deterministic CPU ops): bit-equal
    for k in a.weights:
        assert torch.equal(a.weights[k], b.weights[k])
    c = LocalTrainer(mc, cfg, xi=xi).train(w, x, codeword=v, seed=4)
    assert any(not torch.equal(a.weights[k], c.weights[k]) for k in a.weights)


def test_upload_holds_global_weights_only_and_xi_is_frozen() -> None:
    xi, mc, w, x, v = _setup("fedfs+feduv")
    xi_before = {k: t.clone() for k, t in xi.state_dict().items()}
    res = LocalTrainer(mc, TrainConfig(method="fedfs+feduv", batch_size=8), xi=xi).train(w, x, codeword=v)
    assert set(res.weights) == set(w)                       # w_c: same keys as the server's model
    assert res.num_samples == 16
    assert res.personal_weights is not None and not any(k.startswith("uv_head") for k in res.personal_weights)
    # θ_c differs from w_c after training: they are two models
    assert any(not torch.equal(res.weights[k], res.personal_weights[k]) for k in res.personal_weights)
    for k, t in xi.state_dict().items():
        assert torch.equal(t, xi_before[k])


def test_paper_defaults() -> None:
    assert TrainConfig(method="fedfs").effective_lr == 5e-3
    assert TrainConfig(method="fedfs").effective_epochs == 2
    assert TrainConfig(method="feduv").effective_lr == 0.1
    assert ObjectiveConfig().fedfs.lam == 0.7 and ObjectiveConfig().fedfs.top_k == 4
    assert ObjectiveConfig().fedfs.gamma == 2.0


@pytest.mark.parametrize("bad,match", [
    (torch.randn(4, 3, 28, 28), r"shape \[N, 3, 32, 32\]"),
    (torch.randn(4, 1, 32, 32), r"shape \[N, 3, 32, 32\]"),
    (torch.randn(4, 3, 32, 32).double(), "float32"),
    (torch.zeros(0, 3, 32, 32), "no images"),
    (torch.full((2, 3, 32, 32), float("nan")), "NaN"),
    ("not a tensor", "tensor or ndarray"),
])
def test_bad_images(bad, match: str) -> None:
    _, mc, w, _, v = _setup("feduv")
    t = LocalTrainer(mc, TrainConfig(method="feduv"))
    with pytest.raises(InputError, match=match):
        t.train(w, bad, codeword=v)


def test_bad_weights_and_codeword() -> None:
    _, mc, w, x, v = _setup("feduv")
    t = LocalTrainer(mc, TrainConfig(method="feduv"))
    with pytest.raises(InputError, match="missing"):
        t.train({k: t_ for k, t_ in w.items() if k != "uv_head.weight"}, x, codeword=v)
    wrong = dict(w)
    wrong["uv_head.weight"] = torch.zeros(255, 64)
    with pytest.raises(InputError, match="uv_head.weight has shape"):
        t.train(wrong, x, codeword=v)
    with pytest.raises(InputError, match="codeword must have shape"):
        t.train(w, x, codeword=v[:100])
    with pytest.raises(InputError, match="needs the device's codeword"):
        t.train(w, x)
    with pytest.raises(InputError, match="unknown method"):
        TrainConfig(method="fedprox")
    with pytest.raises(InputError, match="needs ξ"):
        LocalTrainer(ModelConfig("tiny", proj_dim=32), TrainConfig(method="fedfs"))


@pytest.mark.parametrize("method", ["fedfs", "fedfs+feduv"])
def test_fedfs_with_one_image_is_an_error_not_a_silent_no_op(method: str) -> None:
    xi, mc, w, x, v = _setup(method)
    t = LocalTrainer(mc, TrainConfig(method=method, batch_size=4, local_epochs=1), xi=xi)
    with pytest.raises(InputError, match="FedFS needs at least 2 images per batch/device.*got 1"):
        t.train(w, x[:1], codeword=v)
    res = t.train(w, x[:5], codeword=v)            # 4 + a lone leftover image: trains, skips the leftover
    assert res.num_samples == 5 and any(not torch.equal(res.weights[k], w[k]) for k in w)
    _, mcu, wu, _, _ = _setup("feduv")
    res = LocalTrainer(mcu, TrainConfig(method="feduv", local_epochs=1)).train(wu, x[:1], codeword=v)
    assert any(not torch.equal(res.weights[k], wu[k]) for k in wu)        # FedUV alone: 1 image is fine


@pytest.mark.parametrize("kwargs,match", [
    ({"local_epochs": 0}, "local_epochs must be an integer ≥ 1"),
    ({"local_epochs": 1.5}, "local_epochs must be an integer"),
    ({"local_epochs": True}, "local_epochs must be an integer"),
    ({"batch_size": 0}, "batch_size must be an integer ≥ 1"),
    ({"batch_size": 2.0}, "batch_size must be an integer"),
    ({"method": "fedfs", "batch_size": 1}, "batches of ≥ 2 images"),
    ({"lr": 0.0}, "lr must be a finite number > 0"),
    ({"lr": -1e-3}, "lr must be a finite number > 0"),
    ({"lr": float("nan")}, "lr must be a finite number > 0"),
    ({"lr": float("inf")}, "lr must be a finite number > 0"),
    ({"lr": "0.1"}, "lr must be a finite number > 0"),
    ({"head_lr": float("inf")}, "head_lr must be a finite number > 0"),
    ({"momentum": -0.1}, r"momentum must be a number in \[0, 1\)"),
    ({"momentum": 1.0}, r"momentum must be a number in \[0, 1\)"),
    ({"momentum": float("nan")}, "momentum"),
    ({"weight_decay": -1.0}, "weight_decay must be a finite number ≥ 0"),
    ({"weight_decay": float("inf")}, "weight_decay"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"objective": {"lambda_neg": 1}}, "objective must be an ObjectiveConfig"),
])
def test_train_config_is_validated(kwargs: dict, match: str) -> None:
    with pytest.raises(InputError, match=match):
        TrainConfig(**{"method": "feduv", **kwargs})


def test_objective_settings_are_validated() -> None:
    from fedfs_sdk.training.losses.fedfs import FedFSLossConfig

    for bad, match in (({"uv_weight": -1.0}, "uv_weight must be a finite number ≥ 0"),
                       ({"uv_weight": float("nan")}, "uv_weight must be finite"),
                       ({"lambda_neg": float("inf")}, "lambda_neg must be finite"),
                       ({"fedfs": {"top_k": 4}}, "fedfs must be a FedFSLossConfig")):
        with pytest.raises(InputError, match=match):
            ObjectiveConfig(**bad)
    for bad, match in (({"top_k": 4.5}, "whole number"), ({"top_k": float("inf")}, "top_k must be finite"),
                       ({"top_k": 0}, "top_k must be > 0"), ({"gamma": float("nan")}, "gamma must be finite"),
                       ({"logit_scale": 0.0}, "logit_scale must be > 0")):
        with pytest.raises(InputError, match=match):
            FedFSLossConfig(**bad)


@pytest.mark.parametrize("neg,match", [
    (np.ones((3, 255)), r"neg_codewords must have shape \[m, 127\] with m ≥ 1, got \[3, 255\]"),
    (np.zeros((0, 127)), r"got \[0, 127\]"),
    (np.ones(127), r"got \[127\]"),
    (np.zeros((2, 127)), "entries must be ±1"),
    (np.full((2, 127), np.nan), "NaN or Inf"),
    ([["a"] * 127], "numeric"),
])
def test_neg_codewords_are_validated(neg, match: str) -> None:
    _, mc, w, x, v = _setup("feduv")
    t = LocalTrainer(mc, TrainConfig(method="feduv", objective=ObjectiveConfig(lambda_neg=1.0)))
    with pytest.raises(InputError, match=match):
        t.train(w, x, codeword=v, neg_codewords=neg)
    good = np.stack([make_codeword(b, 127, rng=np.random.default_rng(b))[0] for b in (1, 2)])
    assert t.train(w, x, codeword=v, neg_codewords=good).metrics["l_neg_first"] <= 1.0


def test_non_finite_weights_and_loss_are_fedfs_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedfs_sdk.training.trainer as trainer_mod

    _, mc, w, x, v = _setup("feduv")
    nan_w = dict(w)
    k0 = next(iter(nan_w))
    nan_w[k0] = nan_w[k0].clone().fill_(float("nan"))
    with pytest.raises(InputError, match=f"global weights: {k0} contains NaN or Inf"):
        LocalTrainer(mc, TrainConfig(method="feduv")).train(nan_w, x, codeword=v)
    # a diverging run: the loss becomes NaN in a later batch (every layer trains: scope="all")
    with pytest.raises(TrainingError, match=r"local loss became nan \(lr=1e\+20 too high\?\)") as ei:
        LocalTrainer(mc, TrainConfig(method="feduv", lr=1e20, head_lr=1e20, batch_size=4, local_epochs=3,
                                     scope="all")).train(w, x, codeword=v)
    assert isinstance(ei.value, FedFSError) and isinstance(ei.value, FloatingPointError)
    # the last step overflows the weights while its loss was still finite
    real = trainer_mod.local_objective

    def scaled(*a, **k):
        loss, parts = real(*a, **k)
        return loss * 1e30, parts

    monkeypatch.setattr(trainer_mod, "local_objective", scaled)
    with pytest.raises(TrainingError, match="made the global weights non-finite"):
        LocalTrainer(mc, TrainConfig(method="feduv", lr=1e20, head_lr=1e20, batch_size=16, local_epochs=1,
                                     scope="all")).train(w, x, codeword=v)


def test_cached_trunk_features_give_the_trunk_pass_updates_and_wrong_ones_are_refused() -> None:
    """scope="top" with ξ's trunk features computed once (what a device keeps across rounds): the same
    global and personalized updates as a trunk pass per step, within float rounding of the trunk's
    batch (rows are per-sample); features of other photos are refused, never trained on."""
    from fedfs_sdk.training.scope import Trunk

    xi, mc, w, x, v = _setup("fedfs+feduv")
    cfg = TrainConfig(method="fedfs+feduv", batch_size=4, local_epochs=2, seed=1, scope="top")
    with torch.no_grad():
        feats = Trunk(xi.backbone)(x)                  # one pass over all 16 photos, not 4 per step
    plain = LocalTrainer(mc, cfg, xi=xi).train(w, x, codeword=v)
    cached = LocalTrainer(mc, cfg, xi=xi).train(w, x, codeword=v, trunk_features=feats)
    moved = 0.0
    for out in ("weights", "personal_weights"):
        a, b = getattr(plain, out), getattr(cached, out)
        for k in a:
            assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), (out, k)
            moved = max(moved, float((a[k] - w[k]).abs().max()) if k in w else 0.0)
    assert moved > 1e-4                                # the top did train: the comparison is not vacuous
    with pytest.raises(InputError, match="not this model's trunk output"):
        LocalTrainer(mc, cfg, xi=xi).train(w, x, codeword=v, trunk_features=feats.flip(0))
    with pytest.raises(InputError, match="one row per image"):
        LocalTrainer(mc, cfg, xi=xi).train(w, x, codeword=v, trunk_features=feats[:3])
    # scope="all" trains the trunk: cached features would be stale, so they are not used (and not checked)
    full = TrainConfig(method="fedfs+feduv", batch_size=4, seed=1, scope="all")
    a = LocalTrainer(mc, full, xi=xi).train(w, x, codeword=v)
    b = LocalTrainer(mc, full, xi=xi).train(w, x, codeword=v, trunk_features=feats.flip(0))
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
