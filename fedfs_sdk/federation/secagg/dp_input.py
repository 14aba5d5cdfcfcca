"""What a device masks in a DP-FedAvg secure round (McMahan et al. 2018 under Bonawitz et al. 2017).

The task says ``secagg.input``:

* ``dp_weighted_delta`` (what servers send): the device masks ``w_k·clip_C(w_c − w)`` with
  weight word 1, ``w_k = min(n/ŵ, 1)``. The unmasked sum is ``Σ w_k Δ_k`` — exactly what the
  fixed-denominator estimator needs — and its weight word is the number of inputs, which the
  server knows anyway: no one learns ``Σ min(n_k, ŵ)``, the users' (capped) sample counts,
  which no DP accountant covers.
* ``dp_clipped_delta`` (fedfs before this version): ``n'·clip_C(Δ)`` with weight ``n' =
  min(n, ŵ)``; the server learns ``Σ n'``. Still understood, so a device works with an older
  server; a new server never asks for it.

Distributed noise (``secagg.dp_noise = {"min_inputs": m}``): each device adds
``z ~ N(0, σ²C²/m)`` per floating coordinate (OS-seeded), so any sum of ``≥ m`` inputs holds
at least the central mechanism's ``N(0, σ²C²)`` — and the device's policy refuses ``m`` above
the round's threshold (the server may unmask a sum of ``t`` inputs) and ``σ`` below its floor.
"""
from __future__ import annotations

import secrets
from typing import Any, Mapping

import numpy as np

from ...errors import InputError, ProtocolError

DP_INPUT = "dp_weighted_delta"
"""``task["secagg"]["input"]`` of a DP-FedAvg secure round: mask ``w_k·clip_C(Δ)``, weight 1."""
DP_INPUT_V1 = "dp_clipped_delta"
"""The previous DP input: mask ``n'·clip_C(Δ)`` with weight ``n' = min(n, ŵ)`` (reveals ``Σn'``)."""
DP_INPUTS = (DP_INPUT, DP_INPUT_V1)


class SecAggRoundLost(ProtocolError):
    """This device is out of the secure round: the server moved past a phase without it, the
    round failed, or the device refused an unsafe request. ``code`` / ``reason`` say which."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"secure round lost ({code}): {reason}")
        self.code, self.reason = code, reason


def dp_of_task(task: Mapping[str, Any]) -> Any:
    """The round's :class:`~fedfs_sdk.federation.dp.DpParams` if it is a DP secure round (None if plain);
    :class:`SecAggRoundLost` when ``task["dp"]`` and ``task["secagg"]["input"]`` disagree —
    masking weights in a DP round would publish an unclipped, unweighted sum."""
    fields = task.get("secagg") or {}
    wanted = fields.get("input") if isinstance(fields, Mapping) else None
    if not task.get("dp"):
        if wanted is not None:
            raise SecAggRoundLost("refused", f"the round asks for secure input {wanted!r} without DP parameters")
        return None
    if wanted not in DP_INPUTS:
        raise SecAggRoundLost("refused", f"a DP round's secure input must be {DP_INPUT!r}, the server says "
                              f"{wanted!r}: this device will not mask unclipped weights")
    from ..dp import DpParams

    return DpParams.from_json(task["dp"])


def noise_request(noise: Any, dp: Any, max_devices: int) -> int | None:
    """``m`` of a distributed-noise DP round (``task["secagg"]["dp_noise"]["min_inputs"]``);
    a device refuses one that is not an int in [2, max_devices] or comes without DP."""
    if noise is None:
        return None
    m = noise.get("min_inputs") if isinstance(noise, Mapping) else None
    if dp is None or isinstance(m, bool) or not isinstance(m, int) or not 2 <= m <= max_devices:
        raise SecAggRoundLost("refused", f"invalid distributed-noise request {noise!r} (needs DP and 2 ≤ min_inputs "
                              f"≤ {max_devices})")
    return m


def dp_input(w: np.ndarray, n: int, reference: bytes, dp: Any, layout_sha256: str | None = None,
             noise_min_inputs: int | None = None, kind: str = DP_INPUT, tensors: str = "all") -> tuple[np.ndarray, int]:
    """``(vector, weight)`` for the encoder in a DP secure round: ``Δ = clip_C(w_c − w)`` over the
    floating tensors (0 on integer buffers, which DP-FedAvg does not average), then
    ``(w_k·Δ + z, 1)`` for ``dp_weighted_delta`` or ``(Δ + ŵ·z/n', n')`` for ``dp_clipped_delta``
    — either way the unmasked sum carries ``Σ w_k Δ_k + Σ z`` in units of the estimator. ``w`` and
    the reference are the round's ``tensors`` (``"top"``: the trunk, whose ``Δ`` is 0, is not sent;
    the clip norm is the same).

    The clip runs here in float64 on the flattened update (the body holds ``w + Δ`` rounded to
    float32, whose ``Δ`` may sit an ulp above ``C``): this is the device's own guarantee, the
    server cannot check it under secure aggregation (docs/privacy.md)."""
    from safetensors.numpy import load

    from ..dp import clip_delta
    from .http_device import flatten_arrays

    if kind not in DP_INPUTS:
        raise InputError(f"unknown DP secure input {kind!r}")
    flat_ref, floating = flatten_arrays(load(reference), layout_sha256, "the reference model", tensors)
    if flat_ref.size != w.size:
        raise InputError(f"the global model has {flat_ref.size} values, the update {w.size}")
    delta = np.where(floating, np.asarray(w, dtype=np.float64) - flat_ref, 0.0)
    clipped, _, _ = clip_delta(delta, dp.clip)
    capped = min(int(n), int(dp.weight_cap))
    z = 0.0
    if noise_min_inputs:
        std = dp.noise_multiplier * dp.clip / float(noise_min_inputs) ** 0.5
        z = np.random.default_rng(secrets.randbits(128)).normal(0.0, std, size=clipped.size) * floating
    if kind == DP_INPUT:
        return clipped * (capped / float(dp.weight_cap)) + z, 1
    return clipped + z * (dp.weight_cap / capped), capped


__all__ = ["DP_INPUT", "DP_INPUT_V1", "DP_INPUTS", "SecAggRoundLost", "dp_of_task", "noise_request", "dp_input"]
