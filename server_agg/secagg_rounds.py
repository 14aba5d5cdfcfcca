"""Secure-aggregation rounds: the server side of :mod:`fedfs_sdk.federation.secagg` behind the HTTP round.

A round opened with ``policy.secure_aggregation`` carries a :class:`SecAggRound`: the
participants get indices 1…k (sorted by device id; the Shamir x-coordinates), the task says
``secagg`` with the agreed parameters, and the round walks the four phases of Bonawitz et al.
2017 (§4): advertise keys → share keys → masked input → unmasking — and, when the policy pins
the operator CA (``secagg_ca``), the authenticated protocol ``fedfs-secagg/2``: signed
advertisements and a consistency check before unmasking. A phase closes as soon as
every device expected in it answered, or at its deadline (whoever has not answered then has
dropped); ``finalize`` yields only ``Σ n·w / Σ n`` of the survivors, which the coordinator
publishes as the next version.

Crash safety: at the round's opening and every phase close the whole state —
:func:`fedfs_sdk.federation.secagg.snapshot` of the core (public keys, routed ciphertexts until
delivered, the running sum of masked vectors, unmask shares), the roster / unmask request
and the phase deadline — is written atomically to ``STATE/secagg/rNNNNNN.json``; every message
accepted in between is appended to that snapshot's journal (:mod:`.secagg_journal`) before the
device is answered, and a masked input rewrites the running sum's file. A restarted server
restores the snapshot, replays its journal and goes on from there (a phase whose deadline
passed while it was down closes at the first tick); an unreadable file fails the round
cleanly. No file holds an individual update in the clear: only masked vectors, and only summed.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fedfs_sdk.errors import FedFSError, InputError
from fedfs_sdk.federation.dp import NOISE_TAIL   # the range of distributed noise, shared with statistics rounds
from fedfs_sdk.federation.secagg import (PROTOCOL_V2, CaPublicKey, RoundFailedError, SecAggError, SecAggParams,
                                         SecAggResult, SecAggServer, default_threshold, from_json, restore, snapshot,
                                         to_json)
from fedfs_sdk.federation.secagg import messages as M
from fedfs_sdk.federation.secagg.dp_input import DP_INPUT
from fedfs_sdk.federation.secagg.http_device import layout_digest, params_from_task, task_context

from .errors import ApiError, Forbidden
from .secagg_journal import Journal
from .store import atomic_write

log = logging.getLogger("fedfs.server")

FORMAT = "fedfs-secagg-round/1"
STEP_OF = {"advertise": M.ADVERTISE, "share-keys": M.SHARE_KEYS, "consistency": M.CONSISTENCY,
           "unmask": M.UNMASK_SHARES}
"""URL step → the core message type it carries (``masked-input`` is a raw body)."""


def secagg_error(e: SecAggError) -> ApiError:
    """The core's error as the HTTP refusal it maps to (status and reason tag kept)."""
    err = ApiError(str(e)[:500], code=e.reason)
    err.status = e.status
    return err


def dp_min_inputs(policy: Any, n_devices: int) -> int:
    """``m``, the fewest masked inputs a distributed-noise DP round unmasks: the Shamir
    threshold of the full sample (the configured one under full SecAgg, else ⌊2k/3⌋ + 1), at
    least ``secagg_min_devices``. Each device adds ``N(0, σ²C²/m)``, so any sum the server is
    allowed to unmask carries at least ``σ²C²``."""
    t = policy.secagg_threshold if policy.secagg_threshold is not None and policy.secagg_neighbours is None \
        else default_threshold(max(1, int(n_devices)))
    return max(int(policy.secagg_min_devices), min(int(t), max(1, int(n_devices))))


