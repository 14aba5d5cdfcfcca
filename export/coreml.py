"""Core ML export of the verifier: ``.mlpackage`` (ML Program), fp16 or fp32.

Input ``image``: an RGB ``S×S`` image (``CVPixelBuffer`` / ``CGImage`` through Vision),
normalized *inside* the model by the ``ImageType`` affine map ``x·(1/127.5) − 1`` — the
same contract as ONNX's ``(x − 127.5)/127.5`` (:class:`~export.common.InputContract`).
Outputs ``embedding`` ``[1, D]`` and, for FedUV models, ``uv`` ``[1, c]`` (float32 arrays;
fp16 models compute in fp16 and return float32).

Core ML prediction does not run on Linux. :func:`validate_coreml` checks the saved spec
(input image type and size, the normalization ops at the head of the program, outputs and
their shapes, metadata) and, given the torch verifier, the numerics:
:func:`check_coreml_numerics` executes the saved ML Program op by op in its own precision
(:mod:`export.coreml_reference`: fp16 storage, fp32 arithmetic inside an op) and compares
it with torch. :func:`export_coreml` runs that check on every package it writes and deletes
a package that fails it (:class:`CoreMLNumericsError`): an fp16 program whose FedUV scores
drifted — e.g. ``Σ (W g)²`` overflowing fp16 and every image getting ``uv = 0`` — is never
shipped (issue 13).

**No updatable FedUV head.** ``MLUpdateTask`` needs the ``neuralnetwork`` backend (not ML
Program), trains only convolution / inner-product weights, offers only categorical
cross-entropy (after a softmax) and MSE losses, and back-propagates only through
convolution, inner-product, flatten, pooling, batchnorm and ReLU/sigmoid/tanh layers.
FedUV's ``ℓ_pos = max(0, 1 − vᵀσ(W g)/c)`` needs the gradient through ``σ`` (an L2
normalization scaled to ``√c``), which Core ML cannot back-propagate; the only loss Core
ML could attach is MSE on ``W g`` itself, a different objective than what the federation
trains (and averages). An fp16 model cannot be made updatable at all. On iOS, local
training therefore uses the ONNX Runtime training artifacts (``onnxruntime-training-objc``),
which train exactly the simulator's losses; Core ML serves inference.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfs_sdk.errors import InputError

from .common import ExportError, synthetic_faces
from .onnx_inference import OUTPUT_EMBEDDING, OUTPUT_UV, verifier_outputs
from .score_bounds import GUARANTEE, score_change_bound

IMAGE_INPUT = "image"
PRECISIONS = ("fp16", "fp32")
MIN_TARGET = "iOS16"


NUMERICS_TOLERANCE = 0.02
"""Largest score change (torch → Core ML program) an export may have. Scores live in
[−1, 1] and are thresholded at ``τ``; fp16 rounding moves them by ~1e-3 to 6e-3 (measured on
MobileFaceNet, docs/export.md), so only decisions within ±0.02 of ``τ`` may differ. That is
the honest promise for fp16: identical decisions for every image farther from ``τ`` than the
measured bound, not for every image — a score within fp16 rounding of ``τ`` can flip
(``benchmarks/export_fp16_parity.py``: 1 of 200 MobileFaceNet decisions, 0 outside the band)."""


class CoreMLValidationError(ExportError):
    """A saved ``.mlpackage`` does not have the expected interface."""


class CoreMLNumericsError(CoreMLValidationError):
    """A saved ``.mlpackage`` computes scores that differ from torch beyond the tolerance."""


def _ct():
    import logging

    # coremltools logs its supported-version matrix at import; it is noise for an exporter.
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    import coremltools as ct
    return ct


def export_coreml(verifier: torch.nn.Module, path: str | os.PathLike[str], *, precision: str = "fp16",
                  metadata: dict[str, str] | None = None, model_version: str = "unversioned",
                  check_pixels: np.ndarray | None = None, tolerance: float = NUMERICS_TOLERANCE,
                  check_numerics: bool = True) -> Path:
    """Convert ``verifier`` (a :class:`~fedfs_sdk.nn.model.VerifierNet`) to an ``.mlpackage``.

    The saved program is then executed by the fp16 reference on ``check_pixels`` (RGB
    pixel values ``[N, 3, S, S]``; default: :func:`synthetic_check_pixels`) and compared
    with torch (:func:`check_coreml_numerics`); if it fails, the package is deleted and
    :class:`CoreMLNumericsError` raised. ``check_numerics=False`` skips that — only to study
    a failing program (``benchmarks/export_fp16_parity.py``), never for a shipped one."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    ct = _ct()
    verifier = verifier.eval()
    s = int(verifier.backbone.input_size)
    outputs = verifier_outputs(verifier)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(verifier, torch.zeros(1, 3, s, s))
        # ct.convert draws tqdm bars on stderr with no switch to turn them off.
        with contextlib.redirect_stderr(io.StringIO()):
            model = ct.convert(
                traced,
                inputs=[ct.ImageType(name=IMAGE_INPUT, shape=(1, 3, s, s), scale=1.0 / 127.5,
                                     bias=[-1.0, -1.0, -1.0], color_layout=ct.colorlayout.RGB)],
                outputs=[ct.TensorType(name=o, dtype=np.float32) for o in outputs],
                convert_to="mlprogram",
                compute_precision=ct.precision.FLOAT16 if precision == "fp16" else ct.precision.FLOAT32,
                minimum_deployment_target=getattr(ct.target, MIN_TARGET),
            )
    meta = dict(metadata or {})
    meta.update({"fedfs.precision": precision, "fedfs.input_name": IMAGE_INPUT,
                 "fedfs.input_layout": "image", "fedfs.input_dtype": "uint8 RGB image",
                 "fedfs.coreml_preprocessing": "x * (1/127.5) - 1 (ImageType scale/bias)"})
    if precision == "fp16" and "fedfs.model_id" in meta:
        meta["fedfs.model_id"] += "-coreml-fp16"   # fp16 scores differ: thresholds do not carry over
    model.author = "fedfs"
    model.short_description = ("fedfs face verifier: embedding" + (" + FedUV head σ(W g)" if OUTPUT_UV in outputs else "")
                               + f"; input RGB {s}x{s} image, normalized in-model as (x-127.5)/127.5")
    model.version = model_version
    crop = {"dlib-chip": "dlib face chip (dlib.get_face_chip, 5 points, padding 0.25)"}.get(
        meta.get("fedfs.face_alignment", ""), "aligned face crop")
    model.input_description[IMAGE_INPUT] = f"RGB {s}x{s} {crop}"
    model.output_description[OUTPUT_EMBEDDING] = "embedding g(x) (not L2-normalized)"
    if OUTPUT_UV in outputs:
        model.output_description[OUTPUT_UV] = "sigma(W g(x)), norm sqrt(c); score = dot(uv, codeword)/c"
    for k, v in meta.items():
        model.user_defined_metadata[k] = str(v)
    path = Path(path)
    model.save(str(path))
    if not check_numerics:
        return path
    try:
        check_coreml_numerics(path, verifier, check_pixels, tolerance=tolerance)
    except CoreMLNumericsError:
        shutil.rmtree(path, ignore_errors=True)        # never leave a package that fails the check
        raise
    return path


