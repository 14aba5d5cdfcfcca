"""A round that names ``train.scope = "top"`` publishes the previous version's trunk exactly
(server_agg/frozen_trunk.py): hand-made weights here; the real secure round in
tests/test_secagg_devices.py::test_torch_devices_run_secure_rounds."""
from __future__ import annotations

import torch

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
