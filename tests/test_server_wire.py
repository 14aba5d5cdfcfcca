"""The wire format (safetensors) and its validation helpers, and the round policy."""
from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.wire import (check_finite, check_layout, clip_update, decode_update, decode_weights, encode_update,
                            encode_weights, read_header, train_config_from_json, update_norm)
from server_agg.config import RoundPolicy

W = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}


def test_update_round_trip():
    body = encode_update(W, round_id=3, model_version=2, num_samples=17)
    w, meta = decode_update(body)
    assert (meta.round_id, meta.model_version, meta.num_samples) == (3, 2, 17)
    assert all(torch.equal(w[k], W[k]) for k in W)


@pytest.mark.parametrize("mutate, msg", [
    (lambda b: b[:5], "too short"),
    (lambda b: b[:-4], "truncated"),
    (lambda b: b + b"xx", "trailing"),
    (lambda b: struct.pack("<Q", 1 << 33) + b[8:], "exceeds"),
    (lambda b: b[:8] + b"[" + b[9:], "JSON"),
])
def test_malformed_bodies_name_the_problem(mutate, msg):
    body = encode_update(W, round_id=1, model_version=1, num_samples=1)
    with pytest.raises(InputError, match=msg):
        decode_weights(mutate(body))


def test_header_checks_dtypes_and_metadata():
    def raw(header: dict, payload: bytes = b"") -> bytes:
        h = json.dumps(header).encode()
        return struct.pack("<Q", len(h)) + h + payload

    with pytest.raises(InputError, match="dtype"):
        read_header(raw({"x": {"dtype": "OBJECT", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8))
    with pytest.raises(InputError, match="strings"):
        read_header(raw({"__metadata__": {"n": 3}}))
    with pytest.raises(InputError, match="no tensors"):
        decode_weights(raw({}))


@pytest.mark.parametrize("meta, msg", [
    ({"format": "other"}, "not a fedfs update"),
    ({"format": "fedfs-update/1", "round_id": "1", "model_version": "1"}, "num_samples"),
    ({"format": "fedfs-update/1", "round_id": "x", "model_version": "1", "num_samples": "1"}, "not an integer"),
    ({"format": "fedfs-update/1", "round_id": "1", "model_version": "1", "num_samples": "-2"}, "ASCII digits"),
    ({"format": "fedfs-update/1", "round_id": "1", "model_version": "1", "num_samples": "0"}, r"in \[1, "),
    ({"format": "fedfs-update/1", "round_id": "1", "model_version": "1", "num_samples": "9" * 5000}, "more than 19 digits"),
    ({"format": "fedfs-update/1", "round_id": "1", "model_version": "1", "num_samples": "9" * 19}, r"in \[1, "),
    # strict decimal: what int() accepts but another parser might read differently
    *[({"format": "fedfs-update/1", "round_id": "1", "model_version": "1", "num_samples": raw}, "ASCII digits")
      for raw in (" 7 ", "7 ", "1_0", "+7", "\u0667", "\uff17", "07", "", "7.0", "0x7")],
    # an update carries (round, version, |D_c|) and nothing else: extra keys are named
    ({"format": "fedfs-update/1", "round_id": "1", "model_version": "1", "num_samples": "1",
      "embedding": "0.1,0.2", "note": "x" * 500_000}, "unknown keys 'embedding', 'note'"),
])
def test_update_metadata_is_checked(meta, msg):
    with pytest.raises(InputError, match=msg):
        decode_update(encode_weights(W, meta))


def test_layout_and_finiteness():
    check_layout(W, W)
    with pytest.raises(InputError, match="missing"):
        check_layout({"a": W["a"]}, W)
    with pytest.raises(InputError, match="dtype"):
        check_layout({"a": W["a"].half(), "b": W["b"]}, W)
    bad = {"a": W["a"].clone(), "b": W["b"]}
    bad["a"][0, 0] = float("nan")
    with pytest.raises(InputError, match="a contains NaN"):
        check_finite(bad)


def test_clip_update_scales_the_difference_only():
    ref = {"a": torch.zeros(2, 3), "b": torch.ones(4)}
    w = {"a": torch.full((2, 3), 2.0), "b": torch.ones(4)}      # ‖Δ‖ = sqrt(6·4)
    out, norm, clipped = clip_update(w, ref, max_norm=1.0)
    assert clipped and math.isclose(norm, math.sqrt(24))
    assert math.isclose(update_norm(out, ref), 1.0, rel_tol=1e-6)
    assert torch.equal(out["b"], ref["b"])
    same, _, clipped = clip_update(w, ref, max_norm=100.0)
    assert not clipped and same["a"] is w["a"]


def test_train_config_from_task():
    cfg = train_config_from_json("feduv", {"lr": 0.05, "local_epochs": 2, "objective": {"lambda_neg": 0.5}})
    assert cfg.lr == 0.05 and cfg.effective_epochs == 2 and cfg.objective.lambda_neg == 0.5
    cfg = train_config_from_json("fedfs", {"objective": {"fedfs": {"top_k": 3, "combine": "sum"}}})
    assert cfg.objective.fedfs.top_k == 3
    for bad, msg in [({"lr": "x"}, "lr"), ({"epochs": 1}, "unknown"), ({"local_epochs": 1.5}, "integer"),
                     ({"objective": {"fedfs": {"combine": "xor"}}}, "combine"), ({"objective": []}, "object")]:
        with pytest.raises(InputError, match=msg):
            train_config_from_json("fedfs", bad)
    with pytest.raises(InputError, match="unknown method"):
        train_config_from_json("fedprox", {})


def test_round_policy_validation():
    p = RoundPolicy(participation=0.1, min_participants=3)
    assert p.sample_size(100) == 10 and p.sample_size(10) == 3 and p.sample_size(2) == 2
    assert RoundPolicy(quorum=0.6).quorum_count(5) == 3
    for bad in ({"participation": 0}, {"quorum": 1.5}, {"rounds": -1}, {"min_participants": 0},
                {"max_update_norm": float("inf")}, {"method": "x"}, {"train": {"lr": -1}}, {"bogus": 1},
                {"train": {"objective": {"lambda_neg": 1.0}}}):
        with pytest.raises(InputError):
            RoundPolicy().updated(bad)
    assert RoundPolicy.from_json(RoundPolicy(rounds=4).to_json()) == RoundPolicy(rounds=4)
