"""Secure aggregation over the server's HTTP round protocol, device side (torch-free).

The server announces a secure round in the task (``task["secagg"]``: the agreed
:class:`~.params.SecAggParams` fields, this device's index in the round, the model layout's
digest). :class:`SecAggSession` then walks one :class:`~.device.SecAggDevice` through the
phases (docs/protocol.md, "Secure-aggregation rounds")::

    s = SecAggSession(client, task)
    s.advertise()                  # POST …/secagg/advertise     (c_pk, s_pk)
    s.share_keys()                 # GET  …/secagg → roster; POST …/secagg/share-keys
    s.masked_input(update_body)    # GET  …/secagg → inbox;  PUT  …/secagg/masked-input (raw y_u)
    s.unmask()                     # GET  …/secagg → request; POST …/secagg/unmask
    s.result()                     # GET  …/secagg until the round is done or failed

The private keys, the self-mask seed and the shares others sent stay in the session's
memory: nothing of them is written to disk or sent except as the protocol says (a device
that restarts mid-round has dropped out of it). The update body is flattened here, in the
same order the server unflattens the sum: tensors sorted by name, each in C order.
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable, Mapping

import numpy as np

from ...errors import InputError, ProtocolError
from . import messages as M
from .device import SecAggDevice
from .encoding import FixedPoint
from .errors import SecAggError
from .params import SecAggParams

TASK_FIELDS = ("dim", "threshold", "neighbours", "clip", "scale_bits", "max_devices", "max_samples",
               "min_devices", "layout_sha256")
DP_INPUT = "dp_clipped_delta"
"""``task["secagg"]["input"]`` of a DP-FedAvg secure round: the device masks its clipped,
weighted update ``Δ`` (not its weights); absent = the weights ``w`` (plain FedAvg)."""
DEVICE_MIN_DEVICES = 3
"""A device refuses a secure round whose server allows fewer devices than this: with 2, the
other device learns this one's update from the published sum."""


