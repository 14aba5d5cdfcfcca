"""The exception hierarchy of fedfs.

Every error the SDK raises on bad input derives from :class:`FedFSError`, so an app can
catch one type; the subclasses say *what* was wrong. Messages name the offending value.
"""
from __future__ import annotations


class FedFSError(Exception):
    """Base class of every fedfs error."""


class InputError(FedFSError, ValueError):
    """An argument has the wrong shape, dtype, channel count or value."""


class ImageDecodeError(InputError):
    """Bytes or a file could not be decoded as an image (corrupt, empty, unsupported)."""


class ImageNotFoundError(InputError, FileNotFoundError):
    """An image path does not exist."""


class NoFaceError(InputError):
    """Face detection was requested and found no face in the image."""


class InsufficientWarmupError(InputError):
    """Too few warm-up images for the requested target TPR ``q`` (FedUV Alg. 2)."""


class CodeError(InputError):
    """A BCH code length/message length that the library does not provide."""


class TrainingError(FedFSError, FloatingPointError):
    """Local training diverged: the loss or the weights became NaN/Inf (learning rate too high?).

    Also a :class:`FloatingPointError`, which is what it was before it had its own type."""


class EnrollmentError(FedFSError):
    """An enrollment file could not be read: tampered, wrong key, wrong format."""


class EnrollmentExistsError(EnrollmentError, FileExistsError):
    """Refusing to overwrite an existing enrollment without ``overwrite=True``."""


class CheckpointError(FedFSError):
    """A checkpoint is missing, unreadable or of another architecture."""


class ProtocolError(FedFSError):
    """The aggregation server refused a request or answered something unexpected."""


class OperatingPointError(InputError):
    """An enrollment cannot meet its targets: the false-accept rate ``far`` on the public
    impostor set and the warm-up's true-positive rate ``q`` cannot both hold (or the impostor
    set is too small to bound ``far``)."""
