"""ξ's trunk features of the public impostor set, shared in a process (fedfs_sdk/federation/public_trunk.py):
a verifier on ξ's trunk scores the public set from them bit for bit as its full forward does; the
owner's photos never come from (or go into) the store."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedfs_sdk.federation.public_trunk import PublicTrunk, PublicTrunkBackend
from fedfs_sdk.nn.model import DualVerifierNet, FaceNet, FedUVHead, ModelConfig, VerifierNet
from fedfs_sdk.runtime.impostor_outputs import CHUNK, impostor_outputs
from fedfs_sdk.runtime.inference import TorchBackend


def _batch(size: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, 3, size, size)).astype(np.float32)


@pytest.mark.parametrize("backbone", ["tiny", "mobilefacenet-affine"])
def test_public_set_scores_from_shared_trunk_features_are_the_full_forwards(backbone):
    torch.manual_seed(0)
    xi = FaceNet(ModelConfig(backbone)).eval()
    size = int(xi.backbone.input_size)
    public = _batch(size, CHUNK + 5 if backbone == "tiny" else 9, seed=1)     # more than one chunk for tiny
    personal, glob = copy.deepcopy(xi.backbone), copy.deepcopy(xi.backbone)
    with torch.no_grad():
        personal.embed.weight.add_(0.05 * torch.randn_like(personal.embed.weight))
    head = FedUVHead(int(xi.backbone.embedding_dim), 127)
    store = PublicTrunk()
    store.fill("x", xi, "set", lambda: public, CHUNK)
    store.fill("x", xi, "set", lambda: 1 / 0, CHUNK)     # a second device: nothing computed (nor the batch made)
    assert store.fills == 1
    for net in (VerifierNet(personal, head).eval(), DualVerifierNet(personal, glob, head).eval()):
        plain = TorchBackend(net, "m")
        fast = PublicTrunkBackend(plain, "x", store)
        want, got = impostor_outputs(plain, public), impostor_outputs(fast, public)
        assert fast.public_hits == len(got) and len(got) == -(-public.shape[0] // CHUNK)
        for a, b in zip(want, got):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        owner = _batch(size, 3, seed=2)                   # not public: the full forward, no store entry
        hits = fast.public_hits
        assert all(np.array_equal(fast.run(owner)[k], plain.run(owner)[k]) for k in plain.outputs)
        assert fast.public_hits == hits
    # another ξ's features never serve this one
    other = PublicTrunkBackend(TorchBackend(VerifierNet(personal, head).eval(), "m"), "another-xi", store)
    impostor_outputs(other, public)
    assert other.public_hits == 0
