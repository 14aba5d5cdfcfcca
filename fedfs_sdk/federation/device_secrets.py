"""The device key and the FedUV secrets of a device state: ``r_u`` (device-random message bits) and
the codeword ``v_u = C(b_u ‖ r_u)`` (FedUV Alg. 2), kept AES-GCM encrypted in ``secrets.json``
under the device key (the app's, else ``enrollment.key``); the associated data binds the file's
name, its format and the device id. An old plaintext ``secrets.json`` is encrypted on first read.
"""
from __future__ import annotations

import base64
import json
import os
from typing import Any, Mapping

import numpy as np

from ..runtime.codes import make_codeword
from ..errors import CodeError, InputError
from .device_folder import DeviceFolder, DeviceKeyError, DeviceStateError, _check_key, _json_object

SECRETS_FORMAT = "fedfs-device-secrets/1"


class DeviceSecrets(DeviceFolder):
    """The device key, ``r_u`` and the codeword ``v_u`` of a :class:`~.device_folder.DeviceFolder`
    (a part of :class:`~fedfs_sdk.federation.device_state.DeviceState`)."""

    def use_key(self, key: bytes) -> None:
        """Encrypt ``secrets.json`` under ``key`` (the app's enrollment key) instead of
        ``enrollment.key``. Must be the same key on every run."""
        self._key = _check_key(key, "the device key")

    def _secrets_key(self) -> bytes:
        return self._key if self._key is not None else self.enrollment_key()

    def _aad(self) -> bytes:
        info = self.info
        if info is None:
            raise DeviceStateError("the device has no id yet: register first")
        return f"{SECRETS_FORMAT}\0secrets.json\0{info.device_id}".encode()

    def _store_secrets(self, secrets_: Mapping[str, Any]) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        nonce = os.urandom(12)      # 96-bit random nonce, fresh for every write
        ct = AESGCM(self._secrets_key()).encrypt(nonce, json.dumps(dict(secrets_)).encode(), self._aad())
        self._write("secrets.json", json.dumps({
            "format": SECRETS_FORMAT, "cipher": "AES-GCM", "nonce": base64.b64encode(nonce).decode(),
            "ciphertext": base64.b64encode(ct).decode()}).encode())

    def _load_secrets(self) -> tuple[dict[str, Any], bool] | None:
        """``(secrets, was_plaintext)`` from ``secrets.json``, or None when there is none."""
        d = self._read_json("secrets.json")
        if d is None:
            return None
        p = self.path / "secrets.json"
        if d.get("format") != SECRETS_FORMAT:
            if "r_bits" in d and "codeword" in d:
                return d, True                      # written in clear by an older fedfs
            raise DeviceStateError(f"{p} has unknown format {d.get('format')!r}")
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        try:
            nonce, ct = base64.b64decode(d["nonce"], validate=True), base64.b64decode(d["ciphertext"], validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise DeviceStateError(f"{p} is malformed: {e}") from None
        if len(nonce) != 12:
            raise DeviceStateError(f"{p} is malformed: nonce of {len(nonce)} bytes")
        try:
            plain = AESGCM(self._secrets_key()).decrypt(nonce, ct, self._aad())
        except InvalidTag:
            raise DeviceKeyError(
                f"{p} cannot be decrypted: wrong device key (use the key this device was set up with — "
                "--key-file / DeviceConfig.enrollment_key, or the state's enrollment.key) or the file was "
                "tampered with") from None
        return _json_object(plain, p, "is malformed"), False

    def codeword(self, code_length: int) -> np.ndarray:
        """The device's codeword ``v_u = C(b_u ‖ r_u)`` (±1 int8, FedUV Alg. 2).

        Created on first use with ``r_u`` from the OS CSPRNG, then persisted (encrypted);
        later calls re-derive it from ``b_u`` and the stored ``r_u`` and check it against the
        stored copy.
        """
        info = self.info
        if info is None:
            raise DeviceStateError("the device has no base vector yet: register first")
        loaded = self._load_secrets()
        if loaded is None:
            v, r = make_codeword(info.base_vector, code_length)   # r_u: secrets.token_bytes
            self._store_secrets({
                "code_length": code_length,
                "r_bits": "".join(str(int(b)) for b in r),
                "codeword": np.packbits(v < 0).tobytes().hex(),
            })
            return v
        s, plaintext = loaded
        if s.get("code_length") != code_length:
            raise CodeError(f"this device's codeword has length {s.get('code_length')}, the server now asks for "
                            f"{code_length}; a codeword cannot change — use a new device state")
        try:
            r = np.array([int(ch) for ch in s["r_bits"]], dtype=np.uint8)
            v, _ = make_codeword(info.base_vector, code_length, r_bits=r)
            stored = np.unpackbits(np.frombuffer(bytes.fromhex(s["codeword"]), dtype=np.uint8))[:code_length]
        except (KeyError, TypeError, ValueError, InputError) as e:
            raise DeviceStateError(f"{self.path / 'secrets.json'} is malformed: {e}") from None
        if not np.array_equal(stored.astype(bool), v < 0):
            raise DeviceStateError("stored codeword does not match C(b_u ‖ r_u): the device state is corrupt")
        if plaintext and not self.read_only:
            self._store_secrets(s)                  # migrate: encrypt and replace atomically
        return v

    def load_codeword(self) -> np.ndarray:
        """The stored codeword (checked against ``b_u ‖ r_u``); error if none was made yet."""
        loaded = self._load_secrets()
        if loaded is None:
            raise DeviceStateError(f"{self.path} holds no codeword yet: the device has not trained a FedUV round")
        return self.codeword(int(loaded[0].get("code_length", 0)))

    def r_bits(self) -> np.ndarray | None:
        """``r_u`` (for tests and audits of what must never be sent)."""
        loaded = self._load_secrets()
        return None if loaded is None else np.array([int(ch) for ch in loaded[0]["r_bits"]], dtype=np.uint8)

    # ---- enrollment key ----------------------------------------------------------------

    def enrollment_key(self) -> bytes:
        """The device key (32 raw bytes in ``enrollment.key``, 0600), created on first use —
        usable as ``fedfs verify --key-file``. It encrypts the enrollment and, when the app
        gives no key of its own, ``secrets.json``. An app should keep its key in the
        platform keystore instead and pass it explicitly."""
        p = self.path / "enrollment.key"
        key = self._read_bytes("enrollment.key")
        if key is not None:
            if len(key) not in (16, 24, 32):
                raise DeviceStateError(f"{p} must hold 16, 24 or 32 raw bytes, has {len(key)}")
            return key
        if self.read_only:
            raise DeviceStateError(f"{self.path} has no enrollment.key: give the key this device was set up with")
        key = os.urandom(32)
        self._write("enrollment.key", key)
        return key


__all__ = ["DeviceSecrets", "SECRETS_FORMAT"]
