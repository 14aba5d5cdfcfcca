"""Shared builders for the Flower adapter tests (imported explicitly by tests/test_flower_*.py):
a tiny fedfs+feduv model, ξ, per-node image folders, and the check that a run's published
global models are fedfs's aggregation of the updates the strategy received."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from conftest_server import weighted_average, write_images
from fedfs_sdk.nn.checkpoint import read_checkpoint, save_checkpoint
from fedfs_sdk.federation.device_state import DeviceState
from fedfs_sdk.nn.model import FaceNet, ModelConfig
from fedfs_sdk.training.trainer import initial_global_weights
from fedfs_sdk.federation.wire import decode_weights
from server_agg.aggregate import fedavg

TINY = ModelConfig("tiny", proj_dim=32, code_length=127)
"""Global model of fedfs+feduv: tiny backbone, FedFS projection (z = r ⊕ q = 64 = dim ξ), c = 127."""

TRAIN = {"lr": 0.02, "local_epochs": 1, "batch_size": 8}


def build_federation(root: Path, nodes: int, images_per_node: tuple[int, ...] | None = None) -> dict[str, Path]:
    """ξ, the round-0 model and one image folder per node (different |D_c| per node)."""
    torch.manual_seed(123)
    xi = FaceNet(ModelConfig("tiny")).eval()
    model = FaceNet(TINY)
    model.load_state_dict(initial_global_weights(TINY, xi, seed=0))
    paths = {"xi": root / "xi.safetensors", "model": root / "global0.safetensors", "data": root / "data",
             "state": root / "state", "out": root / "out", "record": root / "record"}
    save_checkpoint(paths["xi"], xi, xi.config, {"role": "xi"})
    save_checkpoint(paths["model"], model, TINY, {"round": 0})
    counts = images_per_node or tuple(6 + 2 * i for i in range(nodes))
    for i, n in enumerate(counts):
        write_images(paths["data"] / f"person{i:02d}", n, seed=100 + i, size=40)
    return paths


def run_config(paths: dict[str, Path], rounds: int, nodes: int) -> dict[str, object]:
    return {"method": "fedfs+feduv", "initial-model": str(paths["model"]), "num-rounds": rounds,
            "min-nodes": nodes, "train": json.dumps(TRAIN), "xi": str(paths["xi"]),
            "data-root": str(paths["data"]), "state-root": str(paths["state"]), "out-dir": str(paths["out"]),
            "record-dir": str(paths["record"]), "torch-threads": 1}


def recorded_updates(record_dir: Path, server_round: int) -> list[tuple[int, dict[str, torch.Tensor], int, str]]:
    """``(node, w_c, |D_c|, digest)`` of every update the strategy accepted in a round."""
    out = []
    for p in sorted(record_dir.glob(f"round{server_round:03d}_node*.safetensors")):
        w, meta = decode_weights(p.read_bytes())
        out.append((int(meta["node_id"]), w, int(meta["num_samples"]), meta["digest"]))
    return out


def check_rounds_match_fedfs(paths: dict[str, Path], rounds: int, nodes: int) -> None:
    """Each published global = fedfs's fedavg of that round's received updates, bit for bit
    (float64 sums, one rounding: the design's bound for the same updates is equality), and
    = an independent numpy float64 average rounded once to float32."""
    prev, _, _ = read_checkpoint(paths["model"])
    for r in range(1, rounds + 1):
        ups = recorded_updates(paths["record"], r)
        assert len(ups) == nodes, f"round {r}: {len(ups)} updates recorded, {nodes} nodes"
        published, config, meta = read_checkpoint(paths["out"] / f"global_round{r:03d}.safetensors")
        assert config == TINY and meta["round"] == r and meta["num_updates"] == nodes
        assert set(published) == set(prev), "the global model's keys changed"
        ours = fedavg([(w, n) for _, w, n, _ in ups], reference=prev)
        independent = weighted_average([({k: t.numpy() for k, t in w.items()}, n) for _, w, n, _ in ups])
        for k, t in published.items():
            assert t.dtype == prev[k].dtype
            assert torch.equal(t, ours[k]), f"round {r} {k}: differs from server_agg's fedavg"
            if t.is_floating_point():
                np.testing.assert_array_equal(t.numpy(), independent[k].astype(np.float32), err_msg=f"round {r} {k}")
        # the round really moved the model (training happened) and w_c ≠ θ_c keys: nothing personal sent
        assert any(not torch.equal(published[k], prev[k]) for k in published if published[k].is_floating_point())
        for _, w, _, _ in ups:
            assert set(w) == set(prev)
        prev = published


def check_node_states(paths: dict[str, Path], rounds: int, nodes: int) -> None:
    """Each node kept θ_c, r_u and its codeword; its b_u is the server's, unique; the digest of
    every update it sent matches what the strategy recorded (transport changed no bit)."""
    table = {int(k): v for k, v in json.loads((paths["out"] / "base_vectors.json").read_text()).items()}
    assert len(table) == nodes and len(set(table.values())) == nodes
    received = {(r, node): digest for r in range(1, rounds + 1) for node, _, _, digest in recorded_updates(paths["record"], r)}
    seen = set()
    for d in sorted(paths["state"].iterdir()):
        with DeviceState(d, read_only=True) as st:
            info = st.info
            node = int(info.device_id.removeprefix("flower-node-"))
            assert table[node] == info.base_vector
            assert st.r_bits() is not None and st.load_codeword().shape == (TINY.code_length,)
            assert st.load_weights("personal") is not None
            sent = {(r["server_round"], node): r["sent_sha256"] for r in info.rounds}
            assert len(sent) == rounds
            for key, digest in sent.items():
                assert received[key] == digest, f"node {node} round {key[0]}: sent ≠ received"
            seen.add(node)
    assert seen == set(table)
