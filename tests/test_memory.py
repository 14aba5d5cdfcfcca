"""Memory-sized batches (device_sim.memory): the per-image cost is measured from the model,
micro-batched pre-training takes the same step as the full batch, chunked embedding equals
the one-shot one, and MobileFaceNet at 112 px gets batches that fit the budget."""
from __future__ import annotations

import numpy as np
import torch

from device_sim import memory
from device_sim.datasets import SynthDataset
from device_sim.evaluate import EvalConfig
from device_sim.pretrain import PretrainConfig, embed_images, train_xi
from device_sim.synthfaces import SynthFaces
from fedfs_sdk.nn.model import FaceNet, ModelConfig


def test_cost_of_a_plain_conv_net_is_counted_by_hand() -> None:
    # conv (saves its input 3×8×8 floats) → relu (saves its output 4×8×8 floats)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.ReLU())
    train, infer = memory.per_image_bytes(net, 8)
    assert train == (3 * 8 * 8 + 4 * 8 * 8) * 4
    assert infer == 4 * 8 * 8 * 4
    assert memory.train_micro_batch(net, 8, budget=int(train * 1.5 * 10)) == 10
    assert memory.inference_batch(net, 8, budget=infer * 4 * 7) == 7


def test_mobilefacenet_batches_fit_the_budget() -> None:
    m = FaceNet(ModelConfig("mobilefacenet", input_size=112).resolved())
    train, infer = memory.per_image_bytes(m, 112)
    assert 30 << 20 < train < 120 << 20          # ≈ 60 MB of saved activations per image
    mb = memory.train_micro_batch(m, 112)
    assert 2 <= mb < 128 and mb * train * 1.5 <= memory.TRAIN_BUDGET_BYTES
    ib = memory.inference_batch(m, 112)
    assert ib * infer * 4 <= memory.INFER_BUDGET_BYTES and ib < 512
    assert EvalConfig().batch_size is None       # evaluation sizes its batches from the model
    # on CPU, speed caps it further (issue 32): the trunk ran 18–22 ms of CPU per image at 10–20
    # images per batch, 31–43 ms at 64 (1 thread); the largest output is 128×56×56 floats per image
    assert infer == 128 * 56 * 56 * 4
    assert 10 <= memory.forward_batch(m, 112, "cpu") <= 20
    assert memory.forward_batch(m, 112, "cuda") == ib > 20


def _data() -> tuple[SynthDataset, np.ndarray, np.ndarray]:
    ds = SynthDataset(SynthFaces(seed=0, image_size=32), images_per_identity=6, num_identities=4)
    return ds, np.repeat(np.arange(4), 6), np.tile(np.arange(6), 4)


def test_micro_batches_take_the_full_batch_step() -> None:
    ds, ids, idx = _data()
    cfg = PretrainConfig(width=4, embedding_dim=16, epochs=2, batch_size=12)
    full, st_full = train_xi(ds, ids, idx, ids, cfg, micro_batch=12)
    micro, st_micro = train_xi(ds, ids, idx, ids, cfg, micro_batch=5)     # 5 + 5 + 2
    for (k, a), b in zip(full.state_dict().items(), micro.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), k
    assert abs(st_full["final_loss"] - st_micro["final_loss"]) < 1e-4
    assert st_full["final_train_acc"] == st_micro["final_train_acc"]


def test_chunked_embedding_equals_one_forward() -> None:
    ds, ids, idx = _data()
    torch.manual_seed(0)
    m = FaceNet(ModelConfig("tiny").resolved()).eval()
    with torch.no_grad():
        ref = m(ds.batch(ids, idx)).embedding
    got = embed_images(m, ds, ids, idx, batch_size=7)
    assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-6)


def test_cpu_forward_batch_is_capped_by_the_largest_output(monkeypatch) -> None:
    # the conv net above: largest output 4×8×8 floats = 1024 bytes per image
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.ReLU())
    monkeypatch.setattr(memory, "CPU_FORWARD_BYTES", 1024 * 5 + 1023)
    assert memory.forward_batch(net, 8, "cpu") == 5
    assert memory.forward_batch(net, 8, "cpu", cap=3) == 3
    # not on a GPU: there only the memory budget (and the cap) limit the batch
    assert memory.forward_batch(net, 8, "cuda") == memory.inference_batch(net, 8) == 512
    monkeypatch.setattr(memory, "CPU_FORWARD_BYTES", 10)
    assert memory.forward_batch(net, 8, "cpu") == 1          # never 0

