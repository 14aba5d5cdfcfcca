"""FedUV's codewords in the simulator: each client's ``v_u = C(b_u ‖ r_u)`` (FedUV Alg. 2),
regenerated from the seed on demand, and ``ℓ_neg``'s schedule and other users' codewords
(FedUV Eq. 4, §6.3). A mixin of :class:`~device_sim.methods.sdk_methods.SDKMethod`: it reads
the method's ``code_length`` and ``neg*`` options.
"""
from __future__ import annotations

import numpy as np
import torch

from fedfs_sdk.runtime.codes import make_codeword, random_codewords

from .base import ClientState, RoundPlan
from .presets import base_vector


class SDKCodewords:
    """Codewords and ``ℓ_neg`` of :class:`~device_sim.methods.sdk_methods.SDKMethod` (a mixin)."""

    def codeword(self, client: int) -> np.ndarray:
        """Client ``client``'s FedUV codeword ``v_u = C(b_u ‖ r_u)`` (FedUV Alg. 2): ``b_u`` =
        :func:`base_vector` (32 pseudo-random bits, unique per client, as the server draws
        them), ``r_u`` drawn from a generator seeded by ``(seed, client)`` so it is regenerated
        on demand, never stored."""
        assert self.code_length is not None
        v = self._codewords.get(client)
        if v is None:
            rng = np.random.default_rng([self.context.seed, 0xC0DE, client])
            v, _ = make_codeword(base_vector(self.context.seed, int(client)), self.code_length, rng=rng)
            if len(self._codewords) < 65536:  # bounded cache; regeneration is cheap
                self._codewords[client] = v
        return v

    def client_state_init(self, client: int) -> ClientState:
        return ClientState(client, self.codeword(client) if self.code_length is not None else None)

    def lambda_neg_at(self, round_idx: int) -> float:
        if self.neg == "all" or (self.neg == "early" and round_idx <= self.neg_rounds):
            return self.lambda_neg
        return 0.0

    def client_consts(self, plan: RoundPlan, state: ClientState) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        if self.code_length is None:
            return out
        assert state.codeword is not None
        out["codeword"] = torch.from_numpy(state.codeword.astype(np.float32))
        if plan.extras["objective"].lambda_neg > 0:
            out["neg_codewords"] = torch.from_numpy(self._neg_codewords(plan, state.client).astype(np.float32))
        return out

    def _neg_codewords(self, plan: RoundPlan, client: int) -> np.ndarray:
        """``ℓ_neg``'s other users (FedUV Eq. 4): up to ``neg_samples`` other participants of
        this round; the same count for every client of the round (stackable). A lone
        participant gets codewords of random messages instead."""
        others = plan.participants[plan.participants != client]
        rng = np.random.default_rng([self.context.seed, 0x4E45, plan.round, client])
        assert self.code_length is not None
        if others.size == 0:
            return random_codewords(self.neg_samples, self.code_length, rng)
        count = min(self.neg_samples, int(plan.participants.size) - 1)
        chosen = rng.choice(others, size=count, replace=False) if others.size > count else others
        return np.stack([self.codeword(int(u)) for u in chosen])


__all__ = ["SDKCodewords"]
