"""Secure aggregation over the server's HTTP round protocol, device side (torch-free).

The server announces a secure round in the task (``task["secagg"]``: the agreed
:class:`~.params.SecAggParams` fields, this device's index in the round, the model layout's
digest). :class:`SecAggSession` then walks one :class:`~.device.SecAggDevice` through the
phases (docs/protocol.md, "Secure-aggregation rounds")::

    s = SecAggSession(client, task, identity=…, policy=…)
    s.advertise()                  # POST …/secagg/advertise     (c_pk, s_pk; /2: cert, signature)
    s.share_keys()                 # GET  …/secagg → roster; POST …/secagg/share-keys
    s.masked_input(update_body)    # GET  …/secagg → inbox;  PUT  …/secagg/masked-input (raw y_u)
    s.unmask()                     # /2: GET → consistency request; POST …/secagg/consistency; then
                                   # GET  …/secagg → request; POST …/secagg/unmask
    s.result()                     # GET  …/secagg until the round is done or failed

``task["secagg"]["protocol"]`` says ``fedfs-secagg/1`` (absent: the same) or ``/2``
(authenticated, :mod:`.auth`). The device's :class:`~.policy.DevicePolicy` decides which it
accepts and its floors; a secure round over ``http://`` to a host other than loopback is
refused (the transport is TLS's job: an on-path attacker sees and may alter plain HTTP).

The private keys, the self-mask seed and the shares others sent stay in the session's
memory: nothing of them is written to disk or sent except as the protocol says (a device
that restarts mid-round has dropped out of it). The update body is flattened here, in the
same order the server unflattens the sum: tensors sorted by name, each in C order. A round
whose model trains only its top (``scope="top"``) says ``task["secagg"]["tensors"] = "top"``:
only the tensors that scope trains enter the vector (:func:`secure_tensors`) — the trunk comes
back unchanged, so masking it would cost ~12× the bytes and PRG work of a MobileFaceNet's top
and tell the sum nothing.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import time
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

import numpy as np

from ...errors import InputError, ProtocolError
from . import messages as M
from .device import SecAggDevice
from .dp_input import DP_INPUT, DP_INPUT_V1, SecAggRoundLost, dp_input, dp_of_task, noise_request
from .encoding import FixedPoint
from .errors import SecAggError
from .identity import DeviceIdentity
from .params import PROTOCOL_V1, PROTOCOL_V2, SecAggParams
from .policy import ABSOLUTE_MIN_ROSTER, DevicePolicy
from .round_log import RoundLog
from ...training.top_keys import top_entries

TASK_FIELDS = ("dim", "threshold", "neighbours", "clip", "scale_bits", "max_devices", "max_samples",
               "min_devices", "layout_sha256")
DEVICE_MIN_DEVICES = ABSOLUTE_MIN_ROSTER
"""A device refuses a secure round with fewer devices than this: with 2, the other device
learns this one's update from the published sum (see :class:`DevicePolicy` for the setting)."""


TENSOR_SETS = ("all", "top")
"""What a secure weight round's vector holds (``task["secagg"]["tensors"]``, absent: ``all``):
every tensor of the model, or only those ``scope="top"`` trains
(:func:`fedfs_sdk.training.top_keys.is_top_key`)."""


def secure_tensors(fields: Mapping[str, Any]) -> str:
    """``task["secagg"]["tensors"]`` checked (absent: ``"all"``); :class:`InputError` otherwise."""
    which = fields.get("tensors", "all")
    if which not in TENSOR_SETS:
        raise InputError(f"task['secagg']['tensors'] is {which!r}; this device knows {TENSOR_SETS}")
    return str(which)


def select_tensors(arrays: Mapping[str, Any], tensors: str) -> dict[str, Any]:
    """The entries of ``arrays`` a round with ``tensors`` (:data:`TENSOR_SETS`) masks."""
    return top_entries(arrays) if tensors == "top" else dict(arrays)


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
    secure_tensors(fields)
    protocol = fields.get("protocol", PROTOCOL_V1)
    if protocol not in (PROTOCOL_V1, PROTOCOL_V2):
        raise InputError(f"task['secagg'] asks for protocol {protocol!r}; this device speaks {PROTOCOL_V1} and "
                         f"{PROTOCOL_V2}")
    try:
        fp = FixedPoint(clip=float(fields["clip"]), scale_bits=int(fields["scale_bits"]),
                        max_devices=int(fields["max_devices"]), max_samples=int(fields["max_samples"]))
        participants = fields.get("participants")
        return SecAggParams(round_id=int(round_id), dim=int(fields["dim"]), fixed_point=fp,
                            threshold=fields["threshold"], neighbours=fields["neighbours"],
                            min_devices=int(fields["min_devices"]),
                            participants=None if participants is None else int(participants),
                            authenticated=protocol == PROTOCOL_V2)
    except (TypeError, ValueError) as e:
        raise InputError(f"task['secagg'] is invalid: {e}") from None


