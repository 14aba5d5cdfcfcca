"""ξ's trunk features kept on a device (fedfs_sdk/federation/device_features.py): the embeddings they
give are the full forward's, bit for bit; a changed photo or ξ is computed again; each device keeps
its own."""
from __future__ import annotations

import copy
import json
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


def test_device_rounds_train_on_the_features_kept_for_its_photos(tmp_path):
    """TorchRuntime.train under a scope=top task: ξ's trunk runs once for the device's photos (the
    agent's entry, shared with the statistics round's moments), every later round reuses it, and the
    upload is the trunk-pass trainer's within float rounding."""
    from fedfs_sdk.federation.device_features import STATS_CHUNK
    from fedfs_sdk.federation.device_runtime import TorchRuntime, round_seed
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.wire import decode_update
    from fedfs_sdk.federation.wire_format import sha256_hex
    from fedfs_sdk.nn.checkpoint import read_checkpoint_bytes, save_checkpoint
    from fedfs_sdk.runtime.codes import make_codeword
    from fedfs_sdk.training.trainer import LocalTrainer, TrainConfig, initial_global_weights

    xi = _xi("tiny", seed=2)
    save_checkpoint(tmp_path / "xi.safetensors", xi, ModelConfig("tiny"))
    sha = sha256_hex((tmp_path / "xi.safetensors").read_bytes())
    cfg = ModelConfig("tiny", proj_dim=32, code_length=127)
    glob = FaceNet(cfg)
    w = initial_global_weights(cfg, xi)
    glob.load_state_dict(w)
    save_checkpoint(tmp_path / "global.safetensors", glob, cfg)
    model = read_checkpoint_bytes(tmp_path / "global.safetensors")
    x = _photos(xi, 12, seed=3)
    v, _ = make_codeword(9, 127, rng=np.random.default_rng(0))
    calls = []

    class Agent:
        def __init__(self, state):
            self.state = state

        def images_array(self, size):
            return x

        def xi_file(self, s):
            calls.append(s)
            return tmp_path / "xi.safetensors"

    with DeviceState(tmp_path / "state") as state:
        state.codeword = lambda c: v
        agent = Agent(state)
        task = {"method": "fedfs+feduv", "model_config": json.loads(cfg.to_json()), "round_id": 1, "model_version": 1,
                "xi_sha256": sha, "train": {"scope": "top", "batch_size": 4, "seed": 0, "lr": 0.05}}
        runtime = TorchRuntime()
        first = decode_update(runtime.train(task, model, agent).body)[0]
        entry = getattr(agent, CACHE_ATTR)
        assert len(entry) == 1 and next(iter(entry))[0] == sha and next(iter(entry))[-1] == min(STATS_CHUNK, 12)
        again = decode_update(runtime.train(task, model, agent).body)[0]
        assert len(getattr(agent, CACHE_ATTR)) == 1                     # round 2: no new trunk pass
        assert all(torch.equal(first[k], again[k]) for k in first)
        ref = LocalTrainer(cfg, TrainConfig(method="fedfs+feduv", scope="top", batch_size=4, seed=0, lr=0.05),
                           xi=xi).train(w, x, codeword=v, seed=round_seed(0, 1))
        for k, t in ref.weights.items():
            torch.testing.assert_close(first[k], t, rtol=1e-5, atol=1e-6)
        assert any(not torch.equal(first[k], w[k]) for k in w)           # it trained


@pytest.mark.parametrize("backbone", ["tiny", "mobilefacenet-affine"])
def test_the_dual_verifier_on_xis_trunk_gives_its_full_forward(backbone):
    """verify=both under scope=top: θ_c's and w's backbones differ from ξ only in their tops, so the
    dual verifier's embeddings come from ξ's cached trunk features, bit for bit; a trained trunk does not."""
    from fedfs_sdk.nn.model import DualVerifierNet, FedUVHead

    xi = _xi(backbone)
    x, agent = _photos(xi, 3, seed=4), SimpleNamespace()
    personal, glob = copy.deepcopy(xi.backbone), copy.deepcopy(xi.backbone)
    with torch.no_grad():                         # trained tops: both embed layers moved
        personal.embed.weight.add_(0.1 * torch.randn_like(personal.embed.weight))
        glob.embed.weight.sub_(0.1 * torch.randn_like(glob.embed.weight))
    torch.manual_seed(5)
    net = DualVerifierNet(personal, glob, FedUVHead(int(xi.backbone.embedding_dim), 127)).eval()
    assert has_xi_trunk(net, xi.backbone)
    want = TorchBackend(net, "d").run(x)["embedding"]
    assert np.array_equal(embeddings_on_xi_trunk(agent, net, "a", xi, x, 256), want)
    with torch.no_grad():                         # θ_c's trunk trained (scope=all): not ξ's
        next(p for k, p in personal.named_parameters() if not k.startswith(("embed.", "embed_norm."))).add_(1e-3)
    assert not has_xi_trunk(net, xi.backbone)


