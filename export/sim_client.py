"""ONNX export of one simulated client's ``verify=both`` verifier (``fedfs export --client N``
of a ``fedfs+feduv`` simulation, whose default verifies with both models).

:func:`export.pipeline.run_export` exports a single-model checkpoint (one backbone, optional
head). The ``verify=both`` verifier of a client is a :class:`~fedfs_sdk.nn.model.DualVerifierNet`
(``unit(W q') ⊕ unit(W r')``: the client's ``θ_c`` and the global ``w`` through the global head
``W``), saved by :func:`fedfs_sdk.nn.dual_verifier.save_dual_verifier`. This module writes it as
``onnx/verifier.onnx`` — the file an app (``OnnxBackend``) and ``fedfs enroll --model`` take —
with the same parity check and ``manifest.json`` as the pipeline, published the same way
(complete or not at all).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

from fedfs_sdk.errors import InputError


def export_dual_client(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], formats: tuple[str, ...],
                       overwrite: bool, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Export the dual verifier file ``checkpoint`` to ``out/onnx/verifier.onnx`` + manifest."""
    from fedfs_sdk.nn.checkpoint import read_checkpoint, read_checkpoint_bytes
    from fedfs_sdk.nn.dual_verifier import dual_verifier_from_state, is_dual_verifier
    from fedfs_sdk.errors import CheckpointError

    from .common import model_version
    from .pipeline import ONNX_FILE, _check_out, export_dual_onnx, staged, write_folder_manifest

    step = progress or (lambda _msg: None)
    if tuple(formats) != ("onnx",):
        raise InputError("this client verifies with both models (fedfs+feduv verify=both), which exports as ONNX "
                         "only: pass --formats onnx (Core ML, int8 and training artifacts come from the global "
                         "model: leave out --client)")
    out = _check_out(Path(out), overwrite, {"--checkpoint": checkpoint})
    step("loading checkpoint")
    sha = hashlib.sha256(read_checkpoint_bytes(checkpoint)).hexdigest()
    state, config, meta = read_checkpoint(checkpoint)
    if not is_dual_verifier(meta):
        raise CheckpointError(f"{Path(checkpoint)} is not a dual verifier (meta.role={meta.get('role')!r})")
    net, mid = dual_verifier_from_state(state, config, meta, checkpoint)
    version = model_version(meta)
    with staged(out) as tmp:
        step("ONNX fp32 dual verifier (verify=both)")
        entry = export_dual_onnx(net, tmp / ONNX_FILE, version)
        step("manifest")
        source = {"file": Path(checkpoint).name, "sha256": sha, "meta": meta}
        manifest = write_folder_manifest(tmp, config, source=source, model_id=mid, model_version=version,
                                         artifacts={"onnx": {"file": ONNX_FILE, **entry}})
    return manifest


__all__ = ["export_dual_client"]
