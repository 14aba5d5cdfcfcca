"""ONNX export of one simulated client's ``verify=both`` verifier (``fedfs export --client N``
of a ``fedfs+feduv`` simulation, whose default verifies with both models).

:func:`export.pipeline.run_export` exports a single-model checkpoint (one backbone, optional
head). The ``verify=both`` verifier of a client is a :class:`~fedfs_sdk.model.DualVerifierNet`
(``unit(W q') ⊕ unit(W r')``: the client's ``θ_c`` and the global ``w`` through the global head
``W``), saved by :func:`fedfs_sdk.dual_verifier.save_dual_verifier`. This module writes it as
``onnx/verifier.onnx`` — the file an app (``OnnxBackend``) and ``fedfs enroll --model`` take —
with the same parity check and ``manifest.json`` as the pipeline, published the same way
(complete or not at all).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from fedfs_sdk.errors import InputError


def export_dual_client(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], formats: tuple[str, ...],
                       overwrite: bool, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Export the dual verifier file ``checkpoint`` to ``out/onnx/verifier.onnx`` + manifest."""
    from fedfs_sdk.checkpoint import read_checkpoint_bytes
    from fedfs_sdk.dual_verifier import load_dual_verifier

    from .common import ExportError, model_version
    from .manifest import build_manifest, write_manifest
    from .onnx_inference import export_onnx, onnx_vs_torch
    from .pipeline import ONNX_FILE, _check_out, _opset, _publish

    step = progress or (lambda _msg: None)
    if tuple(formats) != ("onnx",):
        raise InputError("this client verifies with both models (fedfs+feduv verify=both), which exports as ONNX "
                         "only: pass --formats onnx (Core ML, int8 and training artifacts come from the global "
                         "model: leave out --client)")
    out = _check_out(Path(out), overwrite, {"--checkpoint": checkpoint})
    step("loading checkpoint")
    import hashlib

    from fedfs_sdk.checkpoint import read_checkpoint
    data = read_checkpoint_bytes(checkpoint)
    net, mid = load_dual_verifier(checkpoint)
    _, config, meta = read_checkpoint(checkpoint)
    version = model_version(meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        step("ONNX fp32 dual verifier (verify=both)")
        path = tmp / ONNX_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        export_onnx(net, path, model_version=version)
        parity = onnx_vs_torch(net, path)
        if max(parity.values()) > 1e-4:
            raise ExportError(f"dual ONNX verifier differs from torch by {parity} (> 1e-4)")
        artifacts = {"onnx": {"file": ONNX_FILE, "model_id": mid, "precision": "fp32", "opset": _opset(path),
                              "max_abs_diff_vs_torch": parity, "verify": "both"}}
        step("manifest")
        source = {"file": Path(checkpoint).name, "sha256": hashlib.sha256(data).hexdigest(), "meta": meta}
        model = {"backbone": config.backbone, "input_size": int(config.input_size),
                 "embedding_dim": int(config.embedding_dim), "code_length": int(config.code_length or 0),
                 "proj_dim": 0}
        manifest = build_manifest(tmp, source=source, model=model, model_id=mid, model_version=version,
                                  artifacts=artifacts)
        write_manifest(tmp, manifest)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


__all__ = ["export_dual_client"]
