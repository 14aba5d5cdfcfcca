"""Which of the model's tensors a secure weight round masks, and the unmasked vector back into
tensors: every tensor, or under ``train.scope = "top"`` only the top's
(``task["secagg"]["tensors"] = "top"``; :mod:`fedfs_sdk.federation.secagg.http_device` flattens
the device's side in the same order: tensors sorted by name, each in C order).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg.http_device import select_tensors


def secure_layout(policy: Any, weights: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(tensors, the tensors of weights a round masks)``: under a ``train.scope = "top"``
    policy only what that scope trains (``"top"``) — the trunk comes back as it went out
    (:mod:`.frozen_trunk`), so it is neither masked nor sent; otherwise every tensor."""
    if (getattr(policy, "train", None) or {}).get("scope") == "top":
        return "top", select_tensors(weights, "top")
    return "all", dict(weights)


def unflatten(mean: np.ndarray, reference: Mapping[str, Any], tensors: str = "all") -> dict[str, Any]:
    """The averaged vector back into tensors of ``reference``'s layout and dtypes (sorted
    names, C order — :func:`fedfs_sdk.federation.secagg.http_device.flatten_update`'s order).
    ``tensors="top"``: the vector holds only the top's tensors; the others are ``reference``'s
    own (copies) — what a round that trains the top averages them to."""
    import torch

    from .aggregate import _cast_back

    out, at = {}, 0
    masked = select_tensors(reference, tensors)
    if tensors != "all":
        out = {k: v.detach().clone() for k, v in reference.items() if k not in masked}
    for k in sorted(masked):
        ref = masked[k]
        n = ref.numel()
        chunk = torch.from_numpy(np.ascontiguousarray(mean[at:at + n], dtype=np.float64)).reshape(ref.shape)
        out[k] = _cast_back(chunk, ref.dtype)
        at += n
    if at != mean.size:
        raise InputError(f"the unmasked vector has {mean.size} values, the model's masked tensors {at}")
    return out


def expand_top(vec: np.ndarray, reference: Mapping[str, Any], tensors: str) -> np.ndarray:
    """A ``tensors`` vector as one over every tensor of ``reference`` (sorted names, C order),
    0 where it holds nothing: the unmasked sum of a DP round that masked the top only, in the
    layout :meth:`server_agg.dp.DpFedAvg.add_secure_sum` reads (the trunk's ``Δ`` is 0)."""
    if tensors == "all":
        return vec
    masked = select_tensors(reference, tensors)
    parts, at = [], 0
    for k in sorted(reference):
        n = int(reference[k].numel())
        if k in masked:
            parts.append(np.asarray(vec[at:at + n], dtype=np.float64))
            at += n
        else:
            parts.append(np.zeros(n))
    if at != vec.size:
        raise InputError(f"the unmasked vector has {vec.size} values, the model's masked tensors {at}")
    return np.concatenate(parts) if parts else np.zeros(0)


__all__ = ["secure_layout", "unflatten", "expand_top"]