def test_in_memory_verifiers_are_what_the_saved_files_load_as(tmp_path):
    """The check's candidates are built without writing verifier.safetensors: the same weights and model
    id as the file the chosen one is saved to (enrollments are bound to that id)."""
    from fedfs_sdk.nn.checkpoint import load_verifier, save_verifier, verifier_in_memory
    from fedfs_sdk.nn.dual_verifier import dual_verifier_in_memory, load_dual_verifier, save_dual_verifier

    cfg = ModelConfig("tiny", code_length=127)
    a, b = FaceNet(cfg), FaceNet(cfg)
    for head in (None, a.uv_head):
        mid = save_verifier(tmp_path / "v.safetensors", a.backbone, cfg, head)
        loaded, lid = load_verifier(tmp_path / "v.safetensors")
        mem, mem_id = verifier_in_memory(a.backbone, cfg, head)
        assert mid == lid == mem_id and type(mem) is type(loaded)
        assert mem.state_dict().keys() == loaded.state_dict().keys()
        assert all(torch.equal(mem.state_dict()[k], loaded.state_dict()[k]) for k in mem.state_dict())
    mid = save_dual_verifier(tmp_path / "d.safetensors", a.backbone, b.backbone, b.uv_head, cfg)
    loaded, lid = load_dual_verifier(tmp_path / "d.safetensors")
    mem, mem_id = dual_verifier_in_memory(a.backbone, b.backbone, b.uv_head, cfg)
    assert mid == lid == mem_id
    assert all(torch.equal(mem.state_dict()[k], loaded.state_dict()[k]) for k in mem.state_dict())


def test_a_kept_trainer_and_xi_give_a_fresh_trainers_updates(tmp_path):
    """A device keeps ξ and its LocalTrainer between rounds (fedfs_sdk/federation/device_models.py):
    a later round's update from the kept trainer is a fresh trainer's (nothing of the earlier round's
    weights leaks), and a changed ξ file is loaded again."""
    import os

    from fedfs_sdk.federation.device_models import device_trainer, device_xi
    from fedfs_sdk.nn.checkpoint import save_checkpoint
    from fedfs_sdk.runtime.codes import make_codeword
    from fedfs_sdk.training.trainer import LocalTrainer, TrainConfig, initial_global_weights

    xi = _xi("tiny", seed=2)
    save_checkpoint(tmp_path / "xi.safetensors", xi, ModelConfig("tiny"))
    agent = SimpleNamespace()
    kept_xi = device_xi(agent, tmp_path / "xi.safetensors")
    assert device_xi(agent, tmp_path / "xi.safetensors") is kept_xi
    cfg = ModelConfig("tiny", proj_dim=32, code_length=127)
    tcfg = TrainConfig(method="fedfs+feduv", scope="top", batch_size=4, seed=0, lr=0.05)
    x = _photos(xi, 8, seed=5)
    v, _ = make_codeword(9, 127, rng=np.random.default_rng(0))
    w1 = initial_global_weights(cfg, kept_xi)
    r1 = device_trainer(agent, cfg, tcfg, kept_xi).train(w1, x, codeword=v, seed=1)
    w2 = {k: t + 0.01 * torch.randn_like(t) if k.startswith(("backbone.embed", "uv_head")) else t for k, t in r1.weights.items()}
    trainer = device_trainer(agent, cfg, tcfg, kept_xi)
    assert trainer is device_trainer(agent, cfg, tcfg, kept_xi)          # kept
    kept = trainer.train(w2, x, codeword=v, personal_weights=r1.personal_weights, seed=2)
    fresh = LocalTrainer(cfg, tcfg, xi=kept_xi).train(w2, x, codeword=v, personal_weights=r1.personal_weights, seed=2)
    for out in ("weights", "personal_weights"):
        for k, t in getattr(fresh, out).items():
            torch.testing.assert_close(getattr(kept, out)[k], t, rtol=1e-6, atol=1e-7)
    assert device_trainer(agent, cfg, TrainConfig(method="fedfs+feduv", scope="top", batch_size=2), kept_xi) is not trainer
    save_checkpoint(tmp_path / "xi.safetensors", _xi("tiny", seed=3), ModelConfig("tiny"))   # a new ξ file
    os.utime(tmp_path / "xi.safetensors", ns=(1, 1))
    assert device_xi(agent, tmp_path / "xi.safetensors") is not kept_xi