def layout_digest(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """SHA-256 of the sorted ``(name, shape)`` list: both sides flatten the same layout."""
    text = json.dumps([[k, [int(s) for s in shapes[k]]] for k in sorted(shapes)], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def params_from_task(round_id: int, fields: Mapping[str, Any]) -> SecAggParams:
    """The round's :class:`SecAggParams` from ``task["secagg"]`` (what server and device agree on);
    :class:`InputError` naming a missing or invalid field."""
    if not isinstance(fields, Mapping):
        raise InputError("task['secagg'] must be an object")
    missing = [k for k in TASK_FIELDS if k not in fields]
    if missing:
        raise InputError(f"task['secagg'] lacks {missing}")
    try:
        fp = FixedPoint(clip=float(fields["clip"]), scale_bits=int(fields["scale_bits"]),
                        max_devices=int(fields["max_devices"]), max_samples=int(fields["max_samples"]))
        return SecAggParams(round_id=int(round_id), dim=int(fields["dim"]), fixed_point=fp,
                            threshold=fields["threshold"], neighbours=fields["neighbours"],
                            min_devices=int(fields["min_devices"]))
    except (TypeError, ValueError) as e:
        raise InputError(f"task['secagg'] is invalid: {e}") from None


def flatten_update(body: bytes, layout_sha256: str | None = None) -> tuple[np.ndarray, int]:
    """``(w as one float64 vector, |D_c|)`` of a ``fedfs-update/1`` body, tensors sorted by
    name. With ``layout_sha256``, the body's layout must be the server's model layout."""
    from safetensors.numpy import load

    from ..wire_format import parse_update_metadata, read_header

    meta = parse_update_metadata(read_header(body)[1])
    vec, _ = flatten_arrays(load(body), layout_sha256, "the trained update")
    return vec, meta.num_samples


def flatten_arrays(arrays: Mapping[str, np.ndarray], layout_sha256: str | None,
                   what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(one float64 vector, which of its entries are floating)`` of ``arrays``, tensors sorted
    by name — the secure layout both sides share; with ``layout_sha256`` it must be the round's."""
    if layout_sha256 is not None and layout_digest({k: a.shape for k, a in arrays.items()}) != layout_sha256:
        raise InputError(f"{what}'s tensors differ from the round's model layout (layout_sha256)")
    keys = sorted(arrays)
    vec = np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in keys])
    floating = np.concatenate([np.full(np.asarray(arrays[k]).size, np.issubdtype(np.asarray(arrays[k]).dtype,
                                                                                   np.floating)) for k in keys])
    return vec, floating


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
    if wanted != DP_INPUT:
        raise SecAggRoundLost("refused", f"a DP round's secure input must be {DP_INPUT!r}, the server says "
                              f"{wanted!r}: this device will not mask unclipped weights")
    from ..dp import DpParams

    return DpParams.from_json(task["dp"])


def dp_input(w: np.ndarray, n: int, reference: bytes, dp: Any, layout_sha256: str | None = None,
             noise_min_inputs: int | None = None) -> tuple[np.ndarray, int]:
    """What a device masks in a DP-FedAvg secure round: ``(Δ, n')`` as the encoder's
    ``(vector, weight)`` with ``Δ = clip_C(w_c − w)`` over the floating tensors (0 on integer
    buffers, which DP-FedAvg does not average) and ``n' = min(n, ŵ)``. The encoder multiplies
    by ``n'``, so the unmasked sum is ``Σ n'_k Δ_k = ŵ · Σ w_k Δ_k`` with McMahan et al.'s
    weights ``w_k = min(n_k/ŵ, 1) = n'_k/ŵ`` — integers, which the ring holds exactly.

    The clip runs here in float64 on the flattened update (the body holds ``w + Δ`` rounded to
    float32, whose ``Δ`` may sit an ulp above ``C``): this is the device's own guarantee, the
    server cannot check it under secure aggregation (docs/privacy.md).

    Distributed noise (``noise_min_inputs = m``): the device adds ``z ~ N(0, σ²C²/m)`` per
    floating coordinate as ``Δ + ŵ·z/n'`` (so its masked ``n'·v`` carries ``ŵ·z``); any sum of
    ≥ m inputs then holds at least the central mechanism's ``N(0, σ²C²)`` in ``Σ w_k Δ_k``."""
    from safetensors.numpy import load

    from ..dp import clip_delta

    flat_ref, floating = flatten_arrays(load(reference), layout_sha256, "the reference model")
    if flat_ref.size != w.size:
        raise InputError(f"the global model has {flat_ref.size} values, the update {w.size}")
    delta = np.where(floating, np.asarray(w, dtype=np.float64) - flat_ref, 0.0)
    clipped, _, _ = clip_delta(delta, dp.clip)
    weight = min(int(n), int(dp.weight_cap))
    if noise_min_inputs:
        import secrets

        std = dp.noise_multiplier * dp.clip / float(noise_min_inputs) ** 0.5
        z = np.random.default_rng(secrets.randbits(128)).normal(0.0, std, size=clipped.size) * floating
        clipped = clipped + z * (dp.weight_cap / weight)
    return clipped, weight


def _min_inputs(noise: Any, dp: Any, max_devices: int) -> int | None:
    """``m`` of a distributed-noise DP round (``task["secagg"]["dp_noise"]["min_inputs"]``);
    a device refuses one that is not an int in [2, max_devices] or comes without DP."""
    if noise is None:
        return None
    m = noise.get("min_inputs") if isinstance(noise, Mapping) else None
    if dp is None or isinstance(m, bool) or not isinstance(m, int) or not 2 <= m <= max_devices:
        raise SecAggRoundLost("refused", f"invalid distributed-noise request {noise!r} (needs DP and 2 ≤ min_inputs "
                              f"≤ {max_devices})")
    return m


class SecAggRoundLost(ProtocolError):
    """This device is out of the secure round: the server moved past a phase without it, the
    round failed, or the device refused an unsafe request. ``code`` / ``reason`` say which."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"secure round lost ({code}): {reason}")
        self.code, self.reason = code, reason


_AFTER = {"advertise": 0, "share_keys": 1, "masked": 2, "unmask": 3, "done": 4, "failed": 4, "closed": 4}


class SecAggSession:
    """One device's secure round over HTTP. ``client`` is a :class:`fedfs_sdk.federation.server_client.ServerClient`
    (its ``request`` retries transient failures); ``wait_timeout_s`` bounds each wait for the
    server to reach the next phase (the server's own phase deadlines normally end it first)."""

    def __init__(self, client: Any, task: Mapping[str, Any], *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, wait_timeout_s: float = 3600.0) -> None:
        fields = task.get("secagg")
        self.round_id = int(task["round_id"])
        self.params = params_from_task(self.round_id, fields or {})
        if self.params.min_devices < DEVICE_MIN_DEVICES:
            raise SecAggRoundLost("refused", f"the server allows secure rounds of {self.params.min_devices} "
                                  f"devices; this device needs at least {DEVICE_MIN_DEVICES}")
        self.index = int(fields["device"])  # type: ignore[index]
        self.layout_sha256 = str(fields["layout_sha256"])  # type: ignore[index]
        self.device = SecAggDevice(self.params, self.index)
        self.client, self._sleep, self._clock, self.wait_timeout_s = client, sleep, clock, wait_timeout_s
        self.dp = dp_of_task(task)
        noise = fields.get("dp_noise") if isinstance(fields, Mapping) else None   # type: ignore[union-attr]
        self.noise_min_inputs = _min_inputs(noise, self.dp, self.params.fixed_point.max_devices)
        self.path = f"/v1/rounds/{self.round_id}/secagg"
        self.bytes_sent = 0
        self.bytes_received = 0

    # ---- transport ---------------------------------------------------------------------
    def _post(self, step: str, msg: dict[str, Any]) -> dict[str, Any]:
        body = M.to_json(msg).encode()
        self.bytes_sent += len(body)
        r = self.client.request("POST", f"{self.path}/{step}", content=body, content_type="application/json")
        return r.json()

    def view(self) -> dict[str, Any]:
        """The server's view of the round for this device (phase, and the message it waits for)."""
        r = self.client.request("GET", self.path)
        self.bytes_received += len(r.content)
        return M.from_json(r.content)

    def _wait_for(self, key: str, phase: str) -> dict[str, Any]:
        t0 = self._clock()
        while True:
            v = self.view()
            if key in v:
                return v[key]
            at = str(v.get("phase"))
            if v.get("dropped") or at in ("done", "failed", "closed") or _AFTER.get(at, 0) > _AFTER[phase]:
                raise SecAggRoundLost("secagg_dropped" if at != "failed" else "round_failed",
                                      f"round {self.round_id} is at {at!r} and has no {key} for device "
                                      f"{self.index}" + (f": {v['reason']}" if v.get("reason") else ""))
            if self._clock() - t0 > self.wait_timeout_s:
                raise ProtocolError(f"round {self.round_id}: no {key} within {self.wait_timeout_s:.0f} s")
            self._sleep(min(max(float(v.get("retry_after") or 0.5), 0.05), 10.0))

    def _local(self, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        try:
            return fn(*args)
        except SecAggError as e:        # this device refuses what the server sent: it drops out
            raise SecAggRoundLost(e.reason, str(e)) from e

    # ---- the phases --------------------------------------------------------------------
    def advertise(self) -> dict[str, Any]:
        return self._post("advertise", self._local(self.device.advertise))

    def share_keys(self) -> dict[str, Any]:
        roster = self._wait_for("roster", "share_keys")
        return self._post("share-keys", self._local(self.device.share_keys, roster))

    def masked_input(self, update_body: bytes, reference: bytes | None = None) -> dict[str, Any]:
        """Mask the update ``n·w`` (and ``n``) and upload ``y_u`` as a raw body; the receipt.

        In a DP-FedAvg round (``task["dp"]``) the device masks ``n'·clip_C(w_c − w)`` and
        ``n' = min(n, ŵ)`` instead (:func:`dp_input`), so ``reference`` — the round's global
        model (its checkpoint bytes) — is required."""
        w, n = flatten_update(update_body, self.layout_sha256)
        if self.dp is not None:
            if reference is None:
                raise InputError("a DP secure round masks w_c − w: pass the round's global model as reference")
            w, n = dp_input(w, n, reference, self.dp, self.layout_sha256, self.noise_min_inputs)
        inbox = self._wait_for("inbox", "masked")
        msg = self._local(self.device.masked_input, inbox, w, n)
        y = msg["y"]
        self.bytes_sent += len(y)
        r = self.client.request("PUT", f"{self.path}/masked-input", content=y,
                                content_type="application/octet-stream")
        receipt = r.json()
        if receipt.get("sha256") != hashlib.sha256(y).hexdigest():
            raise ProtocolError("the server's receipt does not match the masked vector sent")
        return {**receipt, "num_samples": n, "n_clipped": self.device.n_clipped}

    def unmask(self) -> dict[str, Any]:
        request = self._wait_for("unmask_request", "unmask")
        return self._post("unmask", self._local(self.device.unmask, request))

    def result(self) -> dict[str, Any]:
        """Wait for the round's end: the view with ``phase`` ``done`` (``result_version``) or
        :class:`SecAggRoundLost` if it failed."""
        t0 = self._clock()
        while True:
            v = self.view()
            if v.get("phase") == "done":
                return v
            if v.get("phase") in ("failed", "closed"):
                raise SecAggRoundLost("round_failed", str(v.get("reason") or "the secure round failed"))
            if self._clock() - t0 > self.wait_timeout_s:
                raise ProtocolError(f"round {self.round_id} did not finish within {self.wait_timeout_s:.0f} s")
            self._sleep(min(max(float(v.get("retry_after") or 0.5), 0.05), 10.0))


__all__ = ["SecAggSession", "SecAggRoundLost", "params_from_task", "flatten_update", "layout_digest", "TASK_FIELDS",
           "DP_INPUT", "dp_of_task", "dp_input"]
