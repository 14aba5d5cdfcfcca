"""Errors of the secure-aggregation state machines, each carrying an HTTP-like status.

The state machines are transport-independent; a later HTTP layer maps ``err.status`` and
``err.reason`` onto its response (``4xx`` = the sender's fault, the round goes on;
:class:`RoundFailedError` = the round is over and cannot finish).
"""
from __future__ import annotations

from ...errors import FedFSError, InputError


class SecAggError(FedFSError):
    """Base class: ``status`` is an HTTP-like code, ``reason`` a short machine-readable tag."""

    status = 400
    reason = "bad_request"

    def __init__(self, message: str, *, status: int | None = None, reason: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        if reason is not None:
            self.reason = reason


class BadMessageError(SecAggError, InputError):
    """A message is malformed: wrong type, missing field, wrong length, value out of range."""

    status = 422
    reason = "bad_message"


class UnknownDeviceError(SecAggError, InputError):
    """A message names a device that is not part of this round (never joined, or dropped)."""

    status = 403
    reason = "unknown_device"


class ReplayError(SecAggError):
    """A message for another round or another step, or a second message for the same step."""

    status = 409
    reason = "replay_or_wrong_step"


class IntegrityError(SecAggError):
    """An encrypted share failed authentication (tampered, replayed from another round, misrouted)."""

    status = 400
    reason = "integrity"


class RefusedError(SecAggError):
    """A device refuses a request that would break the protocol's privacy (Bonawitz et al. 2017
    §4: never reveal both the self-mask share and the key share of one device)."""

    status = 403
    reason = "refused"


class RoundFailedError(SecAggError):
    """The round cannot finish: too few devices survived a step, or the unmasked sum is out
    of range (a corrupted input). ``survivors`` and ``threshold`` say by how much."""

    status = 410
    reason = "round_failed"

    def __init__(self, message: str, *, survivors: int | None = None, threshold: int | None = None):
        super().__init__(message)
        self.survivors = survivors
        self.threshold = threshold
