"""Which state-dict entries ``scope="top"`` trains — by name only, no torch.

Split out of :mod:`fedfs_sdk.training.scope` so that code without torch — a secure round's
device side (:mod:`fedfs_sdk.federation.secagg.http_device`) on an ONNX Runtime install — can
select the same tensors the torch trainer trains.
"""
from __future__ import annotations

import re
from typing import Mapping, TypeVar

_TOP = re.compile(r"(^|\.)(embed|embed_norm)\.|^(proj|uv_head)\.")

V = TypeVar("V")


def is_top_key(name: str) -> bool:
    """True for the state-dict entries ``scope="top"`` trains (``backbone.embed.*``,
    ``backbone.embed_norm.*``, ``global_backbone.embed*.*``, ``proj.*``, ``uv_head.*``)."""
    return _TOP.search(name) is not None


def top_entries(arrays: Mapping[str, V]) -> dict[str, V]:
    """The entries of ``arrays`` whose names :func:`is_top_key` accepts."""
    return {k: v for k, v in arrays.items() if is_top_key(k)}


__all__ = ["is_top_key", "top_entries"]
