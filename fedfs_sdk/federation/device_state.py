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

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputError
from .device_folder import (DIR_MODE, FILE_MODE, STATE_FILES, STATE_FORMAT, DeviceInfo, DeviceKeyError,  # noqa: F401
                            DeviceStateError)  # (re-exported: the folder, its lock and device.json moved down)
from .device_pending import PENDING_FORMAT, DevicePending  # noqa: F401 (re-exported)
from .device_secrets import SECRETS_FORMAT, DeviceSecrets  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # torch is imported only by the torch runtime's calls: an ORT device never loads it
    import torch


class DeviceState(DeviceSecrets, DevicePending):
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
    # The folder, its lock and device.json: :class:`~.device_folder.DeviceFolder`; the device key,
    # r_u and the codeword: :class:`~.device_secrets.DeviceSecrets`; a round's upload awaiting its
    # receipt: :class:`~.device_pending.DevicePending`.

    def __enter__(self) -> "DeviceState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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


__all__ = ["DeviceState", "DeviceInfo", "DeviceStateError", "DeviceKeyError", "STATE_FORMAT", "SECRETS_FORMAT", "STATE_FILES",
           "PENDING_FORMAT", "FILE_MODE", "DIR_MODE"]
