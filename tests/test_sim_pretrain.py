"""Pre-training ξ: margin heads, loss goes down, cache keyed by config and data."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from device_sim.datasets import SynthDataset
from device_sim.pretrain import MarginHead, PretrainConfig, cache_key, data_key, load_xi, pretrain_cached
from device_sim.synthfaces import SynthFaces
from fedfs_sdk.nn.checkpoint import read_checkpoint
from fedfs_sdk.errors import InputError

CFG = PretrainConfig(width=4, embedding_dim=16, epochs=3, batch_size=16)


def test_margin_heads() -> None:
    torch.manual_seed(0)
    emb, y = torch.randn(5, 8), torch.tensor([0, 1, 2, 0, 1])
    cos_head = MarginHead(8, 3, "cosface", scale=10.0, margin=0.3)
    cos = cos_head.cosine(emb)
    logits = cos_head(emb, y)
    onehot = torch.nn.functional.one_hot(y, 3).bool()
    assert torch.allclose(logits[onehot], 10 * (cos[onehot] - 0.3))                     # s(cos θ_y − m)
    assert torch.allclose(logits[~onehot], 10 * cos[~onehot])
    arc = MarginHead(8, 3, "arcface", scale=10.0, margin=0.5)
    arc.weight.data.copy_(cos_head.weight.data)
    c = cos[onehot].clamp(-1, 1)
    expect = torch.where(c > math.cos(math.pi - 0.5), torch.cos(torch.acos(c) + 0.5), c - math.sin(math.pi - 0.5) * 0.5)
    assert torch.allclose(arc(emb, y)[onehot], 10 * expect, atol=1e-5)                  # cos(θ + m) without acos


def test_pretrain_learns_and_is_cached(tmp_path) -> None:
    ds = SynthDataset(SynthFaces(seed=0, image_size=32), images_per_identity=8, num_identities=6)
    ids = np.repeat(np.arange(6), 8)
    idx = np.tile(np.arange(8), 6)
    losses: list[float] = []
    res = pretrain_cached(ds, ids, idx, ids, CFG, cache_dir=tmp_path, out=tmp_path / "xi.safetensors",
                          progress=lambda s, t, m: losses.append(m["loss"]))
    assert not res.cached and len(losses) == 9 and losses[-1] < losses[0]
    again = pretrain_cached(ds, ids, idx, ids, CFG, cache_dir=tmp_path)
    assert again.cached
    # the cached model is the trained one read back from safetensors: a bit-exact copy
    assert all(torch.equal(a, b) for a, b in zip(res.model.state_dict().values(), again.model.state_dict().values()))
    _, _, meta = read_checkpoint(tmp_path / "xi.safetensors")
    assert meta["public_identities"] == list(range(6))
    assert meta["public_identity_names"] == [f"synthfaces-0/{i}" for i in range(6)] == ds.identity_names(range(6))
    xi = load_xi(tmp_path / "xi.safetensors")
    assert xi.config.proj_dim is None and xi.input_size == 32 and not any(p.requires_grad for p in xi.parameters())
    # another config or other images → another key
    assert cache_key(CFG, data_key(ds, ids, idx)) != cache_key(PretrainConfig(width=4, epochs=4), data_key(ds, ids, idx))
    assert data_key(ds, ids, idx) != data_key(ds, ids[::-1], idx)


def test_bad_config() -> None:
    with pytest.raises(InputError, match="loss"):
        PretrainConfig(loss="sphereface")
    with pytest.raises(InputError, match="optimizer"):
        PretrainConfig(optimizer="lbfgs")
