"""Fixed-point encoding of float model weights into the ring Z_{2^64} for secure aggregation.

Masking works on integers modulo 2^64 (numpy ``uint64`` arithmetic wraps exactly there), so
a float vector ``w`` of a device with ``n`` samples is clipped to ``[-R, R]``, multiplied by
``n`` (weighted FedAvg: the server needs ``Σ n·w`` and ``Σ n``) and by ``2^scale_bits``,
rounded, and stored in two's complement. ``n`` itself travels as one extra word.

Range and error (stated in docs/privacy.md): with at most ``max_devices`` inputs of at most
``max_samples`` samples each, ``|Σ n·w·2^s| ≤ max_devices·max_samples·R·2^s`` must stay below
``2^63`` so the signed sum never wraps; :class:`FixedPoint` checks this when it is built.
Each device rounds once (error ≤ ½·2^-s in ``n·w``), so the decoded weighted mean is within
``½·2^-s·(number of devices)/Σn ≤ ½·2^-s`` of the exact mean of the clipped values, before
the final float32 cast.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...errors import InputError
from .errors import RoundFailedError


@dataclass(frozen=True)
class FixedPoint:
    """The encoding's parameters; defaults give 63 bits of headroom for 16,384 devices of up to
    65,536 samples each, weights clipped to ±256, resolution 2^-24 ≈ 6e-8."""

    clip: float = 256.0
    scale_bits: int = 24
    max_devices: int = 1 << 14
    max_samples: int = 1 << 16

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise InputError(f"clip range must be a positive finite number, got {self.clip!r}")
        if not 0 <= self.scale_bits <= 52:
            raise InputError(f"scale_bits must be in [0, 52], got {self.scale_bits}")
        if self.max_devices < 1 or self.max_samples < 1:
            raise InputError("max_devices and max_samples must be ≥ 1")
        need = self.headroom_bits()
        if need > 63:
            raise InputError(
                f"fixed-point sum needs {need:.1f} bits (max_devices={self.max_devices} × "
                f"max_samples={self.max_samples} × clip={self.clip} × 2^{self.scale_bits}) but the "
                f"signed 64-bit ring holds 63: lower scale_bits, clip, max_samples or max_devices")
        # n·w·2^s must be exact in float64 before rounding (53-bit mantissa)
        if math.log2(self.max_samples * self.clip) + self.scale_bits > 52:
            raise InputError("max_samples × clip × 2^scale_bits exceeds float64 precision (2^52)")

    @property
    def scale(self) -> float:
        return float(1 << self.scale_bits)

    def headroom_bits(self) -> float:
        """Bits the largest possible sum needs (excluding the sign bit)."""
        return math.log2(self.max_devices * self.max_samples * self.clip) + self.scale_bits

    def error_bound(self) -> float:
        """Bound on |decoded mean − exact weighted mean of the clipped inputs| (before float32)."""
        return 0.5 / self.scale

    def encode(self, w: np.ndarray, n_samples: int) -> tuple[np.ndarray, int]:
        """Return ``(words, n_clipped)``: ``d + 1`` uint64 words (``round(n·clip(w)·2^s)`` then
        ``n``) and how many coordinates were outside ``[-clip, clip]``."""
        w = np.asarray(w)
        if w.ndim != 1 or w.size == 0:
            raise InputError(f"update must be a non-empty 1-D vector, got shape {w.shape}")
        if not np.issubdtype(w.dtype, np.floating):
            raise InputError(f"update must be floating point, got dtype {w.dtype}")
        if isinstance(n_samples, bool) or not isinstance(n_samples, (int, np.integer)) \
                or not 1 <= int(n_samples) <= self.max_samples:
            raise InputError(f"n_samples must be an int in [1, {self.max_samples}], got {n_samples!r}")
        w64 = w.astype(np.float64, copy=False)
        if not np.all(np.isfinite(w64)):
            raise InputError(f"update has {int(np.sum(~np.isfinite(w64)))} NaN/Inf values")
        n_clipped = int(np.count_nonzero(np.abs(w64) > self.clip))
        q = np.rint(np.clip(w64, -self.clip, self.clip) * (float(n_samples) * self.scale))
        out = np.empty(w.size + 1, dtype=np.uint64)
        out[:-1] = q.astype(np.int64).view(np.uint64)   # two's complement = value mod 2^64
        out[-1] = int(n_samples)
        return out, n_clipped

    def decode_sum(self, total: np.ndarray, n_inputs: int, dtype: type = np.float32) -> tuple[np.ndarray, int]:
        """Turn the unmasked sum of ``n_inputs`` encodings into ``(weighted mean, Σn)`` (float32, or
        ``dtype``: the statistics round keeps float64, its sums need the fixed point's full resolution).

        Raises :class:`RoundFailedError` when the sum cannot be a sum of valid encodings —
        what a corrupted masked vector or share yields with overwhelming probability — so a
        wrong sum is never returned silently."""
        total = np.asarray(total, dtype=np.uint64)
        n_total = int(total[-1])
        if not n_inputs <= n_total <= n_inputs * self.max_samples:
            raise RoundFailedError(
                f"unmasked sample count {n_total} is impossible for {n_inputs} inputs of 1..{self.max_samples} "
                "samples: a masked vector or a share was corrupted")
        signed = total[:-1].view(np.int64).astype(np.float64)
        limit = n_total * self.clip * self.scale + 0.5 * n_inputs
        bad = int(np.count_nonzero(np.abs(signed) > limit))
        if bad:
            raise RoundFailedError(
                f"{bad} coordinates of the unmasked sum exceed Σn·clip·2^s = {limit:.3g}: "
                "a masked vector or a share was corrupted")
        return (signed / (self.scale * n_total)).astype(dtype), n_total
