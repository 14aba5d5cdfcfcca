"""The privacy accountant of fedfs' DP mechanisms, torch-free: ε of a sequence of (Poisson-subsampled)
Gaussian mechanisms from Google's ``dp-accounting`` (RDP — Mironov 2017, with the subsampled-Gaussian
bound of Mironov, Talwar & Zhang 2019 — or PLD). Used by the weight rounds' DP-FedAvg
(:mod:`server_agg.dp`) and the statistics rounds' Gaussian mechanism (:mod:`fedfs_sdk.stats.privacy`);
it lives here, below both, so the SDK's statistics need neither the server nor torch.
"""
from __future__ import annotations

import logging
import math
from typing import Iterable

from ..errors import InputError

ACCOUNTANTS = ("rdp", "pld")

__all__ = ["ACCOUNTANTS", "require_accountant", "epsilon", "calibrate_noise", "default_delta"]


def require_accountant() -> None:
    """:class:`InputError` naming the install command when ``dp-accounting`` is missing."""
    try:
        import dp_accounting  # noqa: F401
    except ImportError:
        raise InputError("user-level DP needs Google's dp-accounting: pip install --no-deps dp-accounting==0.6.0 "
                         "absl-py dm-tree wrapt (the [dp] extra; see docs/privacy.md)") from None


def _event(q: float, sigma: float, count: int):
    require_accountant()
    import dp_accounting   # lazy: ~2 s import, only when DP is on

    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)


def _fresh(accountant: str):
    require_accountant()
    from dp_accounting import pld, rdp

    # dp-accounting logs (absl) a warning per fractional RDP order whose series does not
    # converge at large q and then drops that order — harmless, and library code never prints.
    logging.getLogger("absl").setLevel(logging.ERROR)

    if accountant == "rdp":
        return rdp.RdpAccountant()
    if accountant == "pld":
        return pld.PLDAccountant(value_discretization_interval=1e-3)
    raise InputError(f"unknown DP accountant {accountant!r}; choose one of {ACCOUNTANTS}")


def epsilon(rounds: Iterable[tuple[float, float, int]], delta: float, accountant: str = "rdp") -> float:
    """ε at ``delta`` after ``rounds`` = ``(q, σ, count)`` groups of Poisson-subsampled
    Gaussian rounds. 0 rounds → 0; a group with σ = 0 → ∞ (no noise, no privacy)."""
    if not 0 < delta < 1:
        raise InputError(f"δ must be in (0, 1), got {delta!r}")
    acc = _fresh(accountant)
    any_round = False
    for q, sigma, count in rounds:
        if count <= 0 or q <= 0:
            continue
        if sigma <= 0:
            return math.inf
        acc.compose(_event(min(float(q), 1.0), float(sigma), int(count)))
        any_round = True
    return float(acc.get_epsilon(delta)) if any_round else 0.0


def calibrate_noise(target_epsilon: float, delta: float, q: float, rounds: int, accountant: str = "rdp") -> float:
    """The smallest σ (to 1e-3) whose ε after ``rounds`` rounds at rate ``q`` is ≤ ``target_epsilon``
    (``dp_accounting.mechanism_calibration``); ∞ target → 0 (no noise)."""
    if math.isinf(target_epsilon):
        return 0.0
    if not target_epsilon > 0 or rounds < 1 or not 0 < q <= 1:
        raise InputError(f"need ε > 0, rounds ≥ 1, 0 < q ≤ 1; got {target_epsilon}, {rounds}, {q}")
    from dp_accounting import mechanism_calibration as mc

    return float(mc.calibrate_dp_mechanism(
        lambda: _fresh(accountant), lambda s: _event(q, s, rounds), target_epsilon, delta,
        mc.LowerEndpointAndGuess(1e-2, 1.0), tol=1e-3))


def default_delta(num_users: int) -> float:
    """McMahan et al.'s choice ``δ = N^-1.1`` (below ``1/N``: a mechanism that publishes one
    random user's data in the clear is not (ε, δ ≥ 1/N)-private for any ε)."""
    return float(max(num_users, 2)) ** -1.1
