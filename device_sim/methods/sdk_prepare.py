"""What an SDK method does before its first round (:meth:`SDKPrepare.prepare`): the statistics round.

Each sampled client's contribution — ξ's embedding moments and, for the in-domain check, its
trunk-feature moments — computed with the device's functions and summed as the server sums
(:mod:`.client_stats`); from the sum, ``norm_init`` re-fits ξ's embedding normalization affine
(``norm-adapt``'s fold) as ϕ's start, and ``select`` gets the round's sum and its candidates
(:mod:`.selection`). A mixin of :class:`~device_sim.methods.sdk_methods.SDKMethod`: it reads the
method's options and set-up.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedfs_sdk.errors import InputError
from fedfs_sdk.stats import norm_fold_from_sum

from .base import backbone_weights, frozen, verifier_net
from fedfs_sdk.stats import MAX_PHOTOS

from .client_stats import EMBEDDING, FederationStats, StatsRoundDp, client_statistics, shared_round
from .reference import fold_standardization, stats_clients
from .selection import CANDIDATES, IN_DOMAIN_CANDIDATES, HoldoutView, top_verifier


def _torch_fold(fold: tuple[np.ndarray, np.ndarray | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    mu, sd = fold
    return torch.from_numpy(mu).float(), None if sd is None else torch.from_numpy(sd).float()


class SDKPrepare:
    """The statistics round of :class:`~device_sim.methods.sdk_methods.SDKMethod` (a mixin: it
    reads the method's ``selection``, ``norm_init``, ``check``, ``scope`` and ``_trunk``)."""

    def prepare(self, data: Any) -> None:
        """The statistics round (:mod:`.client_stats`: each client's contribution with the device's
        functions, summed as the server sums) when anything needs it; ``norm_init``: start ϕ from ξ
        with its embedding normalization re-fitted to the round's summed embedding moments
        (``norm-adapt``'s fold); ``select=on``: keep the data's hold-out, the round's sum and the
        candidates for :meth:`verifier`."""
        if self.selection is not None and self.select == "auto" and not isinstance(data, HoldoutView):
            # a federation built by hand on a Population: no hold-out, no public impostor set → off
            self.select, self.selection = "off (no hold-out)", None
        has_norm = hasattr(self.context.xi.backbone, "embed_norm")
        if self.norm_init != "none" and not has_norm and not self._norm_init_asked:
            # the preset's norm_init needs an embedding normalization to fold into (dlib-resnet ends in a
            # bias-free linear layer): without one the preset runs without it, and says so in its options
            self.norm_init = "none (the backbone has no embed_norm)"
        in_domain = self.selection is not None and self.check == "in-domain"
        if in_domain and self.scope != "top":
            raise InputError(f"{self.label}: check=in-domain judges candidates on ξ's trunk features: it needs "
                             "scope=top (or check=public)")
        if self.norm_init in ("center", "standardize") or in_domain:
            self.stats = self._statistics_round(data, features=in_domain)
        if self.norm_init in ("center", "standardize"):
            self._norm_fold = _torch_fold(norm_fold_from_sum(self.stats.total.sums[EMBEDDING], self.norm_init))
        candidates = None
        if in_domain:
            candidates = CANDIDATES
            if has_norm:
                # a function of ξ and the round only: one set of tensors for every method of the run, so
                # the check of this candidate is shared too (selection's memo keys on the tensors)
                if "norm-adapt" not in self.stats.memo:
                    self.stats.memo["norm-adapt"] = fold_standardization(
                        backbone_weights(self.context.xi.state_dict()),
                        *_torch_fold(norm_fold_from_sum(self.stats.total.sums[EMBEDDING], "standardize")))
                self._norm_adapt = self.stats.memo["norm-adapt"]
                candidates = IN_DOMAIN_CANDIDATES
        if self.selection is not None:
            self.selection.bind(data, self.stats, candidates)

    def stats_round_dp(self) -> StatsRoundDp | None:
        """The method's ``stats_dp`` / ``stats_bound`` / ``stats_photos`` options as the round's DP
        (None: none of them given — the round as before)."""
        z, bound, photos = (getattr(self, k, None) for k in ("stats_dp", "stats_bound", "stats_photos"))
        if z is None and bound is None and photos is None:
            return None
        return StatsRoundDp(float(z or 0.0), None if bound is None else float(bound),
                            MAX_PHOTOS if photos is None else int(photos), int(self.context.seed))

    def _statistics_round(self, data: Any, features: bool) -> FederationStats:
        """Every sampled client's contribution (ξ's embedding moments, and with ``features`` its
        trunk-feature moments) and their sum (:func:`.client_stats.client_statistics`)."""
        ctx = self.context
        clients = stats_clients(int(data.num_clients), ctx.seed)

        dp = self.stats_round_dp()

        def compute() -> FederationStats:
            net = frozen(verifier_net(ctx.model_config.resolved(), with_head=False))
            weights = backbone_weights(ctx.xi.state_dict())
            if not features:
                return client_statistics(net, weights, data, clients, ctx.device, dp=dp)
            return client_statistics(net, weights, data, clients, ctx.device,
                                     trunk=self._trunk, top=top_verifier(net), dp=dp)

        # the same round for every method of the run (ξ's weights and the clients' photos only):
        # keyed by the ξ object and the photos' source (a HoldoutView's population, fraction, seed)
        source = getattr(data, "pop", data)
        values = (repr(ctx.model_config.resolved()), str(ctx.device), int(ctx.seed), bool(features),
                  clients.tobytes(), getattr(data, "fraction", None), getattr(data, "seed", None), type(data).__name__,
                  repr(dp))
        return shared_round((ctx.xi, source, self._trunk if features else None), values, compute)


__all__ = ["SDKPrepare"]
