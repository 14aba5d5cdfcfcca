"""ξ's trunk features of the *public* impostor set, computed once per process, and a verifier's
outputs on the set from them.

An enrollment scores every photo of the public set through the verifier it enrolls
(:func:`~fedfs_sdk.runtime.enrollment.enroll`: the operating point, how many public impostors τ
accepts) — 651 MobileFaceNet forwards at 112 px for LFW. Under ``scope="top"`` every candidate a
device can enroll (ξ, ``norm-adapt`` ξ, the global model, its personalized θ_c and the dual verifier)
runs on ξ's trunk, weight for weight (:func:`~fedfs_sdk.federation.device_features.has_xi_trunk`), so
those forwards differ only in the top. The trunk's output on the public photos depends on public
inputs only (ξ, the shipped set), so the devices of one process (the deployment rehearsal, a test
bench) share it: :data:`PUBLIC_TRUNK`, keyed by ξ's sha256 and the set's digest. Each verifier then
runs only its own top (:func:`outputs_on_trunk`), on its own device — θ_c's outputs are computed by
the device holding θ_c, from public features. Only the public set is ever given to it.

Bit-equal to the full forward: the features are computed in the chunks
:func:`~fedfs_sdk.runtime.impostor_outputs.impostor_outputs` runs (:data:`CHUNK` photos), and the top
is the backbone's own modules (tests/test_public_trunk.py).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..runtime.impostor_outputs import CHUNK
from ..runtime.shared_entries import SharedEntries


class PublicTrunk(SharedEntries):
    """Thread-safe, bounded store of ξ's trunk features of public impostor sets, one tuple of chunk
    tensors per (ξ's sha256, the set's name, chunk). Devices asking at once wait for the first."""

    def __init__(self, max_entries: int = 4) -> None:
        super().__init__(max_entries)

    def features(self, xi_sha: str, xi_net, public_set: str, public_batch: Callable[[], np.ndarray],
                 chunk: int = CHUNK) -> tuple:
        """ξ's trunk features of ``public_batch()`` — the public impostor set only, named by
        ``public_set`` (its digest and input size) — one tensor per chunk of ``chunk`` photos."""
        def compute() -> tuple:
            import torch

            from ..training.scope import Trunk

            batch, trunk = public_batch(), Trunk(xi_net.backbone).eval()
            with torch.inference_mode():
                return tuple(trunk(torch.from_numpy(np.ascontiguousarray(batch[a:a + chunk])))
                             for a in range(0, batch.shape[0], chunk))

        return self.entry((str(xi_sha), str(public_set), int(chunk)), compute)


PUBLIC_TRUNK = PublicTrunk()
"""The process's store (:class:`PublicTrunk`)."""


def outputs_on_trunk(backend: Any, features: tuple) -> tuple[dict[str, np.ndarray], ...]:
    """What :func:`~fedfs_sdk.runtime.impostor_outputs.impostor_outputs` returns for ``backend`` (a
    :class:`~fedfs_sdk.runtime.inference.TorchBackend` whose verifier runs on ξ's trunk), from ξ's
    trunk features of the set's chunks: only the verifier's top runs (read-only arrays)."""
    import torch

    from ..stats.in_domain import top_verifier

    top = top_verifier(backend.verifier).eval()
    out = []
    with torch.inference_mode():
        for f in features:
            o = {k: v.float().cpu().numpy() for k, v in backend._named(top(f.to(backend.device))).items()}
            for v in o.values():
                v.setflags(write=False)
            out.append(o)
    return tuple(out)


__all__ = ["PublicTrunk", "PUBLIC_TRUNK", "outputs_on_trunk"]
