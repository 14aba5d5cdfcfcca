"""ξ's trunk features of the public impostor set, shared in a process (fedfs_sdk/federation/public_trunk.py):
a verifier on ξ's trunk gets its outputs on the public set from them bit for bit as its full forward
gives them; the features are computed once per (ξ, set)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedfs_sdk.federation.public_trunk import PublicTrunk, outputs_on_trunk
from fedfs_sdk.nn.model import DualVerifierNet, FaceNet, FedUVHead, ModelConfig, VerifierNet
from fedfs_sdk.runtime.impostor_outputs import CHUNK, PublicOutputs, impostor_outputs
from fedfs_sdk.runtime.inference import TorchBackend


def _batch(size: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, 3, size, size)).astype(np.float32)


@pytest.mark.parametrize("backbone", ["tiny", "mobilefacenet-affine"])
def test_public_set_outputs_from_shared_trunk_features_are_the_full_forwards(backbone):
    torch.manual_seed(0)
    xi = FaceNet(ModelConfig(backbone)).eval()
    size = int(xi.backbone.input_size)
    public = _batch(size, CHUNK + 5 if backbone == "tiny" else 9, seed=1)     # more than one chunk for tiny
    personal, glob = copy.deepcopy(xi.backbone), copy.deepcopy(xi.backbone)
    with torch.no_grad():
        personal.embed.weight.add_(0.05 * torch.randn_like(personal.embed.weight))
    head = FedUVHead(int(xi.backbone.embedding_dim), 127)
    store = PublicTrunk()
    feats = store.features("x", xi, "set", lambda: public, CHUNK)
    assert store.features("x", xi, "set", lambda: 1 / 0, CHUNK) is feats      # a second device: nothing computed
    assert store.misses == 1 and len(feats) == -(-public.shape[0] // CHUNK)
    for net in (VerifierNet(personal, head).eval(), DualVerifierNet(personal, glob, head).eval()):
        plain = TorchBackend(net, "m")
        want, got = impostor_outputs(plain, public), outputs_on_trunk(plain, feats)
        assert len(want) == len(got)
        for a, b in zip(want, got):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
            assert not any(v.flags.writeable for v in b.values())           # shared: read-only
        # the process's cache of a public model's outputs takes them as its way to compute an entry
        cache = PublicOutputs()
        cached = cache.get(plain, public, compute=lambda: outputs_on_trunk(plain, feats))
        assert cache.get(plain, public, compute=lambda: 1 / 0) is cached and cache.misses == 1
    # another ξ (or another set) is another entry, computed again
    store.features("another-xi", xi, "set", lambda: public, CHUNK)
    store.features("x", xi, "another-set", lambda: public, CHUNK)
    assert store.misses == 3
