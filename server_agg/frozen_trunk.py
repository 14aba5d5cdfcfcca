"""``scope="top"``: the trunk no device trains stays the previous global model's, exactly.

Under ``scope="top"`` (the defaults' scope, :data:`fedfs_sdk.training.methods.DEFAULT_SCOPE`) a
device trains only the top (``backbone.embed*``, FedFS's ``proj``, FedUV's ``uv_head``:
:func:`fedfs_sdk.training.scope.is_top_key`) and uploads the trunk as it received it. Averaged,
those trunk tensors are the received trunk again — up to what the round adds: the secure sum's
fixed-point rounding (``fedfs-secagg``: every coordinate quantized to ``2^-scale_bits``) and, in a
DP round, Gaussian noise on every coordinate. Published as they come out, the global trunk drifts
from ξ's by that rounding every round, and a device then sees a global model whose trunk is not
ξ's: ``LocalTrainer`` can no longer feed ξ, the global and the personalized model from one trunk
pass (three full forwards per step), nor can the check reuse ξ's trunk features — while the
simulator, whose clients train the top on ξ's own trunk features, never drifts.

So a round whose task names ``train.scope = "top"`` publishes the previous version's trunk
tensors, bit for bit, and the average only of what was trained. A device that uploaded a changed
trunk (a bug, or an attack) changes nothing there. Only a task that *names* the scope: ORT
training artifacts train every layer and refuse a task that asks ``scope="top"``, but take one that
names no scope (the torch runtime then trains the method's default, the top) — in such a round an
ORT device's trunk update is real and is averaged as before.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["keep_frozen_trunk"]


def keep_frozen_trunk(new: Mapping[str, torch.Tensor], previous: Mapping[str, torch.Tensor],
                      train: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """``new`` with every tensor ``scope="top"`` does not train replaced by ``previous``'s (a copy)
    when the round's ``train`` names ``scope: "top"``; otherwise ``new`` as it is."""
    from fedfs_sdk.training.scope import is_top_key

    if (train or {}).get("scope") != "top":
        return dict(new)
    return {k: (previous[k].detach().clone() if not is_top_key(k) and k in previous else v) for k, v in new.items()}
