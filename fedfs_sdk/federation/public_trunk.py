"""ξ's trunk features of the *public* impostor set, computed once per process, and a verifier backend
that scores those photos from them.

An enrollment scores every photo of the public set through the verifier it enrolls
(:func:`~fedfs_sdk.runtime.enrollment.enroll`: the operating point, how many public impostors τ
accepts) — 651 MobileFaceNet forwards at 112 px for LFW. Under ``scope="top"`` every candidate a
device can enroll (ξ, ``norm-adapt`` ξ, the global model, its personalized θ_c and the dual verifier)
runs on ξ's trunk, weight for weight (:func:`~fedfs_sdk.federation.device_features.has_xi_trunk`), so
those forwards differ only in the top. The trunk's output on the public photos depends on public
inputs only (ξ, the shipped set), so the devices of one process (the deployment rehearsal, a test
bench) share it: :data:`PUBLIC_TRUNK`. Each verifier then runs only its own top, on its own device —
θ_c's outputs are computed by the device holding θ_c, as before, from public features.

Only the public set enters :data:`PUBLIC_TRUNK` (:meth:`PublicTrunk.fill` is called with it and
nothing else), and :class:`PublicTrunkBackend` uses an entry only for a batch whose bytes hash to
it: any other photo — the owner's — runs the verifier's full forward, untouched.

Bit-equal to the full forward: the features are computed in the chunks
:func:`~fedfs_sdk.runtime.impostor_outputs.impostor_outputs` runs (:data:`CHUNK` photos), and the top
is the backbone's own modules (tests/test_public_trunk.py).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from ..runtime.impostor_outputs import CHUNK
from ..runtime.inference import TorchBackend, check_batch


def _digest(batch: np.ndarray) -> tuple:
    # SHA-1 (≈ 5× sha256's speed here) keys public photos in memory: nobody chooses colliding inputs,
    # and every device hashes each public chunk it scores
    b = np.ascontiguousarray(batch)
    return hashlib.sha1(b.tobytes()).hexdigest(), tuple(b.shape), str(b.dtype)


class PublicTrunk:
    """Thread-safe, bounded store of ξ's trunk features of public photo chunks, keyed by ξ's sha256
    and each chunk's content. Devices filling the same set at once wait for the first."""

    def __init__(self, max_chunks: int = 256) -> None:
        self.max_chunks = int(max_chunks)
        self._lock = threading.Lock()
        self._fill_lock = threading.Lock()
        self._chunks: OrderedDict[tuple, Any] = OrderedDict()
        self._filled: set[tuple] = set()
        self.fills = 0

    def fill(self, xi_sha: str, xi_net, public_set: str, public_batch: Callable[[], np.ndarray],
             chunk: int = CHUNK) -> None:
        """Compute (once) ξ's trunk features of ``public_batch()`` — the public impostor set only,
        named by ``public_set`` (its digest and input size) — in chunks of ``chunk`` photos."""
        import torch

        from ..training.scope import Trunk

        whole = (str(xi_sha), str(public_set), int(chunk))
        with self._lock:
            if whole in self._filled:
                return
        with self._fill_lock:                # one device computes, the others wait and find it filled
            if whole in self._filled:
                return
            public_batch = public_batch()
            trunk = Trunk(xi_net.backbone).eval()
            entries = []
            with torch.inference_mode():
                for a in range(0, public_batch.shape[0], chunk):
                    part = np.ascontiguousarray(public_batch[a:a + chunk])
                    entries.append(((str(xi_sha),) + _digest(part), trunk(torch.from_numpy(part))))
            with self._lock:
                for k, f in entries:
                    self._chunks[k] = f
                while len(self._chunks) > self.max_chunks:
                    self._chunks.popitem(last=False)
                self._filled.add(whole)
                self.fills += 1

    def lookup(self, xi_sha: str, batch: np.ndarray):
        """The stored features of exactly ``batch`` (one chunk), or None."""
        with self._lock:
            return self._chunks.get((str(xi_sha),) + _digest(batch))

    def clear(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._filled.clear()
            self.fills = 0


PUBLIC_TRUNK = PublicTrunk()
"""The process's store (:class:`PublicTrunk`)."""


class PublicTrunkBackend(TorchBackend):
    """``backend`` (a verifier on ξ's trunk) whose :meth:`run` takes a public chunk's trunk features
    from ``store`` and runs only the verifier's top; every other batch runs the full forward."""

    def __init__(self, backend: TorchBackend, xi_sha: str, store: PublicTrunk | None = None) -> None:
        from ..stats.in_domain import top_verifier

        self.__dict__.update(backend.__dict__)       # the same verifier, model id, outputs, chunking
        self._xi_sha = str(xi_sha)
        self._store = PUBLIC_TRUNK if store is None else store
        self._top = top_verifier(backend.verifier).eval()
        self.public_hits = 0

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        check_batch(batch, self.input_size)
        f = self._store.lookup(self._xi_sha, batch) if batch.shape[0] <= self.batch_size else None
        if f is None:
            return super().run(batch)
        self.public_hits += 1
        with self._torch.inference_mode():
            named = self._named(self._top(f.to(self.device)))
        return {k: v.float().cpu().numpy() for k, v in named.items()}


__all__ = ["PublicTrunk", "PUBLIC_TRUNK", "PublicTrunkBackend"]
