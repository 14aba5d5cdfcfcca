"""A round's upload awaiting the server's receipt, in a device state: ``pending.json`` (round id,
model version, hashes, the participation record), ``pending.update.safetensors`` (the body sent:
``w_c``, ``|D_c|``) and ``pending.personal.safetensors`` (the ``θ_c`` it produced). ``θ_c``
becomes the device's ``personal`` weights only once the server accepted the upload
(:meth:`DevicePending.commit_pending`); every step is safe to repeat after a crash.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from ..fileio import fsync_directory
from .device_folder import DeviceFolder, DeviceStateError
from .wire_format import sha256_hex

PENDING_FORMAT = "fedfs-pending-update/1"
_PENDING_FILES = ("pending.json", "pending.update.safetensors", "pending.personal.safetensors")


class DevicePending(DeviceFolder):
    """The pending round of a :class:`~.device_folder.DeviceFolder` (a part of
    :class:`~fedfs_sdk.federation.device_state.DeviceState`)."""

    def save_pending(self, round_id: int, model_version: int, body: bytes, personal: bytes | None,
                     record: Mapping[str, Any]) -> None:
        """Keep a trained round — the upload ``body`` and the new ``θ_c`` (safetensors bytes,
        or None) — until the server has accepted the upload. ``pending.json`` is written
        last: it is what makes the pending round exist."""
        self.discard_pending()
        self._write("pending.update.safetensors", body)
        if personal is not None:
            self._write("pending.personal.safetensors", personal)
        self._write("pending.json", json.dumps({
            "format": PENDING_FORMAT, "round_id": int(round_id), "model_version": int(model_version),
            "body_sha256": sha256_hex(body), "personal_sha256": sha256_hex(personal) if personal is not None else None,
            "record": dict(record)}, sort_keys=True).encode())

    def has_pending(self) -> bool:
        """Whether a trained round waits for the server's receipt (cheap: no file is read)."""
        return (self.path / "pending.json").is_file()

    def _pending_meta(self) -> dict[str, Any] | None:
        """``pending.json`` checked, or None; removes leftovers of an interrupted
        :meth:`save_pending` (files without ``pending.json``)."""
        d = self._read_json("pending.json")
        if d is None:
            leftovers = [n for n in _PENDING_FILES[1:] if (self.path / n).exists()]
            if leftovers:
                self._remove(*leftovers)
            return None
        if d.get("format") != PENDING_FORMAT or not isinstance(d.get("round_id"), int):
            raise DeviceStateError(f"{self.path / 'pending.json'} is malformed")
        return d

    def pending(self) -> dict[str, Any] | None:
        """The pending round (``round_id``, ``model_version``, ``body``, ``record`` …), or None;
        the body is checked against its recorded hash."""
        d = self._pending_meta()
        if d is None:
            return None
        p = self.path / "pending.json"
        body = self._read_bytes("pending.update.safetensors")
        if body is None or sha256_hex(body) != d.get("body_sha256"):
            raise DeviceStateError(f"{self.path / 'pending.update.safetensors'} is missing or does not match {p}")
        return {**d, "body": body}

    def commit_pending(self, receipt: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """The server accepted the pending upload: record the round, make the pending θ_c the
        device's ``personal`` weights, drop the pending files. Safe to repeat after a crash at
        any point (the round is recorded once; θ_c is moved once). Returns the record.
        The upload body is not read again: the server has it."""
        pend = self._pending_meta()
        if pend is None:
            return None
        record = dict(pend.get("record") or {})
        if receipt is not None:
            record.update(sha256=receipt.get("sha256"), duplicate=bool(receipt.get("duplicate")))
        self.record_round(record)
        want = pend.get("personal_sha256")
        if want is not None:
            staged = self.path / "pending.personal.safetensors"
            data = self._read_bytes("pending.personal.safetensors")
            if data is not None:
                if sha256_hex(data) != want:
                    raise DeviceStateError(f"{staged} does not match {self.path / 'pending.json'}")
                try:
                    os.replace(staged, self.path / "personal.safetensors")
                    fsync_directory(self.path)
                except OSError as e:
                    raise DeviceStateError(f"cannot install θ_c in {self.path}: {e.strerror or e}") from None
            elif sha256_hex(self._read_bytes("personal.safetensors") or b"") != want:
                raise DeviceStateError(f"{staged} is missing: the pending θ_c is lost")
        self._remove("pending.json", "pending.update.safetensors")
        return record

    def discard_pending(self) -> None:
        """Forget a pending round the server did not (and will not) accept: θ_c stays as it was."""
        self._remove(*_PENDING_FILES)


__all__ = ["DevicePending", "PENDING_FORMAT"]
