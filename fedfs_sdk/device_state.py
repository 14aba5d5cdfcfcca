"""The device-state directory: everything a device keeps between runs.

Layout (directory mode 0700, every file 0600, every write atomic)::

    device.json            server URL, device id, FedUV base vector b_u, rounds done
    token                  the bearer token the server issued (a credential)
    secrets.json           r_u (device-random message bits) and the codeword v_u = C(b_u ‖ r_u)
    personal.safetensors   the personalized weights θ_c (FedFS); never uploaded
    global.safetensors     the last downloaded global version (cache)
    xi.safetensors         the frozen ξ downloaded from the server (FedFS), if any
    enrollment.fedfs       the owner's enrollment, AES-GCM encrypted (see enrollment.py)
    enrollment.key         its key when the app supplied none (better: a platform keystore)
    .lock                  held while a process uses the directory

``r_u``, the codeword, θ_c and the enrollment are device secrets: the client never puts
them in a request (tests check the bytes on the wire).
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .codes import BASE_BITS, make_codeword
from .errors import CodeError, FedFSError, InputError
from .fileio import atomic_write_bytes

if TYPE_CHECKING:  # torch is imported only by the torch runtime's calls: an ORT device never loads it
    import torch

STATE_FORMAT = "fedfs-device/1"
FILE_MODE = 0o600
DIR_MODE = 0o700


class DeviceStateError(FedFSError):
    """The device-state directory is missing, locked by another process, or inconsistent."""


@dataclass
class DeviceInfo:
    """The non-secret part of the state (``device.json``)."""

    server: str
    device_id: str
    base_vector: int
    registered_at: float = field(default_factory=time.time)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    format: str = STATE_FORMAT


class DeviceState:
    """A device-state directory, locked for the lifetime of this object.

    Use as a context manager (or call :meth:`close`) to release the lock.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, DIR_MODE)
        self._lock_fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise DeviceStateError(f"device state {self.path} is in use by another process") from None
        self._info: DeviceInfo | None = None

    def close(self) -> None:
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> "DeviceState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self.path / name, data, mode=FILE_MODE)

    def _read_json(self, name: str) -> dict[str, Any] | None:
        p = self.path / name
        if not p.is_file():
            return None
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise DeviceStateError(f"{p} is unreadable: {e}") from None
        if not isinstance(data, dict):
            raise DeviceStateError(f"{p} is not a JSON object")
        return data

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
        p = self.path / "token"
        return p.read_text(encoding="utf-8").strip() if p.is_file() else None

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

    def record_round(self, entry: Mapping[str, Any]) -> None:
        """Append a participation record (round id, model version, receipt hash …)."""
        info = self.info
        if info is None:
            raise DeviceStateError("cannot record a round before registration")
        info.rounds.append(dict(entry))
        self._save_info(info)

    # ---- FedUV secrets ---------------------------------------------------------------

    def codeword(self, code_length: int) -> np.ndarray:
        """The device's codeword ``v_u = C(b_u ‖ r_u)`` (±1 int8, FedUV Alg. 2).

        Created on first use with ``r_u`` from the OS CSPRNG, then persisted; later calls
        re-derive it from ``b_u`` and the stored ``r_u`` and check it against the stored copy.
        """
        info = self.info
        if info is None:
            raise DeviceStateError("the device has no base vector yet: register first")
        s = self._read_json("secrets.json")
        if s is None:
            v, r = make_codeword(info.base_vector, code_length)   # r_u: secrets.token_bytes
            self._write("secrets.json", json.dumps({
                "code_length": code_length,
                "r_bits": "".join(str(int(b)) for b in r),
                "codeword": np.packbits(v < 0).tobytes().hex(),
            }).encode())
            return v
        if s.get("code_length") != code_length:
            raise CodeError(f"this device's codeword has length {s.get('code_length')}, the server now asks for "
                            f"{code_length}; a codeword cannot change — use a new device state")
        try:
            r = np.array([int(ch) for ch in s["r_bits"]], dtype=np.uint8)
            v, _ = make_codeword(info.base_vector, code_length, r_bits=r)
            stored = np.unpackbits(np.frombuffer(bytes.fromhex(s["codeword"]), dtype=np.uint8))[:code_length]
        except (KeyError, ValueError, InputError) as e:
            raise DeviceStateError(f"{self.path / 'secrets.json'} is malformed: {e}") from None
        if not np.array_equal(stored.astype(bool), v < 0):
            raise DeviceStateError("stored codeword does not match C(b_u ‖ r_u): the device state is corrupt")
        return v

    def load_codeword(self) -> np.ndarray:
        """The stored codeword (checked against ``b_u ‖ r_u``); error if none was made yet."""
        s = self._read_json("secrets.json")
        if s is None:
            raise DeviceStateError(f"{self.path} holds no codeword yet: the device has not trained a FedUV round")
        return self.codeword(int(s.get("code_length", 0)))

    def r_bits(self) -> np.ndarray | None:
        """``r_u`` (for tests and audits of what must never be sent)."""
        s = self._read_json("secrets.json")
        return None if s is None else np.array([int(ch) for ch in s["r_bits"]], dtype=np.uint8)

    # ---- weights -----------------------------------------------------------------------

    def save_weights(self, name: str, weights: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None = None) -> None:
        from .wire import encode_weights

        self._write(f"{name}.safetensors", encode_weights(weights, meta))

    def save_weights_bytes(self, name: str, data: bytes) -> None:
        self._write(f"{name}.safetensors", data)

    def save_file(self, name: str, data: bytes) -> Path:
        """Write ``name`` in the state atomically, mode 0600 (e.g. the device's ONNX verifier)."""
        self._write(name, data)
        return self.path / name

    def load_weights(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        p = self.path / f"{name}.safetensors"
        if not p.is_file():
            return None
        from .wire import decode_weights

        try:
            return decode_weights(p.read_bytes())
        except InputError as e:
            raise DeviceStateError(f"{p} is corrupt: {e}") from None

    def save_arrays(self, name: str, arrays: Mapping[str, np.ndarray]) -> None:
        """Numpy counterpart of :meth:`save_weights` (the same safetensors file, no torch)."""
        from safetensors.numpy import save

        if not arrays:
            raise InputError(f"cannot save empty weights as {name!r}")
        self._write(f"{name}.safetensors", save({k: np.ascontiguousarray(v) for k, v in arrays.items()}))

    def load_arrays(self, name: str) -> dict[str, np.ndarray] | None:
        """Numpy counterpart of :meth:`load_weights` (None when absent)."""
        from safetensors.numpy import load

        from .wire_format import read_header

        p = self.path / f"{name}.safetensors"
        if not p.is_file():
            return None
        data = p.read_bytes()
        try:
            read_header(data)
            return load(data)
        except Exception as e:  # InputError from the header check, SafetensorError from the parser
            raise DeviceStateError(f"{p} is corrupt: {e}") from None

    def file(self, name: str) -> Path:
        return self.path / name

    # ---- enrollment key ----------------------------------------------------------------

    def enrollment_key(self) -> bytes:
        """The AES-GCM key of the enrollment (32 raw bytes in ``enrollment.key``, 0600),
        created on first use — usable as ``fedfs verify --key-file``. An app should keep
        its key in the platform keystore instead and pass it explicitly."""
        p = self.path / "enrollment.key"
        if p.is_file():
            key = p.read_bytes()
            if len(key) not in (16, 24, 32):
                raise DeviceStateError(f"{p} must hold 16, 24 or 32 raw bytes, has {len(key)}")
            return key
        key = os.urandom(32)
        self._write("enrollment.key", key)
        return key


__all__ = ["DeviceState", "DeviceInfo", "DeviceStateError", "STATE_FORMAT"]
