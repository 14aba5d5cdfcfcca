"""Secure aggregation (Bonawitz et al. 2017; SecAgg+ graph of Bell et al. 2020), torch-free.

The server learns only Σ n·w and Σ n of the round's surviving devices: against an
honest-but-curious server with ``fedfs-secagg/1``, against an active one with ``/2``
(certified device identities, signed advertisements, the ConsistencyCheck round) — and in
both only within the device's own floors (:class:`DevicePolicy`). Transport-independent:
:class:`SecAggDevice` and :class:`SecAggServer` are message-in / message-out state machines
over plain dicts (:mod:`.messages` turns them into JSON); errors carry an HTTP-like
``status``. See docs/privacy.md for the threat model, parameters and measured cost.
"""
from .device import SecAggDevice
from .identity import CaPublicKey, Certificate, CertificateAuthority, DeviceIdentity, IdentityError
from .encoding import FixedPoint
from .errors import (BadMessageError, IntegrityError, RefusedError, ReplayError, RoundFailedError,
                     SecAggError, UnknownDeviceError)
from .messages import from_json, to_json
from .persist import restore, snapshot
from .params import PROTOCOL_V1, PROTOCOL_V2, SecAggParams, default_threshold, min_threshold, neighbours
from .policy import DevicePolicy
from .server import SecAggResult, SecAggServer

__all__ = ["SecAggDevice", "SecAggServer", "SecAggParams", "SecAggResult", "FixedPoint",
           "SecAggError", "BadMessageError", "UnknownDeviceError", "ReplayError", "IntegrityError",
           "RefusedError", "RoundFailedError", "default_threshold", "min_threshold", "neighbours",
           "to_json", "from_json", "snapshot", "restore", "DevicePolicy", "CaPublicKey", "Certificate",
           "CertificateAuthority", "DeviceIdentity", "IdentityError", "PROTOCOL_V1", "PROTOCOL_V2"]
