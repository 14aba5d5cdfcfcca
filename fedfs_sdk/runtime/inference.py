"""Inference backends: what turns a preprocessed batch into embeddings / FedUV outputs.

The enroll/verify API (``enrollment.py``) talks only to :class:`InferenceBackend`, so an
app can verify with :class:`TorchBackend` (research, simulation) or with the ONNX Runtime
backend (``fedfs_sdk.runtime.onnx_backend``, no torch needed on the phone).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class InferenceBackend(Protocol):
    """A verifier model behind a numpy interface.

    Attributes:
        input_size: square side ``S`` of the expected input.
        model_id: identifies the weights; enrollments are bound to it (thresholds never
            carry over between models).
        outputs: names ``run`` returns: ``("embedding",)`` or ``("embedding", "uv")``.

    Optional: ``alignment`` — the face crop the model was trained on (``"dlib-chip"`` for
    ``dlib-resnet``), which enroll / verify then cut whatever their ``detect_face`` says; a
    backend without it (or None) leaves the choice to ``detect_face``.
    """

    input_size: int
    model_id: str
    outputs: tuple[str, ...]

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """``batch``: float32 ``[N, 3, S, S]`` from :func:`fedfs_sdk.runtime.preprocess.preprocess`.
        Returns ``{"embedding": [N, D]}`` plus ``"uv": σ(W g) [N, c]`` for FedUV models."""
        ...


def check_batch(batch: np.ndarray, input_size: int) -> np.ndarray:
    """Validate a preprocessed batch (shape, dtype, finiteness) with a clear error."""
    from ..errors import InputError

    if not isinstance(batch, np.ndarray):
        raise InputError(f"batch must be a numpy array, got {type(batch).__name__}")
    if batch.dtype != np.float32:
        raise InputError(f"batch must be float32 (see preprocess()), got dtype {batch.dtype}")
    if batch.ndim != 4 or batch.shape[1] != 3 or batch.shape[2:] != (input_size, input_size):
        raise InputError(f"batch must have shape [N, 3, {input_size}, {input_size}], got {list(batch.shape)}")
    if not np.isfinite(batch).all():
        raise InputError("batch contains NaN or Inf")
    return batch


class TorchBackend:
    """Runs a :class:`fedfs_sdk.nn.model.VerifierNet` or :class:`fedfs_sdk.nn.model.FaceNet` with
    torch on CPU or CUDA.

    Outputs are taken by name: a ``FaceOutputs`` (FaceNet) gives ``embedding`` and ``uv``
    (its ``projection`` is a training head and is ignored); a tuple (VerifierNet, or any
    module returning ``(embedding,)`` / ``(embedding, uv)``) is read by position; a dict by
    key. ``outputs`` holds ``"uv"`` when the module has a ``uv_head``."""

    def __init__(self, verifier, model_id: str, device: str = "cpu", batch_size: int = 256) -> None:
        import torch

        from ..errors import InputError

        if not isinstance(verifier, torch.nn.Module):
            raise InputError(f"TorchBackend needs a torch module (VerifierNet or FaceNet), got {type(verifier).__name__}")
        self._torch = torch
        self.verifier = verifier.to(device).eval()
        self.device = device
        self.model_id = model_id
        self.input_size = int(verifier.input_size)
        self.alignment: str | None = getattr(getattr(verifier, "backbone", verifier), "face_alignment", None)
        self.batch_size = batch_size
        names = getattr(verifier, "output_names", None)     # VerifierNet / DualVerifierNet say it
        if names is None:                                   # a FaceNet: its head (if any) is its uv output
            names = ("embedding", "uv") if getattr(verifier, "uv_head", None) is not None else ("embedding",)
        self.outputs = tuple(names)

    def _named(self, out) -> dict:
        from ..errors import InputError

        torch = self._torch
        if isinstance(out, torch.Tensor):
            named = {"embedding": out}
        elif isinstance(out, tuple) and hasattr(out, "_fields"):          # FaceOutputs and other named tuples
            named = out._asdict()
        elif isinstance(out, dict):
            named = dict(out)
        elif isinstance(out, (tuple, list)):
            if len(out) not in (1, 2):
                raise InputError(f"{type(self.verifier).__name__} returned {len(out)} outputs; a verifier returns "
                                 "(embedding,) or (embedding, uv)")
            named = dict(zip(("embedding", "uv"), out))
        else:
            raise InputError(f"{type(self.verifier).__name__} returned {type(out).__name__}; expected a tensor, "
                             "a tuple (embedding[, uv]), a dict or FaceOutputs")
        for name in self.outputs:
            if named.get(name) is None:
                raise InputError(f"{type(self.verifier).__name__} returned no {name!r} output")
        return {k: named[k] for k in self.outputs}

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        torch = self._torch
        check_batch(batch, self.input_size)
        chunks: dict[str, list[np.ndarray]] = {k: [] for k in self.outputs}
        with torch.inference_mode():
            for s in range(0, batch.shape[0], self.batch_size):
                x = torch.from_numpy(batch[s:s + self.batch_size]).to(self.device)
                for name, t in self._named(self.verifier(x)).items():
                    chunks[name].append(t.float().cpu().numpy())
        return {k: np.concatenate(v) for k, v in chunks.items()}
