"""The :class:`SynthFaces` generator: settings, chunked rendering on any device, uint8 output."""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from fedfs_sdk.errors import InputError

from ..synth_domains import SynthDomain, get_domain
from .hashing import DOMAIN_NOISE, broadcast_pairs, hash_uniforms
from .painter import paint
from .params import NOISE_TILES

__all__ = ["SynthFaces", "RENDER_BYTES_PER_PIXEL", "CUDA_RENDER_BUDGET_BYTES"]

Keys = int | Sequence[int] | np.ndarray | torch.Tensor

RENDER_BYTES_PER_PIXEL = 432
"""Peak bytes the painter holds per image pixel (``S²``) while it draws a chunk — its
``[N, 1, S, S]`` / ``[N, 3, S, S]`` float32 temporaries and the 8× wider broadcast sums of
the JPEG-like stage: 428–431 measured on CPU at 32–112 px, with and without a domain
(``benchmarks/data_pipeline.py`` prints it). The CUDA chunk size is derived from it."""

CUDA_RENDER_BUDGET_BYTES = int(float(os.environ.get("FEDFS_RENDER_MEMORY_MB", 1024)) * (1 << 20))
"""Working memory one CUDA render chunk may take: 1 GiB by default (``FEDFS_RENDER_MEMORY_MB``),
~190 images at 112 px. The former default of 16M pixels per chunk (1,337 images at 112 px)
peaked near 7 GB — too much next to a training chunk."""

_CPU_CHUNK_PIXELS = 1 << 17    # ~128k pixels keep the CPU working set in cache (3× faster than large chunks)


