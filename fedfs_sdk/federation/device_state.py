"""The device-state directory: everything a device keeps between runs.

Layout (a directory this module creates gets mode 0700; every file 0600, every write atomic)::

    device.json            server URL, device id, FedUV base vector b_u, rounds done
    token                  the bearer token the server issued (a credential)
    secrets.json           r_u (device-random message bits) and the codeword v_u = C(b_u ‖ r_u),
                           AES-GCM encrypted under the device key (see below)
    personal.safetensors   the personalized weights θ_c (FedFS); never uploaded
    pending.json           a round's upload waiting for the server's receipt (round id, model
    pending.update.safetensors     version, hashes), the body sent (w_c, |D_c|) and the θ_c it
    pending.personal.safetensors   produced — θ_c becomes ``personal`` only once the server
                           accepted the upload (:meth:`DeviceState.commit_pending`)
    global.safetensors     the last downloaded global version (cache)
    xi.safetensors         the frozen ξ downloaded from the server (FedFS), if any
    verifier.safetensors / verifier.onnx   the device's own verifier after enrollment
    enrollment.fedfs       the owner's enrollment, AES-GCM encrypted (see enrollment.py)
    enrollment.key         the device key when the app supplied none (better: a platform keystore)
    identity.key / identity.cert   the long-lived secure-aggregation identity (Ed25519, 0600) and
                           its operator certificate (:mod:`fedfs_sdk.federation.device_identity`)
    .lock                  held while a process uses the directory

**What is encrypted.** ``secrets.json`` (``r_u`` and the codeword) and ``enrollment.fedfs``
are AES-GCM encrypted under the device key: the key the app supplies
(``DeviceConfig.enrollment_key``, ``fedfs device --key-file``), else ``enrollment.key``.
The associated data of ``secrets.json`` binds the file's name, its format and the device
id, so a secrets file cannot be swapped between devices or files. An old plaintext
``secrets.json`` is encrypted (atomically replaced) the first time it is read.
θ_c, the pending update, the verifier and the cached models are protected by file mode
(0600 in a 0700 folder) only; an app should also put the folder under the platform's file
protection (iOS Data Protection, Android app-private storage).

``r_u``, the codeword, θ_c and the enrollment are device secrets: the client never puts
them in a request (tests check the bytes on the wire).
"""
from __future__ import annotations

import base64
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..runtime.codes import BASE_BITS, make_codeword
from ..errors import CodeError, FedFSError, InputError
from ..fileio import atomic_write_bytes, fsync_directory, lock_file, unlock_file
from .wire_format import sha256_hex

if TYPE_CHECKING:  # torch is imported only by the torch runtime's calls: an ORT device never loads it
    import torch

STATE_FORMAT = "fedfs-device/1"
SECRETS_FORMAT = "fedfs-device-secrets/1"
PENDING_FORMAT = "fedfs-pending-update/1"
FILE_MODE = 0o600
DIR_MODE = 0o700

# Names a device state may hold (a folder holding only these — e.g. after a registration that
# failed half-way — is still taken as a device state; anything else without device.json is not).
STATE_FILES = frozenset({
    "device.json", "token", "secrets.json", "personal.safetensors", "global.safetensors", "xi.safetensors",
    "verifier.safetensors", "verifier.onnx", "enrollment.fedfs", "enrollment.key", ".lock",
    "pending.json", "pending.update.safetensors", "pending.personal.safetensors", "identity.key", "identity.cert",
    "stats"})
_PENDING_FILES = ("pending.json", "pending.update.safetensors", "pending.personal.safetensors")


class DeviceStateError(FedFSError):
    """The device-state directory is missing, locked by another process, or inconsistent."""


class DeviceKeyError(DeviceStateError):
    """``secrets.json`` does not decrypt with the given device key (wrong key, or tampered)."""


@dataclass
class DeviceInfo:
    """The non-secret part of the state (``device.json``)."""

    server: str
    device_id: str
    base_vector: int
    registered_at: float = field(default_factory=time.time)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    format: str = STATE_FORMAT
    secure_aggregation: bool = False
    """The server has offered secure aggregation (at registration or in a round): with the default
    ``DeviceConfig.require_secure_aggregation`` the device refuses plain rounds from then on."""