def synthetic_check_pixels(input_size: int, identities: int = 8, per_identity: int = 2,
                           seed: int = 20_240_617) -> np.ndarray:
    """SynthFaces RGB pixel values ``[N, 3, S, S]`` (0–255) for the numerics check."""
    x, _ = synthetic_faces(input_size, identities, per_identity, seed)
    return (x * 127.5 + 127.5).astype(np.float32)


def check_coreml_numerics(path: str | os.PathLike[str], verifier: torch.nn.Module,
                          pixels: np.ndarray | None = None, *, tolerance: float = NUMERICS_TOLERANCE) -> dict[str, Any]:
    """Execute the saved program (:class:`~export.coreml_reference.CoreMLReference`) on
    ``pixels`` and bound how far its verification scores can be from torch's.

    * ``uv`` (FedUV, score ``vᵀ uv / c`` for a ±1 codeword ``v``): by Cauchy–Schwarz,
      ``|Δscore| ≤ ‖Δuv‖ / √c`` for *every* codeword, so the bound is
      ``max_i ‖uv_coreml − uv_torch‖ / √c``.
    * ``embedding`` (template mode, cosine to an enrolled template): a cosine moves by at
      most ``‖Δ unit(e)‖`` per side, so the bound is ``2 · max_i ‖unit(e_coreml) − unit(e_torch)‖``.

    Both must be finite and ≤ ``tolerance``: then accept/reject decisions can differ from
    torch's only for scores within ``tolerance`` of ``τ``. Raises :class:`CoreMLNumericsError`
    naming the output; returns the bounds.
    """
    from .coreml_reference import CoreMLReference

    s = int(verifier.backbone.input_size)
    px = synthetic_check_pixels(s) if pixels is None else np.asarray(pixels, dtype=np.float32)
    if px.ndim != 4 or px.shape[1:] != (3, s, s):
        raise InputError(f"check pixels must be [N, 3, {s}, {s}] RGB values 0-255, got shape {list(px.shape)}")
    got = CoreMLReference(path).run(px)
    with torch.no_grad():
        ref = dict(zip(verifier_outputs(verifier), (t.numpy() for t in verifier.eval()(torch.from_numpy(px / 127.5 - 1)))))
    bounds: dict[str, float] = {}
    for name, want in ref.items():
        have = got.get(name)
        if have is None:
            raise CoreMLNumericsError(f"{path}: the Core ML program has no output {name!r}")
        if not np.isfinite(have).all():
            bad = int((~np.isfinite(have)).any(axis=-1).sum())
            raise CoreMLNumericsError(f"{path}: output {name!r} is NaN/Inf for {bad} of {len(px)} images "
                                      "(an intermediate overflowed the program's precision); export fp32 instead")
        bound = score_change_bound(name, have, want)     # uv: ‖Δuv‖/√c; embedding: 2‖Δ unit(e)‖
        bounds[name] = bound
        if not bound <= tolerance:
            raise CoreMLNumericsError(
                f"{path}: output {name!r} of the Core ML program moves verification scores by up to {bound:.3g} "
                f"(tolerance {tolerance:g}) on {len(px)} images: accept/reject decisions would differ from torch "
                "(an fp16 intermediate overflowed or lost precision); fix the graph or export fp32")
    return {"reference": "export/coreml_reference.py: the saved ML Program run op by op, tensors stored in "
                         "the program's dtypes, fp32 arithmetic inside each op",
            "images": int(len(px)), "max_score_change": bounds, "tolerance": tolerance, "guarantee": GUARANTEE}


