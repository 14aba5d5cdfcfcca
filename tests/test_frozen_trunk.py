"""A round that names ``train.scope = "top"`` publishes the previous version's trunk exactly
(server_agg/frozen_trunk.py): hand-made weights here; the real secure round in
tests/test_secagg_devices.py::test_torch_devices_run_secure_rounds."""
from __future__ import annotations

import pytest
import torch

from fedfs_sdk.errors import InputError
from server_agg.frozen_trunk import keep_frozen_trunk


def _weights(offset: float) -> dict[str, torch.Tensor]:
    return {"backbone.conv.weight": torch.full((2, 2), 1.0 + offset), "backbone.embed.weight": torch.full((3,), offset),
            "uv_head.weight": torch.full((4,), 2 * offset), "proj.weight": torch.full((1,), 3 * offset)}


def test_top_scope_keeps_the_trunk_and_takes_the_trained_top() -> None:
    prev, new = _weights(0.0), _weights(2.0 ** -20)     # the trunk moved by a fixed-point-sized step
    out = keep_frozen_trunk(new, prev, {"lr": 0.1, "scope": "top"})
    assert torch.equal(out["backbone.conv.weight"], prev["backbone.conv.weight"])
    for k in ("backbone.embed.weight", "uv_head.weight", "proj.weight"):
        assert torch.equal(out[k], new[k]), k
    out["backbone.conv.weight"].add_(1)                 # a copy: the published version is not aliased
    assert torch.equal(prev["backbone.conv.weight"], torch.ones(2, 2))


def test_a_task_that_names_no_scope_or_all_is_averaged_as_it_is() -> None:
    # ORT artifacts train every layer and take a task that names no scope: their trunk is real
    prev, new = _weights(0.0), _weights(0.5)
    for train in (None, {}, {"lr": 0.1}, {"scope": "all"}):
        out = keep_frozen_trunk(new, prev, train)
        assert all(torch.equal(out[k], new[k]) for k in new), train


def test_a_top_round_masks_only_the_top_and_unflattens_onto_the_previous_trunk() -> None:
    """``task["secagg"]["tensors"] = "top"``: the device flattens only what ``scope="top"`` trains
    (sorted names), the server puts the mean back onto the previous trunk, and a DP round's sum is
    read in the full layout with 0 on the trunk (its Δ)."""
    import numpy as np
    from types import SimpleNamespace

    from fedfs_sdk.federation.secagg.http_device import flatten_arrays, layout_digest
    from server_agg.secagg_rounds import task_fields
    from server_agg.secure_layout import expand_top, secure_layout, unflatten

    prev = _weights(0.0)
    policy = SimpleNamespace(train={"scope": "top"}, secagg_threshold=None, secagg_neighbours=None, secagg_clip=1.0,
                             secagg_scale_bits=20, max_num_samples=100, secagg_min_devices=3,
                             secagg_phase_timeout_s=60.0)
    tensors, masked = secure_layout(policy, prev)
    assert tensors == "top" and sorted(masked) == ["backbone.embed.weight", "proj.weight", "uv_head.weight"]
    fields = task_fields(policy, {k: tuple(v.shape) for k, v in masked.items()}, 3, tensors)
    assert fields["dim"] == 3 + 1 + 4 and fields["tensors"] == "top"
    new = {k: v.numpy() for k, v in _weights(0.25).items()}
    vec, floating = flatten_arrays(new, fields["layout_sha256"], "update", "top")
    # sorted: backbone.embed.weight (3), proj.weight (1), uv_head.weight (4)
    np.testing.assert_array_equal(vec, [0.25] * 3 + [0.75] + [0.5] * 4)
    with pytest.raises(InputError, match="layout"):       # a device that sends every tensor is refused
        flatten_arrays(new, fields["layout_sha256"], "update", "all")
    out = unflatten(vec, prev, "top")
    assert sorted(out) == sorted(prev) and torch.equal(out["backbone.conv.weight"], prev["backbone.conv.weight"])
    assert torch.equal(out["uv_head.weight"], torch.full((4,), 0.5))
    out["backbone.conv.weight"].add_(1)                   # a copy
    assert torch.equal(prev["backbone.conv.weight"], torch.ones(2, 2))
    full = expand_top(vec, prev, "top")                   # sorted: backbone.conv (4 zeros), embed, proj, uv_head
    np.testing.assert_array_equal(full, [0.0] * 4 + [0.25] * 3 + [0.75] + [0.5] * 4)
    with pytest.raises(InputError, match="masked tensors"):
        expand_top(vec[:-1], prev, "top")
    assert secure_layout(SimpleNamespace(train={"lr": 0.1}), prev)[0] == "all"
    assert "tensors" not in task_fields(policy, {k: tuple(v.shape) for k, v in prev.items()}, 3)
    assert layout_digest({k: tuple(v.shape) for k, v in prev.items()}) != fields["layout_sha256"]


def test_a_device_refuses_an_unknown_tensor_set_and_a_top_round_that_trains_everything() -> None:
    from fedfs_sdk.federation.secagg.dp_input import SecAggRoundLost
    from fedfs_sdk.federation.secagg.http_device import SecAggSession, params_from_task

    fields = {"dim": 8, "threshold": 2, "neighbours": None, "clip": 1.0, "scale_bits": 20, "max_devices": 3,
              "max_samples": 100, "min_devices": 3, "layout_sha256": "0" * 64, "phase_timeout_s": 60.0}
    with pytest.raises(InputError, match="tensors"):
        params_from_task(1, {**fields, "tensors": "trunk"})
    task = {"round_id": 1, "model_version": 1, "model_sha256": "0" * 64,
            "secagg": {**fields, "tensors": "top", "device": 1}}
    for train in (None, {"lr": 0.1}, {"scope": "all"}):
        with pytest.raises(SecAggRoundLost, match="scope='top'"):
            SecAggSession(None, {**task, "train": train})
    from fedfs_sdk.federation.secagg import DevicePolicy

    ok = SecAggSession(None, {**task, "train": {"scope": "top"}}, policy=DevicePolicy(allow_unauthenticated=True))
    assert ok.tensors == "top"