def task_context(task: Mapping[str, Any]) -> bytes:
    """What else the round agreed on, bound into every signature of an authenticated round:
    the round, the global model (version and hash), the secure parameters (without this
    device's index) and the DP mechanism. The server computes the same from its task."""
    fields = {k: v for k, v in dict(task.get("secagg") or {}).items() if k != "device"}
    doc = {"round_id": task.get("round_id"), "model_version": task.get("model_version"),
           "model_sha256": task.get("model_sha256"), "secagg": fields, "dp": task.get("dp")}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def is_loopback(url: str) -> bool:
    """Whether ``url``'s host is this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_secure_transport(url: str) -> None:
    """Refuse a secure round over plain HTTP to another machine: :class:`SecAggRoundLost`
    (``insecure_transport``). On-path, plain HTTP lets anyone read and rewrite the protocol."""
    if urlsplit(url).scheme != "https" and not is_loopback(url):
        raise SecAggRoundLost("insecure_transport", f"secure aggregation over {url} is refused: plain http:// to a "
                              "host other than loopback; use https:// (fedfs serve --tls-cert/--tls-key)")


def flatten_update(body: bytes, layout_sha256: str | None = None, tensors: str = "all") -> tuple[np.ndarray, int]:
    """``(w as one float64 vector, |D_c|)`` of a ``fedfs-update/1`` body, the round's
    ``tensors`` (:data:`TENSOR_SETS`) sorted by name. With ``layout_sha256``, their layout must
    be the server's."""
    from safetensors.numpy import load

    from ..wire_format import parse_update_metadata, read_header

    meta = parse_update_metadata(read_header(body)[1])
    vec, _ = flatten_arrays(load(body), layout_sha256, "the trained update", tensors)
    return vec, meta.num_samples


def flatten_arrays(arrays: Mapping[str, np.ndarray], layout_sha256: str | None,
                   what: str, tensors: str = "all") -> tuple[np.ndarray, np.ndarray]:
    """``(one float64 vector, which of its entries are floating)`` of the round's ``tensors`` of
    ``arrays``, sorted by name — the secure layout both sides share; with ``layout_sha256`` it
    must be the round's."""
    arrays = select_tensors(arrays, tensors)
    if layout_sha256 is not None and layout_digest({k: a.shape for k, a in arrays.items()}) != layout_sha256:
        raise InputError(f"{what}'s tensors differ from the round's model layout (layout_sha256)")
    keys = sorted(arrays)
    vec = np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in keys])
    floating = np.concatenate([np.full(np.asarray(arrays[k]).size, np.issubdtype(np.asarray(arrays[k]).dtype,
                                                                                   np.floating)) for k in keys])
    return vec, floating


_AFTER = {"advertise": 0, "share_keys": 1, "masked": 2, "consistency": 3, "unmask": 4, "done": 5, "failed": 5,
          "closed": 5}