class SynthFaces:
    """Deterministic procedural face identities (see :mod:`device_sim.synthfaces`).

    Args:
        seed: selects the universe of identities; the same ``(seed, identity, index)`` always
            gives the same image.
        image_size: output side ``S`` in pixels (≥ 16).
        difficulty: nuisance strength; 0 = clean frontal images, 1 = calibrated default.
        looks_per_identity: how many hair/beard/glasses "looks" an identity alternates between.
        chunk_size: images rendered per internal chunk; ``None`` picks ~128k pixels per chunk
            on CPU (keeps the working set in cache: 3× faster than large chunks) and, on CUDA,
            as many as fit :data:`CUDA_RENDER_BUDGET_BYTES` of working memory. It bounds peak
            memory and never changes pixels.
        num_threads: torch intra-op threads while rendering on CPU (restored afterwards);
            ``None`` keeps the process setting. The renderer is ~1,000 small elementwise ops
            per chunk, each an OpenMP barrier, so on a busy machine 1 thread can be much
            faster than several (benchmarks/synthfaces_speed.py measures both).
        domain: capture style, a preset name of ``synth_domains.DOMAINS`` or a ``SynthDomain``;
            ``None``/``"none"`` renders exactly as without one (and keeps the repr).
    """

    def __init__(self, seed: int = 0, image_size: int = 32, difficulty: float = 1.0,
                 looks_per_identity: int = 4, chunk_size: int | None = None,
                 num_threads: int | None = None, domain: str | SynthDomain | None = None) -> None:
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise InputError(f"seed must be a non-negative int, got {seed!r}")
        if not isinstance(image_size, (int, np.integer)) or image_size < 16:
            raise InputError(f"image_size must be an int ≥ 16, got {image_size!r}")
        if not (isinstance(difficulty, (int, float)) and 0.0 <= difficulty <= 3.0):
            raise InputError(f"difficulty must be a number in [0, 3], got {difficulty!r}")
        if looks_per_identity < 1:
            raise InputError(f"looks_per_identity must be ≥ 1, got {looks_per_identity}")
        self.seed = int(seed)
        self.image_size = int(image_size)
        self.difficulty = float(difficulty)
        self.looks_per_identity = int(looks_per_identity)
        if chunk_size is not None and chunk_size < 1:
            raise InputError(f"chunk_size must be ≥ 1, got {chunk_size}")
        self.chunk_size = chunk_size
        if num_threads is not None and num_threads < 1:
            raise InputError(f"num_threads must be ≥ 1, got {num_threads}")
        self.num_threads = num_threads
        self.domain = get_domain(domain)
        self._noise_bank: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        # the domain enters only when it changes pixels: repr keys fingerprints and caches
        dom = "" if self.domain.is_neutral() else f", domain={self.domain.key()!r}"
        return (f"SynthFaces(seed={self.seed}, image_size={self.image_size}, "
                f"difficulty={self.difficulty}, looks_per_identity={self.looks_per_identity}{dom})")

    # -- public API ---------------------------------------------------------------------------
    def render(self, identities: Keys, indices: Keys, device: str | torch.device | None = None) -> torch.Tensor:
        """Images ``[N, 3, S, S]`` float32 normalized ``(x − 127.5)/127.5`` on ``device``.

        ``identities`` and ``indices`` broadcast against each other (a scalar with a list
        renders many images of one identity). Pixels are quantized to uint8 levels first, so
        ``render`` equals ``fedfs_sdk.runtime.preprocess.preprocess(render_uint8(...), S)``.
        """
        return (self.render_u8(identities, indices, device).to(torch.float32) - 127.5) / 127.5

    def render_uint8(self, identities: Keys, indices: Keys) -> np.ndarray:
        """Images ``[N, S, S, 3]`` uint8 RGB (rendered on CPU), the layout image files use."""
        return self.render_u8(identities, indices, "cpu").permute(0, 2, 3, 1).numpy()

    def render_u8(self, identities: Keys, indices: Keys, device: str | torch.device | None = None) -> torch.Tensor:
        """Images ``[N, 3, S, S]`` uint8 on ``device`` (CPU by default), rendered there.

        The form a training device wants: 4× smaller than float32 and exact (normalize with
        ``(x − 127.5)/127.5`` where it is used). Rendered in chunks of :meth:`chunk_images`
        images; every image is the same in any batch, chunking and thread count on a
        device. CUDA and CPU agree to within rare ±1–2 level flips (transcendental functions
        differ in the last bit; ``tests/test_synthfaces.py::test_cuda_matches_cpu``).
        """
        ids, idx = broadcast_pairs(identities, indices)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        S = self.image_size
        out = torch.empty((ids.size, 3, S, S), dtype=torch.uint8, device=dev)
        if ids.size == 0:
            return out
        saved = torch.get_num_threads()
        scoped = self.num_threads is not None and dev.type == "cpu" and self.num_threads != saved
        if scoped:
            torch.set_num_threads(self.num_threads)
        try:
            with torch.no_grad():
                chunk = self.chunk_images(dev)
                for a in range(0, ids.size, chunk):
                    b = min(a + chunk, ids.size)
                    img = paint(self, ids[a:b], idx[a:b], dev)
                    out[a:b] = torch.round(img.clamp_(0.0, 1.0).mul_(255.0))
        finally:
            if scoped:
                torch.set_num_threads(saved)
        return out

    def chunk_images(self, device: str | torch.device = "cpu") -> int:
        """Images per internal render chunk on ``device`` (``chunk_size`` when set)."""
        if self.chunk_size:
            return self.chunk_size
        pixels = self.image_size ** 2
        if torch.device(device).type == "cuda":
            return max(1, CUDA_RENDER_BUDGET_BYTES // (RENDER_BYTES_PER_PIXEL * pixels))
        return max(1, _CPU_CHUNK_PIXELS // pixels)

    def noise_bank(self, dev: torch.device) -> torch.Tensor:
        """A bank of ``NOISE_TILES`` unit-variance noise tiles ``[T, 3, S, S]`` (from the seed),
        drawn on the CPU so that every device gets the same tiles."""
        key = str(dev)
        if key not in self._noise_bank:
            g = torch.Generator().manual_seed(int(hash_uniforms([DOMAIN_NOISE, self.seed], 1)[0, 0] * 2 ** 62))
            S = self.image_size
            self._noise_bank[key] = torch.randn((NOISE_TILES, 3, S, S), generator=g).to(dev)
        return self._noise_bank[key]
