"""ONNX inference export of the verifier (embedding network + FedUV score head).

The graph is :class:`fedfs_sdk.nn.model.VerifierNet`: input ``input`` float32
``[N, 3, S, S]`` (dynamic ``N``, the :class:`~export.common.InputContract`), outputs
``embedding`` ``[N, D]`` (``g(x)``/``q'``, not normalized) and, for FedUV models,
``uv`` ``[N, c]`` = ``σ(W g(x))`` with norm ``√c`` (FedUV Eq. 5 scores it against the
device's codeword: ``e = vᵀ uv / c``). Everything a runtime needs to use the file is in
its ``metadata_props`` (read by :class:`fedfs_sdk.runtime.onnx_backend.OnnxBackend`).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from fedfs_sdk import __version__ as sdk_version
from fedfs_sdk.errors import InputError

from .common import FORMAT_ONNX, MAX_IR_VERSION, OPSET, InputContract

INPUT_NAME = "input"
OUTPUT_EMBEDDING = "embedding"
OUTPUT_UV = "uv"

SCORE_SEMANTICS = (
    "codeword mode (FedUV Eq. 5): score = dot(uv, v) / c with the device's secret ±1 codeword v, "
    "in [-1, 1]; template mode: cosine(embedding, enrolled template). Accept iff score >= tau, "
    "tau from the FedUV Alg. 2 warm-up on the device owner's images with this exact model "
    "(thresholds do not carry over between models or precisions).")


def verifier_outputs(verifier: torch.nn.Module) -> tuple[str, ...]:
    names = getattr(verifier, "output_names", None)
    if names is None:
        return (OUTPUT_EMBEDDING, OUTPUT_UV) if getattr(verifier, "uv_head", None) is not None else (OUTPUT_EMBEDDING,)
    return tuple({"embedding": OUTPUT_EMBEDDING, "uv": OUTPUT_UV}[n] for n in names)


def inference_metadata(verifier: torch.nn.Module, *, model_id: str, model_version: str,
                       precision: str = "fp32") -> dict[str, str]:
    """``metadata_props`` of an exported verifier: input contract, dims, ids, semantics."""
    backbone = verifier.backbone
    contract = InputContract(int(backbone.input_size), face_alignment=getattr(backbone, "face_alignment", None))
    head = getattr(verifier, "uv_head", None)
    return {
        "fedfs.format": FORMAT_ONNX,
        "fedfs.sdk_version": sdk_version,
        "fedfs.model_id": model_id,
        "fedfs.model_version": model_version,
        "fedfs.precision": precision,
        "fedfs.backbone": str(getattr(backbone, "name", type(backbone).__name__)),
        "fedfs.input_name": INPUT_NAME,
        "fedfs.input_size": str(contract.input_size),
        "fedfs.input_layout": contract.layout,
        "fedfs.input_dtype": contract.dtype,
        "fedfs.input_color": contract.color,
        "fedfs.input_mean": f"{contract.mean:g}",
        "fedfs.input_std": f"{contract.std:g}",
        "fedfs.input_normalization": contract.normalization,
        "fedfs.embedding_dim": str(int(getattr(verifier, "embedding_dim", backbone.embedding_dim))),
        "fedfs.code_length": str(int(head.code_length)) if head is not None else "0",
        "fedfs.outputs": ",".join(verifier_outputs(verifier)),
        "fedfs.score": SCORE_SEMANTICS,
        # the face crop the model needs (OnnxBackend.alignment; enroll / verify cut it themselves)
        **({"fedfs.face_alignment": contract.face_alignment} if contract.face_alignment else {}),
    }


def set_metadata(model: onnx.ModelProto, metadata: dict[str, str]) -> None:
    """Replace ``fedfs.*`` metadata props (others are kept)."""
    keep = [p for p in model.metadata_props if p.key not in metadata]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    for k, v in metadata.items():
        model.metadata_props.add(key=k, value=str(v))


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    model = onnx.load(str(path), load_external_data=False)
    return {p.key: p.value for p in model.metadata_props}


def check_runtime_compatible(model: onnx.ModelProto, what: str) -> None:
    """Fail early if ORT 1.19 could not load ``model`` (IR > 10 or opset > 21)."""
    if model.ir_version > MAX_IR_VERSION:
        raise InputError(f"{what}: ONNX IR version {model.ir_version} > {MAX_IR_VERSION}, "
                         "which ONNX Runtime 1.19 cannot load (install onnx==1.17.0)")
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version > 21:
            raise InputError(f"{what}: opset {imp.version} > 21 is not supported by ONNX Runtime 1.19")


def export_onnx(verifier: torch.nn.Module, path: str | os.PathLike[str], *,
                model_version: str = "unversioned", fused: bool = True) -> Path:
    """Export ``verifier`` (a :class:`~fedfs_sdk.nn.model.VerifierNet`) to ``path``.

    Dynamic batch, opset :data:`~export.common.OPSET`, metadata from :func:`inference_metadata`.
    ``fused`` (default): the graph of :func:`export.inference_graph.inference_twin` — the same
    parameters with ``InstanceNormalization``/``BatchNormalization``/``PRelu`` in place of the
    ORT-trainable primitives (1.4× faster on MobileFaceNet, docs/export.md); ``fused=False``
    exports the primitive graph as the training graphs have it (for comparison benchmarks).
    ``fedfs.model_id`` is the id of the verifier's weights (:func:`fedfs_sdk.nn.checkpoint.model_id_of`),
    computed here — :class:`~fedfs_sdk.runtime.onnx_backend.OnnxBackend` recomputes it on load and
    refuses a file whose id and weights disagree.
    """
    from fedfs_sdk.nn.checkpoint import model_id_of

    from .inference_graph import inference_twin

    path = Path(path)
    verifier = verifier.eval()
    model_id = model_id_of(verifier.state_dict(), getattr(verifier.backbone, "name", None))
    graph = inference_twin(verifier) if fused else verifier
    s = int(verifier.backbone.input_size)
    outputs = verifier_outputs(verifier)
    dummy = torch.zeros(2, 3, s, s)
    dynamic = {INPUT_NAME: {0: "batch"}, **{o: {0: "batch"} for o in outputs}}
    # TRAINING mode without constant folding keeps one initializer per parameter, named by
    # its FaceNet state-dict key (eval-mode export merges equal tensors, e.g. fresh norm
    # weights): a device can then swap in its personalized weights at session creation
    # (OnnxBackend(weights=...)). ORT folds constants itself when it loads the model.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # legacy (dynamo=False) exporter notice
        # the twin's per-channel affine is an inference BatchNormalization on purpose (inference_graph)
        warnings.filterwarnings("ignore", message=".*'batch_norm' is set to train=False.*")
        torch.onnx.export(graph, (dummy,), str(path), dynamo=False, opset_version=OPSET,
                          input_names=[INPUT_NAME], output_names=list(outputs), dynamic_axes=dynamic,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    verifier.eval()
    model = onnx.load(str(path))
    check_runtime_compatible(model, str(path))
    params = {k for k, _ in verifier.named_parameters()}
    names = {i.name for i in model.graph.initializer}
    if not params <= names:
        raise InputError(f"exported graph lost parameter names {sorted(params - names)[:3]}")
    set_metadata(model, inference_metadata(verifier, model_id=model_id, model_version=model_version))
    model.producer_name = "fedfs"
    model.producer_version = sdk_version
    model.doc_string = "fedfs verifier: embedding network" + (" + FedUV head σ(W g)" if len(outputs) > 1 else "")
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def onnx_vs_torch(verifier: torch.nn.Module, onnx_path: str | os.PathLike[str],
                  batch: np.ndarray | None = None, seed: int = 0) -> dict[str, Any]:
    """Max absolute difference per output between torch eager and ONNX Runtime (fp32).

    ``batch`` defaults to 4 random inputs in the contract's range [−1, 1].
    """
    from fedfs_sdk.runtime.onnx_backend import OnnxBackend

    s = int(verifier.backbone.input_size)
    if batch is None:
        batch = np.random.default_rng(seed).uniform(-1, 1, size=(4, 3, s, s)).astype(np.float32)
    backend = OnnxBackend(onnx_path, intra_op_threads=1)
    got = backend.run(batch)
    with torch.no_grad():
        ref = dict(zip(verifier_outputs(verifier), verifier.eval()(torch.from_numpy(batch))))
    return {name: float(np.abs(got[name] - ref[name].numpy()).max()) for name in ref}