class SecAggSession:
    """One device's secure round over HTTP. ``client`` is a :class:`fedfs_sdk.federation.server_client.ServerClient`
    (its ``request`` retries transient failures); ``wait_timeout_s`` bounds each wait for the
    server to reach the next phase (the server's own phase deadlines normally end it first).
    ``identity`` (its certified key) and ``policy`` (its floors, the pinned CA) are the
    device's own; the round is refused here — nothing sent — if it falls below them."""

    def __init__(self, client: Any, task: Mapping[str, Any], *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, wait_timeout_s: float = 3600.0,
                 identity: DeviceIdentity | None = None, policy: DevicePolicy | None = None,
                 round_log: RoundLog | None = None, path: str | None = None, context: bytes | None = None,
                 dp: Any = None) -> None:
        """``dp``: a DP mechanism the caller applies itself (a statistics round's
        :class:`~fedfs_sdk.stats.privacy.StatsDp`, with ``noise_multiplier``), checked against this
        device's floors — ``min_noise_multiplier`` and a distributed-noise request — exactly as a
        weight round's ``task["dp"]``; such a session masks vectors (:meth:`masked_vector`) only."""
        fields = task.get("secagg")
        self.round_id = int(task["round_id"])
        if client is not None:
            check_secure_transport(client.base_url)
        self.params = params_from_task(self.round_id, fields or {})
        self.policy = policy if policy is not None else DevicePolicy()
        self.index = int(fields["device"])  # type: ignore[index]
        self.layout_sha256 = str(fields["layout_sha256"])  # type: ignore[index]
        self.tensors = secure_tensors(fields)  # type: ignore[arg-type]
        if self.tensors == "top" and (task.get("train") or {}).get("scope") != "top":
            # the server would keep the trunk this device trains: a task that contradicts itself
            raise SecAggRoundLost("refused", f"round {self.round_id} masks only the top's tensors but its task "
                                  "does not train with scope='top'")
        self.dp = dp_of_task(task)
        self.dp_kind = str(fields.get("input") or DP_INPUT) if self.dp is not None else None  # type: ignore[union-attr]
        self.caller_dp = dp is not None
        if dp is not None:
            if self.dp is not None:
                raise SecAggRoundLost("refused", "a round carries both DP-FedAvg parameters and a caller's DP mechanism")
            self.dp = dp
        where = f"device {self.index}, round {self.round_id}, DP"
        if self.dp_kind == DP_INPUT_V1 and not self.policy.allow_dp_clipped_delta:
            raise SecAggRoundLost("refused", f"{where}: the round asks for the older input {DP_INPUT_V1!r}, whose "
                                  "weight word reveals Σ min(n, ŵ); this device masks only "
                                  f"{DP_INPUT!r} (allow_dp_clipped_delta to accept it)")
        self._local(self.policy.check_dp_floor, self.dp, where)
        noise = fields.get("dp_noise") if isinstance(fields, Mapping) else None   # type: ignore[union-attr]
        self.noise_min_inputs = noise_request(noise, self.dp, self.params.fixed_point.max_devices)
        revoked = self._local(self._revocations, fields, round_log)
        self.device = self._local(SecAggDevice, self.params, self.index, identity=identity, policy=self.policy,
                                  context=task_context(task) if context is None else context,
                                  round_log=round_log, revoked=revoked)
        if self.noise_min_inputs and self.params.participants is not None:   # t is known before the roster
            self._local(self._check_noise, self.params.threshold_for(self.params.participants))
        self.client, self._sleep, self._clock, self.wait_timeout_s = client, sleep, clock, wait_timeout_s
        self.path = path if path is not None else f"/v1/rounds/{self.round_id}/secagg"
        self.bytes_sent = 0
        self.bytes_received = 0

    def _revocations(self, fields: Mapping[str, Any], log: RoundLog | None) -> frozenset[str]:
        """The operator's revocation list of an authenticated round, checked (:mod:`.revocation`);
        its number is remembered so an older list is refused later."""
        from .revocation import check_task_list

        if not self.params.authenticated:
            return frozenset()
        ca = self.policy.ca
        scope = ca.key_id if ca is not None else ""
        crl = check_task_list(fields.get("revocations"), ca, self.policy.max_revocation_age_s,
                              log.last_revocation(scope) if log is not None else 0,
                              f"device {self.index}, round {self.round_id}, revocations")
        if crl is None:
            return frozenset()
        if log is not None:
            log.note_revocation(scope, crl.number)
        return frozenset(crl.revoked)

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

    def _local(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SecAggError as e:        # this device refuses what the server sent: it drops out
            raise SecAggRoundLost(e.reason, str(e)) from e

    def _check_noise(self, t: int) -> None:
        assert self.dp is not None and self.noise_min_inputs is not None
        self.policy.check_dp_noise(float(self.dp.noise_multiplier), self.noise_min_inputs, t,
                                   f"device {self.index}, round {self.round_id}, DP noise")

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
        if self.caller_dp:
            raise InputError("this session's DP is the caller's (a statistics round): it masks vectors, not updates")
        w, n = flatten_update(update_body, self.layout_sha256, self.tensors)
        if self.dp is not None:
            if reference is None:
                raise InputError("a DP secure round masks w_c − w: pass the round's global model as reference")
            if self.noise_min_inputs:        # the threshold the roster gave: a sum of t inputs may be unmasked
                self._local(self._check_noise, self.device._t)
            w, n = dp_input(w, n, reference, self.dp, self.layout_sha256, self.noise_min_inputs,
                            self.dp_kind or DP_INPUT, self.tensors)
        return self.masked_vector(w, n)

    def masked_vector(self, w: np.ndarray, n: int) -> dict[str, Any]:
        """Mask the vector ``w`` (weighed ``n``) and upload ``y_u``: :meth:`masked_input` after its
        flattening, and the statistics round's packed contribution (:mod:`fedfs_sdk.stats.client`)."""
        inbox = self._wait_for("inbox", "masked")
        if self.caller_dp and self.noise_min_inputs:     # the roster's threshold: a sum of t may be unmasked
            self._local(self._check_noise, self.device._t)
        msg = self._local(self.device.masked_input, inbox, w, n)
        y = msg["y"]
        self.bytes_sent += len(y)
        r = self.client.request("PUT", f"{self.path}/masked-input", content=y,
                                content_type="application/octet-stream")
        receipt = r.json()
        if receipt.get("sha256") != hashlib.sha256(y).hexdigest():
            raise ProtocolError("the server's receipt does not match the masked vector sent")
        return {**receipt, "num_samples": n, "n_clipped": self.device.n_clipped}

    def consistency(self) -> dict[str, Any] | None:
        """Authenticated rounds: sign the survivor set the server shows (once); None otherwise."""
        if not self.params.authenticated or self.device._u3 is not None:
            return None
        request = self._wait_for("consistency_request", "consistency")
        return self._post("consistency", self._local(self.device.consistency, request))

    def unmask(self) -> dict[str, Any]:
        """Answer the unmask request (authenticated rounds: after the consistency check)."""
        self.consistency()
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
           "TENSOR_SETS", "secure_tensors", "select_tensors",
           "DP_INPUT", "DP_INPUT_V1", "dp_of_task", "dp_input", "task_context", "check_secure_transport", "is_loopback"]