def _check_key(key: bytes, what: str) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) not in (16, 24, 32):
        n = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise DeviceStateError(f"{what} must be 16, 24 or 32 raw bytes (AES), got {n}")
    return bytes(key)


def _is_state_entry(name: str) -> bool:
    return name in STATE_FILES or (name.startswith(".") and name.endswith(".tmp"))


def _json_object(raw: bytes, path: Path, problem: str) -> dict[str, Any]:
    """``raw`` as a JSON object, else :class:`DeviceStateError` ``"<path> <problem>: …"``."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DeviceStateError(f"{path} {problem}: {e}") from None
    if not isinstance(data, dict):
        raise DeviceStateError(f"{path} {problem}: not a JSON object")
    return data


class DeviceState:
    """A device-state directory, locked for the lifetime of this object.

    Args:
        path: the folder. Created (mode 0700) if missing, unless ``read_only``. An existing
            folder must be a device state (it has ``device.json``) or empty; its mode is left
            as it is.
        key: the device key (16/24/32 bytes) that encrypts ``secrets.json`` — the app's
            enrollment key. Without one, ``enrollment.key`` in the folder is used (created on
            first use). See :meth:`use_key`.
        read_only: open an existing device state to read it (e.g. ``fedfs enroll
            --device-state``): nothing is created — not even the folder — and nothing written.

    Use as a context manager (or call :meth:`close`) to release the lock.
    """

    def __init__(self, path: str | os.PathLike[str], *, key: bytes | None = None, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = bool(read_only)
        self._key = _check_key(key, "the device key") if key is not None else None
        self._info: DeviceInfo | None = None
        self._lock_fd = -1
        try:
            self._open_folder()
            fd = lock_file(self.path / ".lock", shared=self.read_only, mode=FILE_MODE)
        except OSError as e:
            raise DeviceStateError(f"cannot use device state {self.path}: {e.strerror or e}") from None
        if fd is None:
            raise DeviceStateError(f"device state {self.path} is in use by another process")
        self._lock_fd = fd

    def _open_folder(self) -> None:
        p = self.path
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise DeviceStateError(f"{p} is not a folder: a device state is a directory (give --state a new "
                                       "or empty folder)")
            if (p / "device.json").is_file():
                return
            if self.read_only:
                raise DeviceStateError(f"{p} is not a fedfs device state (no device.json): has the device "
                                       "registered (fedfs device --state)?")
            foreign = sorted(n for n in os.listdir(p) if not _is_state_entry(n))
            if foreign:
                shown = ", ".join(foreign[:3]) + (", …" if len(foreign) > 3 else "")
                raise DeviceStateError(f"{p} is not a fedfs device state (no device.json) and is not empty "
                                       f"({shown}); give --state a new or empty folder")
            return
        if self.read_only:
            raise DeviceStateError(f"no device state at {p} (folder not found)")
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(p, DIR_MODE)
        os.chmod(p, DIR_MODE)        # only a folder created here: the umask may have narrowed mkdir's mode

    def close(self) -> None:
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            unlock_file(fd)

    def __enter__(self) -> "DeviceState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, name: str, data: bytes) -> None:
        if self.read_only:
            raise DeviceStateError(f"device state {self.path} is open read-only; cannot write {name}")
        try:
            atomic_write_bytes(self.path / name, data, mode=FILE_MODE)
        except OSError as e:
            raise DeviceStateError(f"cannot write {self.path / name}: {e.strerror or e}") from None

    def _read_bytes(self, name: str) -> bytes | None:
        p = self.path / name
        if not p.is_file():
            return None
        try:
            return p.read_bytes()
        except OSError as e:
            raise DeviceStateError(f"{p} is unreadable: {e.strerror or e}") from None

    def _read_json(self, name: str) -> dict[str, Any] | None:
        p = self.path / name
        raw = self._read_bytes(name)
        if raw is None:
            return None
        return _json_object(raw, p, "is unreadable")

    # ---- registration ----------------------------------------------------------------

    @property
    def info(self) -> DeviceInfo | None:
        """The registration, or None before the device has registered."""
        if self._info is None:
            d = self._read_json("device.json")
            if d is not None:
                try:
                    self._info = DeviceInfo(**d)
                except TypeError as e:
                    raise DeviceStateError(f"{self.path / 'device.json'} is malformed: {e}") from None
                if self._info.format != STATE_FORMAT:
                    raise DeviceStateError(f"unsupported device state format {self._info.format!r}")
        return self._info

    @property
    def token(self) -> str | None:
        raw = self._read_bytes("token")
        return raw.decode("utf-8", "replace").strip() if raw is not None else None

    def save_registration(self, server: str, device_id: str, token: str, base_vector: int) -> DeviceInfo:
        """Persist what the server issued at registration (token first: it is the credential)."""
        if not 0 <= int(base_vector) < (1 << BASE_BITS):
            raise InputError(f"base vector {base_vector} does not fit in {BASE_BITS} bits")
        self._write("token", token.encode() + b"\n")
        info = DeviceInfo(server=server, device_id=device_id, base_vector=int(base_vector))
        self._save_info(info)
        return info

    def _save_info(self, info: DeviceInfo) -> None:
        self._write("device.json", json.dumps(asdict(info), indent=1, sort_keys=True).encode())
        self._info = info

    def mark_secure_aggregation(self) -> None:
        """Remember, for good, that this device's server offers secure aggregation."""
        info = self.info
        if info is not None and not info.secure_aggregation:
            info.secure_aggregation = True
            self._save_info(info)

    def record_round(self, entry: Mapping[str, Any]) -> None:
        """Append a participation record (round id, model version, receipt hash …); a round
        already recorded (same ``round_id``) is not recorded twice."""
        info = self.info
        if info is None:
            raise DeviceStateError("cannot record a round before registration")
        if "round_id" in entry and any(r.get("round_id") == entry["round_id"] for r in info.rounds):
            return
        info.rounds.append(dict(entry))
        self._save_info(info)

    # ---- the device key and FedUV secrets --------------------------------------------

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

    # ---- weights -----------------------------------------------------------------------

    def save_weights_bytes(self, name: str, data: bytes) -> None:
        self._write(f"{name}.safetensors", data)

    def save_file(self, name: str, data: bytes) -> Path:
        """Write ``name`` in the state atomically, mode 0600 (e.g. the device's ONNX verifier)."""
        self._write(name, data)
        return self.path / name

    def load_weights(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        data = self._read_bytes(f"{name}.safetensors")
        if data is None:
            return None
        from .wire import decode_weights

        try:
            return decode_weights(data)
        except InputError as e:
            raise DeviceStateError(f"{self.path / f'{name}.safetensors'} is corrupt: {e}") from None

    def load_arrays(self, name: str) -> dict[str, np.ndarray] | None:
        """Numpy counterpart of :meth:`load_weights` (None when absent; θ_c is written by
        :meth:`commit_pending`)."""
        from safetensors.numpy import load

        from .wire_format import read_header

        data = self._read_bytes(f"{name}.safetensors")
        if data is None:
            return None
        try:
            read_header(data)
            return load(data)
        except Exception as e:  # InputError from the header check, SafetensorError from the parser
            raise DeviceStateError(f"{self.path / f'{name}.safetensors'} is corrupt: {e}") from None

    def file(self, name: str) -> Path:
        return self.path / name

    # ---- a round's upload awaiting the server's receipt ------------------------------

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

    def _remove(self, *names: str) -> None:
        if self.read_only:
            return
        removed = False
        for n in names:
            try:
                (self.path / n).unlink()
                removed = True
            except FileNotFoundError:
                pass
            except OSError as e:
                raise DeviceStateError(f"cannot remove {n} from {self.path}: {e.strerror or e}") from None
        if removed:
            fsync_directory(self.path)

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


__all__ = ["DeviceState", "DeviceInfo", "DeviceStateError", "DeviceKeyError", "STATE_FORMAT", "SECRETS_FORMAT", "STATE_FILES"]
