"""ξ's trunk features kept on a device (fedfs_sdk/federation/device_features.py): the embeddings they
give are the full forward's, bit for bit; a changed photo or ξ is computed again; each device keeps
its own."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedfs_sdk.federation.device_features import (CACHE_ATTR, embeddings_on_xi_trunk, has_xi_trunk,
                                                  xi_trunk_features)
from fedfs_sdk.federation.device_stats import _embed_xi
from fedfs_sdk.nn.model import FaceNet, ModelConfig, VerifierNet
from fedfs_sdk.runtime.inference import TorchBackend
from fedfs_sdk.stats.in_domain import norm_adapt_weights


def _xi(backbone: str, seed: int = 0):
    torch.manual_seed(seed)
    return FaceNet(ModelConfig(backbone)).eval()


def _photos(net, n: int, seed: int = 0) -> np.ndarray:
    s = int(net.backbone.input_size)
    return np.random.default_rng(seed).uniform(-1, 1, (n, 3, s, s)).astype(np.float32)


@pytest.mark.parametrize("backbone", ["tiny", "mobilefacenet-affine"])
def test_embeddings_from_cached_trunk_features_are_the_full_forwards(backbone):
    xi = _xi(backbone)
    x, agent = _photos(xi, 2), SimpleNamespace()
    e, f = _embed_xi(xi, x, True, agent=agent, xi_sha="a")
    e_plain, f_plain = _embed_xi(xi, x, True)
    with torch.inference_mode():
        full = xi.backbone(torch.from_numpy(x)).double().numpy()
    assert np.array_equal(e, full) and np.array_equal(e, e_plain) and np.array_equal(f, f_plain)
    # the xi candidate and norm-adapt ξ (its embed_norm refitted): the backend's outputs, bit for bit
    weights = xi.backbone.state_dict()
    dim = int(xi.backbone.embedding_dim)
    moments = np.concatenate([[10.0], np.full(dim, 0.3), np.full(dim, 2.0)])
    for w in ([None] + ([norm_adapt_weights(weights, moments)] if backbone != "tiny" else [])):
        net = VerifierNet(xi.backbone if w is None else copy.deepcopy(xi.backbone)).eval()
        if w is not None:
            net.backbone.load_state_dict(w)
        assert has_xi_trunk(net, xi.backbone)
        want = TorchBackend(net, "m").run(x)["embedding"]
        assert np.array_equal(embeddings_on_xi_trunk(agent, net, "a", xi, x, 256), want)
    assert len(getattr(agent, CACHE_ATTR)) == 1          # the moments' trunk pass served every check


def test_a_trunk_off_by_rounding_is_not_xis():
    xi = _xi("tiny")
    net = VerifierNet(FaceNet(ModelConfig("tiny")).backbone).eval()
    net.backbone.load_state_dict(xi.backbone.state_dict())
    with torch.no_grad():
        trunk_param = next(p for k, p in net.backbone.named_parameters() if not k.startswith(("embed.", "embed_norm.")))
        trunk_param.view(-1)[0] += 4e-9 if trunk_param.view(-1)[0] != 0 else 1e-6
    assert not has_xi_trunk(net, xi.backbone)


def test_changed_photo_or_xi_is_computed_again_and_devices_keep_their_own():
    xi, other = _xi("tiny", 0), _xi("tiny", 1)
    x = _photos(xi, 4)
    a, b = SimpleNamespace(), SimpleNamespace()
    first = xi_trunk_features(a, "xi-1", xi, x, 64)
    assert xi_trunk_features(a, "xi-1", xi, x.copy(), 64) is first          # same content: kept
    y = x.copy()
    y[2, 0, 0, 0] += 0.5                                                     # one pixel of one photo
    changed = xi_trunk_features(a, "xi-1", xi, y, 64)
    assert not torch.equal(changed[0][2], first[0][2]) and torch.equal(changed[0][0], first[0][0])
    new_xi = xi_trunk_features(a, "xi-2", other, x, 64)                      # another ξ
    assert not torch.equal(new_xi[0], first[0])
    assert len(getattr(a, CACHE_ATTR)) == 3
    assert not hasattr(b, CACHE_ATTR)                                        # device b never saw a's
    assert xi_trunk_features(b, "xi-1", xi, x, 64) is not first
