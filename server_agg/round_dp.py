"""User-level DP bookkeeping of the rounds (:mod:`server_agg.dp`): the privacy ledger, the budget check
before a round opens, the (ε, δ) statement a published version carries. A mixin of
:class:`server_agg.rounds.Coordinator`.
"""
from __future__ import annotations

from typing import Any, Mapping

from .config import RoundPolicy
from .dp import DpParams, Ledger, dp_epsilon_cached, publish_record
from .errors import Conflict


class DpLedger:
    """A mixin of :class:`~server_agg.rounds.Coordinator` (it uses the coordinator's ``_lock``,
    ``db``, ``layout``, ``policy``, ``model``, ``round`` and ``clock``)."""

    def _dp_ledger(self) -> Ledger:
        return Ledger.from_json(self.db.get_meta("dp_ledger"))

    def _dp_check_budget(self, policy: RoundPolicy, eligible: int) -> tuple[Ledger, DpParams | None]:
        """The ledger with the round about to open charged, and its DP mechanism (None: no
        DP). 409 ``dp_budget_exhausted`` if the round would take ε above the budget."""
        ledger = self._dp_ledger()
        if not policy.dp:
            return ledger.charge_non_private(), None
        q, sigma = policy.participation, float(policy.dp_noise_multiplier)  # type: ignore[arg-type]
        after = ledger.charge(q, sigma)
        if policy.dp_epsilon_budget is not None:
            eps = dp_epsilon_cached(after.to_json(), float(policy.dp_delta), policy.dp_accountant)  # type: ignore[arg-type]
            if eps > policy.dp_epsilon_budget:
                now = dp_epsilon_cached(ledger.to_json(), float(policy.dp_delta), policy.dp_accountant)  # type: ignore[arg-type]
                why = (f"{ledger.non_private} round(s) of this state ran without DP, so no finite ε holds"
                       if ledger.non_private else f"ε = {now:.4g} spent in {ledger.rounds} round(s)")
                raise Conflict(f"privacy budget exhausted: {why}; one more round (q = {q:g}, σ = {sigma:g}) would "
                               f"reach ε = {eps:.4g} > dp_epsilon_budget = {policy.dp_epsilon_budget:g} at "
                               f"δ = {policy.dp_delta:g}", code="dp_budget_exhausted")
        params = DpParams(clip=float(policy.max_update_norm), noise_multiplier=sigma,  # type: ignore[arg-type]
                          denominator=q * eligible, weight_cap=policy.dp_weight_cap)
        return after, params

    def _dp_exhausted(self) -> bool:
        """Whether the budget refuses the next round (False without DP or without a budget)."""
        p = self.policy
        if not p.dp or p.dp_epsilon_budget is None:
            return False
        after = self._dp_ledger().charge(p.participation, float(p.dp_noise_multiplier))  # type: ignore[arg-type]
        return dp_epsilon_cached(after.to_json(), float(p.dp_delta), p.dp_accountant) > p.dp_epsilon_budget  # type: ignore[arg-type]

    def _dp_statement(self, policy: RoundPolicy, params: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The (ε, δ) a version published now carries (None when DP was never on)."""
        ledger = self._dp_ledger()
        if params is None and not ledger.counts:
            return None
        delta = policy.dp_delta if policy.dp_delta is not None else self.policy.dp_delta
        if delta is None:
            return None
        return publish_record(ledger, float(delta), policy.dp_epsilon_budget, policy.dp_accountant,
                              DpParams.from_json(params) if params is not None else None,
                              policy.participation if params is not None else None)

    def _dp_status(self) -> dict[str, Any] | None:
        p = self.policy
        if not p.dp and not self._dp_ledger().counts:
            return None
        ledger = self._dp_ledger()
        st = publish_record(ledger, float(p.dp_delta), p.dp_epsilon_budget, p.dp_accountant, None, None) \
            if p.dp_delta is not None else {}
        return {**st, "epsilon_budget": p.dp_epsilon_budget, "budget_exhausted": self._dp_exhausted(),
                "noise_multiplier": p.dp_noise_multiplier, "clip": p.max_update_norm,
                "sampling_rate": p.participation if p.dp else None}


__all__ = ["DpLedger"]