def dp_range(policy: Any, min_inputs: int) -> float:
    """The fixed-point range of a distributed-noise DP round: ``C + 8·σC/√m`` (a device encodes
    ``w_k·Δ + z``, ``|w_k·Δ_i| ≤ C``, ``z ~ N(0, σ²C²/m)``)."""
    c, s = float(policy.max_update_norm), float(policy.dp_noise_multiplier)
    return c + NOISE_TAIL * s * c / float(min_inputs) ** 0.5


def ca_of(policy: Any) -> CaPublicKey | None:
    """The operator CA the policy pins (``secagg_ca``): rounds then run ``fedfs-secagg/2``."""
    raw = getattr(policy, "secagg_ca", None)
    return CaPublicKey.from_json(raw) if raw else None


def task_fields(policy: Any, shapes: Mapping[str, Sequence[int]], n_devices: int,
                tensors: str = "all") -> dict[str, Any]:
    """``task["secagg"]`` of a new round (without the per-device ``device`` index); ``shapes``
    are the masked tensors' (``tensors``: :func:`secure_layout`)."""
    dim = int(sum(int(np.prod(s)) for s in shapes.values()))
    fields = {"dim": dim, "threshold": policy.secagg_threshold, "neighbours": policy.secagg_neighbours,
              "clip": float(policy.secagg_clip), "scale_bits": int(policy.secagg_scale_bits),
              "max_devices": max(1, int(n_devices)), "max_samples": int(policy.max_num_samples),
              "min_devices": int(policy.secagg_min_devices), "layout_sha256": layout_digest(
                  {k: tuple(int(x) for x in s) for k, s in shapes.items()}),
              "phase_timeout_s": float(policy.secagg_phase_timeout_s)}
    if tensors != "all":       # absent means all: rounds of devices that predate the field are unchanged
        fields["tensors"] = tensors
    ca = ca_of(policy)
    if ca is not None:       # authenticated: t against the invited n, signed keys, consistency check
        fields.update(protocol=PROTOCOL_V2, participants=max(2, int(n_devices)), ca_key_id=ca.key_id)
    if getattr(policy, "dp", False):
        # DP-FedAvg: devices mask w_k·clip_C(Δ) with weight word 1 (fedfs_sdk.federation.secagg.dp_input):
        # every coordinate is within ±C, so C is the range; the weight words sum to the survivor count,
        # so nobody learns Σ min(n_k, ŵ).
        fields.update(clip=float(policy.max_update_norm), max_samples=1, input=DP_INPUT)
        if getattr(policy, "dp_noise", "central") == "distributed":
            m = dp_min_inputs(policy, n_devices)
            fields.update(clip=dp_range(policy, m), dp_noise={"min_inputs": m})
    return fields


def revoked_serials(fields: Mapping[str, Any]) -> frozenset[str]:
    """The certificate serials of the round's revocation list (its advertisements are refused)."""
    doc = fields.get("revocations")
    return frozenset(str(s) for s in doc.get("revoked", [])) if isinstance(doc, Mapping) else frozenset()


