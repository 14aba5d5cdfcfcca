"""Checkpoints: one loader for files and bytes, every unusable header a CheckpointError."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedfs_sdk.nn.checkpoint import (FORMAT, checkpoint_from_bytes, load_checkpoint, load_verifier, read_checkpoint,
                                  save_checkpoint, write_safetensors_atomic)
from fedfs_sdk.errors import CheckpointError, FedFSError
from fedfs_sdk.nn.model import FaceNet, ModelConfig

@pytest.fixture(scope="module")
def net() -> FaceNet:
    torch.manual_seed(0)
    return FaceNet(ModelConfig("tiny", code_length=127)).eval()


def _write(path: Path, net: FaceNet, header: dict[str, str]) -> Path:
    tensors = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    return write_safetensors_atomic(path, tensors, header)


def test_file_and_bytes_load_the_same(tmp_path: Path, net: FaceNet) -> None:
    p = tmp_path / "m.safetensors"
    save_checkpoint(p, net, net.config, {"round": 3})
    a, meta_a = load_checkpoint(p)
    b, meta_b = checkpoint_from_bytes(p.read_bytes(), p)
    assert meta_a == meta_b == {"round": 3} and a.config == b.config == net.config
    for k, t in net.state_dict().items():
        assert torch.equal(a.state_dict()[k], t) and torch.equal(b.state_dict()[k], t)


def _load_all(p: Path):
    """Every way to open a checkpoint file, each must fail with CheckpointError."""
    return [lambda: load_checkpoint(p), lambda: checkpoint_from_bytes(p.read_bytes(), p),
            lambda: load_verifier(p)]


@pytest.mark.parametrize("header,match", [
    ({"format": FORMAT, "meta": "{}"}, "has no model_config"),
    ({"format": FORMAT, "model_config": '{"backbone": "resnet9000"}'}, "unknown backbone 'resnet9000'"),
    ({"format": FORMAT, "model_config": '{"backbone": "tiny", "input_size": 36}'}, "multiple of 8"),
    ({"format": FORMAT, "model_config": '{"backbone": "tiny", "code_length": 100}'}, "code_length must be one of"),
    ({"format": FORMAT, "model_config": '{"backbone": "tiny", "colour": 1}'}, "unknown ModelConfig fields"),
    ({"format": FORMAT, "model_config": "{not json"}, "not valid JSON"),
    ({"format": FORMAT, "model_config": '"tiny"'}, "must be a JSON object"),
])
def test_unusable_model_config_is_a_checkpoint_error(tmp_path: Path, net: FaceNet, header: dict, match: str) -> None:
    p = _write(tmp_path / "bad.safetensors", net, header)
    for load in _load_all(p):
        with pytest.raises(CheckpointError, match=f"bad.safetensors cannot be rebuilt from its header: .*{match}"):
            load()
    if "backbone" in match or "multiple of 8" in match:
        read_checkpoint(p)                     # a valid ModelConfig; only building the net fails
    else:
        with pytest.raises(CheckpointError, match=f"cannot be rebuilt from its header: .*{match}"):
            read_checkpoint(p)


def test_other_problems_keep_their_messages(tmp_path: Path, net: FaceNet) -> None:
    with pytest.raises(CheckpointError, match="fedfs checkpoint not found: .*missing.safetensors"):
        load_checkpoint(tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match="fedfs checkpoint not found"):
        load_checkpoint(tmp_path)                                   # a folder
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(CheckpointError, match="not a readable fedfs checkpoint: .*junk.safetensors"):
        load_checkpoint(junk)
    other = _write(tmp_path / "other.safetensors", net, {"format": "something-else/1"})
    with pytest.raises(CheckpointError, match=r"is not a fedfs checkpoint \(format='something-else/1'\)"):
        load_checkpoint(other)
    meta = _write(tmp_path / "meta.safetensors", net, {"format": FORMAT, "model_config": net.config.to_json(),
                                                        "meta": json.dumps([1, 2])})
    with pytest.raises(CheckpointError, match="meta must be a JSON object"):
        load_checkpoint(meta)
    arch = _write(tmp_path / "arch.safetensors", net, {"format": FORMAT,
                                                        "model_config": ModelConfig("tiny").to_json()})
    with pytest.raises(CheckpointError, match="does not match its own architecture"):
        load_checkpoint(arch)


def test_cli_shows_one_line_for_a_checkpoint_without_model_config(tmp_path: Path, net: FaceNet) -> None:
    p = _write(tmp_path / "nocfg.safetensors", net, {"format": FORMAT, "meta": "{}"})
    img = tmp_path / "x.png"
    import cv2
    import numpy as np
    cv2.imwrite(str(img), np.zeros((32, 32, 3), np.uint8))
    from conftest_server import cli_in_process       # fedfs's main here (enroll's real runs: test_core_cli)

    r = cli_in_process("enroll", "--model", str(p), "--images", str(tmp_path), "--out", str(tmp_path / "o.enr"),
                       "--key-file", str(tmp_path / "k"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "has no model_config" in r.stderr
    assert issubclass(CheckpointError, FedFSError)
