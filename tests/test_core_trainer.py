"""Local trainer: one step lowers the loss, determinism, what leaves the device, bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfs_sdk.codes import make_codeword
from fedfs_sdk.errors import InputError
from fedfs_sdk.model import FaceNet, ModelConfig
from fedfs_sdk.objective import ObjectiveConfig, local_objective
from fedfs_sdk.trainer import LocalTrainer, TrainConfig, initial_global_weights

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
