"""Inference backends: what turns a preprocessed batch into embeddings / FedUV outputs.

The enroll/verify API (``enrollment.py``) talks only to :class:`InferenceBackend`, so an
app can verify with :class:`TorchBackend` (research, simulation) or with the ONNX Runtime
backend (``fedfs_sdk.onnx_backend``, no torch needed on the phone).
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
    """

    input_size: int
    model_id: str
    outputs: tuple[str, ...]

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """``batch``: float32 ``[N, 3, S, S]`` from :func:`fedfs_sdk.preprocess.preprocess`.
        Returns ``{"embedding": [N, D]}`` plus ``"uv": σ(W g) [N, c]`` for FedUV models."""
        ...


def check_batch(batch: np.ndarray, input_size: int) -> np.ndarray:
    """Validate a preprocessed batch (shape, dtype, finiteness) with a clear error."""
    from .errors import InputError

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
    """Runs a :class:`fedfs_sdk.model.VerifierNet` (or any module returning
    ``(embedding,)`` / ``(embedding, uv)``) with torch on CPU or CUDA."""

    def __init__(self, verifier, model_id: str, device: str = "cpu", batch_size: int = 256) -> None:
        import torch

        self._torch = torch
        self.verifier = verifier.to(device).eval()
        self.device = device
        self.model_id = model_id
        self.input_size = int(verifier.input_size)
        self.batch_size = batch_size
        self.outputs = ("embedding", "uv") if getattr(verifier, "uv_head", None) is not None else ("embedding",)

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        torch = self._torch
        check_batch(batch, self.input_size)
        chunks: dict[str, list[np.ndarray]] = {k: [] for k in self.outputs}
        with torch.inference_mode():
            for s in range(0, batch.shape[0], self.batch_size):
                x = torch.from_numpy(batch[s:s + self.batch_size]).to(self.device)
                for name, t in zip(self.outputs, self.verifier(x)):
                    chunks[name].append(t.float().cpu().numpy())
        return {k: np.concatenate(v) for k, v in chunks.items()}