def _const_floats(ops: dict[str, Any], name: str) -> list[float]:
    op = ops.get(name)
    if op is None or op.type != "const":
        return []
    return list(op.attributes["val"].immediateValue.tensor.floats.values)


def validate_coreml(path: str | os.PathLike[str], *, input_size: int, outputs: dict[str, int],
                    metadata: dict[str, str] | None = None, precision: str | None = None,
                    verifier: torch.nn.Module | None = None, pixels: np.ndarray | None = None,
                    tolerance: float = NUMERICS_TOLERANCE) -> dict[str, Any]:
    """Check a saved ``.mlpackage`` on any OS. ``outputs`` maps name → last dimension.

    Checks the spec and, when ``verifier`` (the torch model it was converted from) is given,
    the numerics (:func:`check_coreml_numerics`, on ``pixels`` or SynthFaces).
    Raises :class:`CoreMLValidationError` naming the first mismatch; returns a summary.
    """
    ct = _ct()
    p = Path(path)
    if not p.exists():
        raise CoreMLValidationError(f"no Core ML package at {p}")
    spec = ct.utils.load_spec(str(p))
    if spec.WhichOneof("Type") != "mlProgram":
        raise CoreMLValidationError(f"{p} is a {spec.WhichOneof('Type')} model, expected an ML Program")
    desc = spec.description
    if len(desc.input) != 1 or desc.input[0].name != IMAGE_INPUT:
        raise CoreMLValidationError(f"expected one input {IMAGE_INPUT!r}, got {[i.name for i in desc.input]}")
    img = desc.input[0].type
    if img.WhichOneof("Type") != "imageType":
        raise CoreMLValidationError(f"input is {img.WhichOneof('Type')}, expected an image")
    it = img.imageType
    if (it.width, it.height) != (input_size, input_size):
        raise CoreMLValidationError(f"input image is {it.width}x{it.height}, expected {input_size}x{input_size}")
    if ct.proto.FeatureTypes_pb2.ImageFeatureType.ColorSpace.Name(it.colorSpace) != "RGB":
        raise CoreMLValidationError("input image color space is not RGB")
    # The ImageType scale/bias become the first two ops of the program: mul(image, s), add(·, b).
    fn = spec.mlProgram.functions["main"]
    block = fn.block_specializations[fn.opset]
    ops = {o.outputs[0].name: o for o in block.operations if o.outputs}
    mul = next((o for o in block.operations if o.type == "mul"
                and [a.name for a in o.inputs["x"].arguments] == [IMAGE_INPUT]), None)
    if mul is None:
        raise CoreMLValidationError("no input scaling op found: the model does not normalize the image")
    scale = _const_floats(ops, mul.inputs["y"].arguments[0].name)
    add = next((o for o in block.operations if o.type == "add"
                and [a.name for a in o.inputs["x"].arguments] == [mul.outputs[0].name]), None)
    bias = _const_floats(ops, add.inputs["y"].arguments[0].name) if add is not None else []
    if not scale or not np.allclose(scale, 1.0 / 127.5, rtol=1e-6):
        raise CoreMLValidationError(f"input scale is {scale}, expected 1/127.5")
    if not bias or not np.allclose(bias, -1.0):
        raise CoreMLValidationError(f"input bias is {bias}, expected -1 per channel")
    got = {o.name: list(o.type.multiArrayType.shape) for o in desc.output}
    want = {k: [1, d] for k, d in outputs.items()}
    if got != want:
        raise CoreMLValidationError(f"outputs are {got}, expected {want}")
    user = dict(desc.metadata.userDefined)
    for k, v in (metadata or {}).items():
        if user.get(k) != v:
            raise CoreMLValidationError(f"metadata {k!r} is {user.get(k)!r}, expected {v!r}")
    if precision is not None and user.get("fedfs.precision") != precision:
        raise CoreMLValidationError(f"fedfs.precision is {user.get('fedfs.precision')!r}, expected {precision!r}")
    summary = {"spec_version": int(spec.specificationVersion), "input": {"name": IMAGE_INPUT, "width": it.width,
               "height": it.height, "color": "RGB", "scale": float(scale[0]), "bias": [float(b) for b in bias]},
               "outputs": got, "precision": user.get("fedfs.precision"), "model_id": user.get("fedfs.model_id")}
    if verifier is not None:
        summary["numerics"] = check_coreml_numerics(p, verifier, pixels, tolerance=tolerance)
    return summary
