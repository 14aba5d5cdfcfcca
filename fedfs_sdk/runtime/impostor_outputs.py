"""A model's outputs on a public impostor set, computed once per (model, set) in a process.

An enrollment records how many of the public impostors its threshold accepts
(``meta["operating_point"]``): :func:`~fedfs_sdk.runtime.enrollment.enroll` scores every photo of the
set (651 MobileFaceNet forwards at 112 px for LFW) against the new template. The template is the
device's own, but the *outputs* ``g(x)`` of the impostor photos depend only on the model and the set.
When the model is public — ξ, ``norm-adapt`` ξ (ξ refitted to the *published* embedding sum) or the
global model, the same bytes on every device — those outputs are public too, and many devices
sharing one process (the deployment rehearsal, a test bench) need compute them only once:
:data:`PUBLIC_OUTPUTS`. A device's own model (``θ_c``, the personalized verifier) never enters it:
its outputs are computed by that device, as before.

The outputs are computed in the chunks :func:`~fedfs_sdk.runtime.enrollment.enroll` uses, so the
scores a cached device gets are the scores it would have computed itself (same model, same inputs,
same chunking: the same floating-point operations).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import InputError
from .inference import InferenceBackend
from .shared_entries import SharedEntries

CHUNK = 64
"""Photos per forward when scoring impostors (what ``enroll`` used before there was a cache)."""


def impostor_batch(backend: InferenceBackend, impostors: Any) -> np.ndarray:
    """``impostors`` as the float32 batch ``backend`` runs (an :class:`ImpostorSet` or a batch)."""
    batch = impostors.batch(backend.input_size) if hasattr(impostors, "batch") else np.asarray(impostors, np.float32)
    if batch.ndim != 4 or batch.shape[0] == 0:
        raise InputError(f"impostors must be an ImpostorSet or a float32 [N, 3, S, S] batch, got shape {list(batch.shape)}")
    return batch


def impostor_outputs(backend: InferenceBackend, impostors: Any, chunk: int = CHUNK) -> tuple[dict[str, np.ndarray], ...]:
    """``backend.run`` of the impostor photos, one dict per chunk of ``chunk`` photos (read-only arrays)."""
    batch = impostor_batch(backend, impostors)
    out = []
    for a in range(0, batch.shape[0], chunk):
        o = backend.run(batch[a:a + chunk])
        for v in o.values():
            v.setflags(write=False)      # shared between devices: nobody may change them
        out.append(o)
    return tuple(out)


def _set_key(impostors: Any) -> str:
    if hasattr(impostors, "digest"):
        return impostors.digest()
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(impostors, dtype=np.float32).tobytes()).hexdigest()


class PublicOutputs(SharedEntries):
    """Thread-safe, bounded cache of a *public* model's :func:`impostor_outputs`.

    Keyed by the backend's ``model_id`` (a hash of every weight and the architecture), its class,
    outputs and input size, and the set's digest: a changed model or set is a new entry. Devices
    asking for the same entry at once wait for the first to compute it (no duplicate work). Only
    models every device holds byte for byte may be passed (the caller says which: see module doc)."""

    def __init__(self, max_entries: int = 8) -> None:
        super().__init__(max_entries)

    def key(self, backend: InferenceBackend, impostors: Any, chunk: int = CHUNK) -> tuple:
        return (str(backend.model_id), type(getattr(backend, "verifier", backend)).__name__,
                tuple(getattr(backend, "outputs", ())), int(backend.input_size), _set_key(impostors), int(chunk))

    def get(self, backend: InferenceBackend, impostors: Any, chunk: int = CHUNK,
            compute: Callable[[], tuple[dict[str, np.ndarray], ...]] | None = None) -> tuple[dict[str, np.ndarray], ...]:
        """The entry, computed on a miss by ``compute`` (the same outputs by another route, e.g. from
        shared trunk features: :mod:`fedfs_sdk.federation.public_trunk`) or :func:`impostor_outputs`."""
        return self.entry(self.key(backend, impostors, chunk),
                          compute if compute is not None else lambda: impostor_outputs(backend, impostors, chunk))


PUBLIC_OUTPUTS = PublicOutputs()
"""The process's cache (:class:`PublicOutputs`)."""

__all__ = ["CHUNK", "impostor_batch", "impostor_outputs", "PublicOutputs", "PUBLIC_OUTPUTS"]
