"""A global version downloaded as its top alone (``GET /v1/models/{v}/top``), the trunk taken from ξ.

Under ``scope="top"`` the global model's trunk is ξ's, bit for bit, in every version (the server keeps
it exact), and a device has ξ. So a round's model need not cross the network whole: the server
publishes, beside each version whose trunk is ξ's, the body of its top entries (``fedfs-model-top/1``:
the embedding layer, its normalization, FedFS's projection, FedUV's head — 82,048 of 1,019,392 values
for a MobileFaceNet fedfs+feduv model) with the version's sha256, its trunk's
:func:`~fedfs_sdk.training.top_keys.trunk_sha256` and its checkpoint metadata; the round task names the
body's sha256 (``model_top_sha256``). The device checks the body against it, puts ξ's trunk under it,
checks the trunk's sha256 against the body's, and has the version's tensors exactly (:func:`compose_model`).
Torch-free: the ONNX runtime's devices use it too.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError
from ..training.top_keys import is_top_key, trunk_sha256
from .wire_format import MODEL_FORMAT, read_header

TOP_FORMAT = "fedfs-model-top/1"


def compose_model(top_body: bytes, xi_file: Path, model_sha256: str) -> bytes:
    """The version's checkpoint body (``fedfs-checkpoint``, its metadata) from its top body and ξ's trunk;
    :class:`InputError` when the body is not the version's top or ξ's trunk is not the version's."""
    from safetensors.numpy import load, load_file, save

    meta = read_header(top_body)[1]
    if meta.get("format") != TOP_FORMAT:
        raise InputError(f"not a top-only model body (format={meta.get('format')!r})")
    if meta.get("model_sha256") != model_sha256:
        raise InputError("the top-only body is of another model version than the round's")
    top = load(top_body)
    if not top or not all(is_top_key(k) for k in top):
        raise InputError("the top-only body holds entries outside the top")
    trunk = {k: v for k, v in load_file(str(xi_file)).items() if k.startswith("backbone.") and not is_top_key(k)}
    full = {**trunk, **top}
    if trunk_sha256(full) != meta.get("trunk_sha256"):
        raise InputError("ξ's trunk is not this version's trunk (the server's model left ξ's trunk)")
    model_meta = json.loads(meta.get("model_metadata") or "{}")
    if model_meta.get("format") != MODEL_FORMAT:
        raise InputError("the top-only body carries no checkpoint metadata")
    return save(full, metadata=model_meta)


__all__ = ["TOP_FORMAT", "compose_model"]
