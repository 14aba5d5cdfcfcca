"""Exact rationals of user-written decimals (torch- and numpy-free).

``0.28 * 25`` is ``7.000000000000001`` in floating point and ``np.float32(0.8)`` is
``0.800000011920929``, so a rule such as ``⌈K·N⌉`` or ``⌊n(1−q)⌋`` computed in floats can be
off by one. fedfs reads such settings as the decimal the user wrote — ``Fraction(str(x))``:
``0.28 → 7/25``, ``np.float32(0.8) → 4/5`` (numpy prints the shortest decimal that
round-trips) — and evaluates the rule with integers.
"""
from __future__ import annotations

import math
import numbers
from decimal import Decimal
from fractions import Fraction
from typing import Any

from .errors import InputError


def as_written(x: Any, name: str = "value") -> Fraction:
    """``x`` as an exact :class:`~fractions.Fraction` of the decimal it prints as.

    Accepts int, float, :class:`~fractions.Fraction`, :class:`~decimal.Decimal` and numpy
    scalars; :class:`InputError` naming ``name`` for anything else (bool, str, None) and for
    NaN/Inf."""
    if isinstance(x, bool) or type(x).__name__ == "bool_" or not isinstance(x, (numbers.Real, Decimal)):
        raise InputError(f"{name} must be a number, got {x!r}")
    if isinstance(x, numbers.Rational):
        return Fraction(int(x.numerator), int(x.denominator))
    if isinstance(x, Decimal):
        if not x.is_finite():
            raise InputError(f"{name} must be finite, got {x}")
        return Fraction(x)
    if not math.isfinite(float(x)):
        raise InputError(f"{name} must be finite, got {x}")
    try:
        return Fraction(str(x))
    except ValueError:   # a Real whose str() is not a decimal: its exact binary value
        return Fraction(float(x))


__all__ = ["as_written"]