class SecAggRound:
    """The protocol state of one open secure round, persisted at ``path``."""

    def __init__(self, round_id: int, participants: Sequence[str], fields: Mapping[str, Any], path: Path,
                 opened: float, masked_deadline: float, context: bytes = b"", ca: CaPublicKey | None = None) -> None:
        self.round_id = round_id
        self.participants = sorted(participants)
        self.index = {d: i + 1 for i, d in enumerate(self.participants)}
        self.fields = dict(fields)
        self.params: SecAggParams = params_from_task(round_id, fields)
        self.context, self.ca = context, ca
        self.phase_timeout = float(fields["phase_timeout_s"])
        noise = fields.get("dp_noise")
        self.min_inputs = int(noise["min_inputs"]) if noise else 0   # distributed DP noise: see dp_min_inputs
        self.masked_deadline = masked_deadline
        self.deadline = opened + self.phase_timeout     # of the current phase
        self.path = path
        self.srv = SecAggServer(self.params, context=context, ca=ca)
        self.srv.revoked = revoked_serials(fields)
        self.roster: dict[str, Any] | None = None
        self.request: dict[str, Any] | None = None           # the unmask request
        self.check: dict[str, Any] | None = None             # the consistency request (authenticated rounds)
        self._sum_saved = -1          # masked inputs in the sum file last written
        self._generation = 0          # full snapshots written; the journal of accepted messages since is …j<gen>
        self._journal: Journal | None = None

    # ---- persistence -------------------------------------------------------------------
    def _sum_path(self, count: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.sum{count}")

    def _journal_path(self, generation: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.j{generation}")

    def _write_sum(self) -> str | None:
        """The running sum of masked vectors (8·(dim + 1) bytes) in its own raw file named by the
        number of inputs in it, written only when a masked input changed it (overwriting a stale
        file of a crash); its name, or None before the first masked input."""
        if self.srv._sum is None:
            return None
        count = len(self.srv._masked_from)
        if count != self._sum_saved:
            atomic_write(self._sum_path(count), self.srv._sum.astype("<u8").tobytes())
            self._sum_saved = count
        return self._sum_path(count).name

    def save(self) -> None:
        """Write the whole state atomically as a new generation: the sum file first, then the
        JSON naming it and the generation's (empty) journal; older sum and journal files are
        deleted after the JSON that replaces them. Called when the round opens and at each phase
        close; in between, :meth:`receive` appends to the journal (:mod:`.secagg_journal`)."""
        core = snapshot(self.srv)
        core.pop("sum")
        core["sum_file"] = self._write_sum()
        if self._journal is not None:
            self._journal.close()
        self._generation += 1
        journal = self._journal_path(self._generation)
        journal.unlink(missing_ok=True)          # a crashed earlier save may have left one: it holds nothing of this
        self._journal = Journal(journal)
        doc = {"format": FORMAT, "round_id": self.round_id, "participants": self.participants,
               "fields": self.fields, "deadline": self.deadline, "masked_deadline": self.masked_deadline,
               "roster": self.roster, "request": self.request, "check": self.check, "core": core,
               "context": self.context.decode("latin-1"), "ca": self.ca.to_json() if self.ca else None,
               "journal": journal.name}
        atomic_write(self.path, to_json(doc).encode())
        for old in self.path.parent.glob(f"{self.path.stem}.*"):
            if old != self.path and old.name not in (core["sum_file"], journal.name):
                old.unlink(missing_ok=True)

    def _record(self, idx: int, step: str, payload: bytes) -> None:
        """Make an accepted message durable: its record in the journal; a masked input's sum file
        first (the record then carries no payload), the previous sum file deleted after it."""
        assert self._journal is not None, "save() opens the journal"
        if step == "masked-input":
            previous = self._sum_saved
            self._write_sum()
            self._journal.append(step, idx)
            if previous >= 0 and previous != self._sum_saved:
                self._sum_path(previous).unlink(missing_ok=True)
        else:
            self._journal.append(step, idx, payload)

    @classmethod
    def load(cls, path: Path, round_id: int) -> "SecAggRound":
        """Restore a saved round; :class:`InputError` if the file is missing or not this round's."""
        try:
            doc = from_json(path.read_bytes())
        except (OSError, SecAggError) as e:
            raise InputError(f"secure round {round_id}: cannot read {path}: {e}") from None
        if doc.get("format") != FORMAT or doc.get("round_id") != round_id:
            raise InputError(f"{path} is not the state of secure round {round_id}")
        try:
            ca = CaPublicKey.from_json(doc["ca"]) if doc.get("ca") else None
            r = cls(round_id, doc["participants"], doc["fields"], path, 0.0, float(doc["masked_deadline"]),
                    str(doc.get("context", "")).encode("latin-1"), ca)
            r.deadline = float(doc["deadline"])
            r.roster, r.request, r.check = doc["roster"], doc["request"], doc.get("check")
            core = dict(doc["core"])
            name = core.pop("sum_file")
            core["sum"] = (path.parent / name).read_bytes() if name is not None else None
            if core["sum"] is not None and len(core["sum"]) != 8 * r.params.words:
                raise ValueError(f"{name} has {len(core['sum'])} bytes, expected {8 * r.params.words}")
            r.srv = restore(r.params, core, context=r.context, ca=ca)
            r.srv.revoked = revoked_serials(r.fields)
            r._sum_saved = len(r.srv._masked_from) if name is not None else -1
            if doc.get("journal"):       # absent in files of servers before the journal: nothing to replay
                r._generation = int(str(doc["journal"]).rsplit(".j", 1)[1])
                r._journal = Journal(r._journal_path(r._generation))
                r._replay(r._journal)
            else:
                r.save()
        except (KeyError, TypeError, ValueError, OSError, SecAggError, FedFSError) as e:
            raise InputError(f"secure round {round_id}: {path} is corrupt: {e}") from None
        return r

    def _replay(self, journal: Journal) -> None:
        """Apply the journal's messages again; a masked input's is the sum file of its count."""
        masked: set[int] = set()
        for step, idx, payload in journal.records():
            if step == "masked-input":
                masked.add(idx)
            else:
                self.srv.receive(self._message(idx, step, payload))
        if masked:
            self.srv._masked_from |= masked
            count = len(self.srv._masked_from)
            raw = self._sum_path(count).read_bytes()
            if len(raw) != 8 * self.params.words:
                raise ValueError(f"{self._sum_path(count).name} has {len(raw)} bytes, expected {8 * self.params.words}")
            self.srv._sum = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
            self._sum_saved = count

    # ---- devices -----------------------------------------------------------------------
    def index_of(self, device_id: str) -> int:
        i = self.index.get(device_id)
        if i is None:
            raise Forbidden(f"device {device_id} was not sampled for round {self.round_id}", code="not_selected")
        return i

    def can_join(self, device_id: str) -> bool:
        """Whether ``device_id`` may still start the round (advertise its keys)."""
        i = self.index.get(device_id)
        return i is not None and self.srv.step == "advertise" and i not in self.srv.pks

    def task_for(self, device_id: str) -> dict[str, Any]:
        return {**self.fields, "device": self.index_of(device_id)}

    def receive(self, device_id: str, step: str, payload: bytes) -> dict[str, Any]:
        """One device message for URL step ``step`` (``advertise``, ``share-keys``,
        ``masked-input``, ``unmask``); a 4xx :class:`ApiError` leaves the round unchanged."""
        idx = self.index_of(device_id)
        msg = self._message(idx, step, payload)
        try:
            self.srv.receive(msg)
        except SecAggError as e:
            raise secagg_error(e) from None
        self._record(idx, step, payload)
        return {"round_id": self.round_id, "device": idx, "step": step, "phase": self.srv.step}

    def _message(self, idx: int, step: str, payload: bytes) -> Any:
        """The protocol message of device ``idx``'s request body for URL step ``step``."""
        if step == "masked-input":
            return {"type": M.MASKED_INPUT, "round": self.round_id, "device": idx, "y": payload}
        try:
            msg = from_json(payload)
        except SecAggError as e:
            raise secagg_error(e) from None
        if msg.get("type") != STEP_OF[step] and msg.get("type") in STEP_OF.values():
            raise ApiError(f"a {msg.get('type')!r} message was sent to the {step!r} endpoint",
                           code="wrong_endpoint")
        if msg.get("device") != idx:
            raise Forbidden(f"the message names device {msg.get('device')!r}; this token is device {idx} "
                            f"of round {self.round_id}", code="device_mismatch")
        return msg

    def view(self, device_id: str, poll_s: float) -> dict[str, Any]:
        """What ``device_id`` needs now: the phase, its deadline, and the roster (share-keys
        phase), its share inbox (masked phase, if it is in U2) or the unmask request (unmask
        phase, if it is a survivor)."""
        idx = self.index_of(device_id)
        s = self.srv
        out: dict[str, Any] = {"round_id": self.round_id, "phase": s.step, "device": idx,
                               "deadline": self.deadline, "retry_after": poll_s}
        if s.step == "share_keys" and idx in s.pks:
            out["roster"] = self.roster
        elif s.step == "masked" and idx in s.u2:
            out["inbox"] = s.inbox(idx)
        elif s.step == "consistency" and idx in s.u3:
            out["consistency_request"] = self.check
        elif s.step == "unmask" and idx in s.u4:
            out["unmask_request"] = self.request
        members = {"share_keys": s.pks, "masked": s.u2, "consistency": s.u3, "unmask": s.u4}.get(s.step)
        if members is not None and idx not in members:
            out["dropped"] = True            # it missed an earlier phase: nothing more for it this round
        return json.loads(to_json(out))

    def counts(self) -> dict[str, Any]:
        s = self.srv
        return {"phase": s.step, "protocol": self.params.protocol, "advertised": len(s.pks),
                "shared": len(s.u2) if s.u2 else len(s.cts), "masked": len(s._masked_from),
                "signed": len(s.csigs), "unmasked": len(s._unmasked_from),
                "dropped": {k: len(v) for k, v in s.dropped.items()}, "threshold": s.threshold or None}

    # ---- phases ------------------------------------------------------------------------
    def _complete(self) -> bool:
        s = self.srv
        if s.step == "advertise":
            return len(s.pks) == len(self.participants)
        if s.step == "share_keys":
            return len(s.cts) == len(s.pks)
        if s.step == "masked":
            return len(s._masked_from) == len(s.u2)
        if s.step == "consistency":
            return len(s.csigs) == len(s.u3)
        return s.step == "unmask" and len(s._unmasked_from) == len(s.u4)

    def advance(self, now: float) -> SecAggResult | None:
        """Close every phase that is complete or past its deadline; the result once the sum is
        unmasked. :class:`RoundFailedError` when too few devices are left (state saved)."""
        s = self.srv
        try:
            while s.step in ("advertise", "share_keys", "masked", "consistency", "unmask") and (
                    self._complete() or now >= self.deadline):
                if s.step == "advertise":
                    self.roster = s.close_advertise()
                    self.deadline = now + self.phase_timeout
                elif s.step == "share_keys":
                    s.close_share_keys()
                    self.deadline = max(self.masked_deadline, now + self.phase_timeout)   # training happens now
                elif s.step == "masked":
                    if len(s._masked_from) < self.min_inputs:   # before any mask is removed
                        raise RoundFailedError(
                            f"round {self.round_id} failed: only {len(s._masked_from)} masked inputs, a distributed-"
                            f"noise DP round needs {self.min_inputs} (each carries 1/{self.min_inputs} of the "
                            f"noise variance); nothing was unmasked", survivors=len(s._masked_from),
                            threshold=self.min_inputs)
                    out = s.close_masked()
                    if s.step == "consistency":
                        self.check = out
                    else:
                        self.request = out
                    self.deadline = now + self.phase_timeout
                elif s.step == "consistency":
                    self.request = s.close_consistency()
                    self.deadline = now + self.phase_timeout
                else:
                    return s.finalize()
                self.save()
                log.info("secure phase closed", extra={"fields": {"round_id": self.round_id, **self.counts()}})
        except RoundFailedError:
            self.save()
            raise
        return None

    def remove(self) -> None:
        if self._journal is not None:
            self._journal.close()
        self.path.unlink(missing_ok=True)
        for p in self.path.parent.glob(f"{self.path.stem}.*"):
            p.unlink(missing_ok=True)


__all__ = ["SecAggRound", "task_fields", "secagg_error", "STEP_OF", "ca_of", "task_context"]
