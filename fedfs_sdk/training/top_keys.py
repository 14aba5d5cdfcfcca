"""Which state-dict entries ``scope="top"`` trains — by name only, no torch.

Split out of :mod:`fedfs_sdk.training.scope` so that code without torch — a secure round's
device side (:mod:`fedfs_sdk.federation.secagg.http_device`) on an ONNX Runtime install — can
select the same tensors the torch trainer trains.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Mapping, TypeVar

import numpy as np

_TOP = re.compile(r"(^|\.)(embed|embed_norm)\.|^(proj|uv_head)\.")

V = TypeVar("V")


def is_top_key(name: str) -> bool:
    """True for the state-dict entries ``scope="top"`` trains (``backbone.embed.*``,
    ``backbone.embed_norm.*``, ``global_backbone.embed*.*``, ``proj.*``, ``uv_head.*``)."""
    return _TOP.search(name) is not None


def top_entries(arrays: Mapping[str, V]) -> dict[str, V]:
    """The entries of ``arrays`` whose names :func:`is_top_key` accepts."""
    return {k: v for k, v in arrays.items() if is_top_key(k)}


def trunk_sha256(weights: Mapping[str, Any]) -> str:
    """sha256 of the trunk of a backbone state dict: every ``backbone.*`` entry :func:`is_top_key`
    rejects, in sorted key order, as ``key NUL float32-little-endian-bytes``. What a ``scope="top"``
    ORT artifact records of the trunk it was exported with (``trunk.onnx``) and what a device
    computes of the model a server sends, so it never trains a top on another trunk's features."""
    h = hashlib.sha256()
    for key in sorted(k for k in weights if k.startswith("backbone.") and not is_top_key(k)):
        v = weights[key]
        arr = np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v, dtype="<f4")
        h.update(key.encode() + b"\0" + np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


__all__ = ["is_top_key", "top_entries", "trunk_sha256"]
