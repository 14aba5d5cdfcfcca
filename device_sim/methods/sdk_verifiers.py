"""How the SDK methods verify (evaluation side of :class:`~.sdk_methods.SDKMethod`).

* ``pretrained`` / ξ — ξ's embedding, cosine template (:meth:`SDKVerifiers.xi_verifier`).
* ``fedfs`` — the personalized ``q'`` = ``ϕ(θ_c)`` backbone output, cosine template.
* ``feduv`` — the global model and head, score ``(1/c) v_uᵀ σ(W g(x))`` (FedUV Eq. 5).
* ``fedfs+feduv`` — the personalized backbone ``q'`` with the global head ``W`` and the
  client's codeword.

With ``select=on`` (do no harm, :mod:`.selection`) a client verifies with whichever of ξ, the
global model and its personalized verifier did best on its hold-out; with ``scope="top"`` every
verifier runs its top on ξ's cached trunk features.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .base import ClientState, Params, VerifierSpec, Weights, backbone_weights
from .selection import top_verifier


class SDKVerifiers:
    """Verifier construction for :class:`~.sdk_methods.SDKMethod` (a mixin: it reads the method's
    ``sdk_method``, ``verify``, ``score``, ``scope``, ``code_length``, ``selection`` and the
    verifier networks that ``setup`` builds)."""

    def verifier(self, state: ClientState, global_weights: Weights, private: Params | None) -> VerifierSpec:
        """The client's verifier (:meth:`_verifier`); with ``select=on`` the one of ξ, the global
        model and it that did best on the client's hold-out (:mod:`.selection`)."""
        if not self._selecting():
            return self._split(self._verifier(state, global_weights, private))
        return self.selection.choose(state.client, self._candidates(state, global_weights, private))

    def _selecting(self) -> bool:
        """``select=auto`` is on once bound to a hold-out (:meth:`prepare`); ``on`` always (it
        raises, naming the fix, when it has nothing to check with)."""
        return self.selection is not None and (self.select != "auto" or self.selection.data is not None)

    def _candidates(self, state: ClientState, global_weights: Weights, private: Params | None) -> dict[str, VerifierSpec]:
        extra = {}
        if getattr(self, "_norm_adapt", None) is not None:     # check=in-domain: ξ after norm-adapt
            extra["norm-adapt"] = self._split(VerifierSpec(self._personal_vnet, self._norm_adapt, None,
                                                           shared_key="norm-adapt"))
        return {"xi": self._split(self.xi_verifier()), **extra,
                "global": self._split(self.new_user_verifier(state, global_weights)),
                "personalized": self._split(self._verifier(state, global_weights, private))}

    def prepare_evaluation(self, global_weights: Weights, private: Any, clients) -> None:
        """``select=on``: every evaluated client's check first, then the federation's verdicts."""
        if self._selecting():
            self.selection.prepare(clients, lambda c: self._candidates(self.client_state_init(c), global_weights,
                                                                        private(c)))

    def new_user_choice(self, state: ClientState, global_weights: Weights, enroll_x) -> tuple[VerifierSpec, str | None]:
        """What a user who never trained verifies with: the shipped model (:meth:`new_user_verifier`);
        with do no harm on, the device's rule over ξ, norm-adapt and the global model on its own
        enrollment photos (:meth:`.selection.SimSelection.choose_new_user`) — the deployed default
        never enrolls an unchecked global model, so neither does the simulator's new user."""
        if not self._selecting():
            return self.new_user_verifier(state, global_weights), None
        specs = self._candidates(state, global_weights, None)
        specs.pop("personalized")       # no θ_c: it never trained
        return self.selection.choose_new_user(state.client, specs, enroll_x)

    def xi_verifier(self) -> VerifierSpec:
        """ξ as it is, with a cosine template (what the device had before any training)."""
        return VerifierSpec(self._personal_vnet, backbone_weights(self.context.xi.state_dict()), None, shared_key="xi")

    def _split(self, spec: VerifierSpec) -> VerifierSpec:
        """``scope="top"``: the spec runs its top on ξ's cached trunk features."""
        if self.scope != "top" or spec.trunk is not None:
            return spec
        top = self._tops.get(id(spec.net))
        if top is None:
            top = self._tops[id(spec.net)] = top_verifier(spec.net)
        return replace(spec, trunk=self._trunk, top=top)

    def _verifier(self, state: ClientState, global_weights: Weights, private: Params | None) -> VerifierSpec:
        """A trained client verifies with its ``θ_c`` backbone (FedFS) or the global model
        (FedUV, ``verify=global``). A client that never trained has no ``θ_c``: it verifies
        with the current global backbone — the ``θ_c`` it would start from, the model a new
        user gets (:meth:`new_user_verifier`). (A real device refuses to verify before it has
        trained θ_c; the simulator scores such clients like new users instead of dropping them.)"""
        if self.sdk_method == "feduv" or self.verify == "global" or private is None or "personal" not in private:
            return self.new_user_verifier(state, global_weights)
        weights = backbone_weights(private["personal"])
        if self.sdk_method == "fedfs":
            return VerifierSpec(self._personal_vnet, weights, None)
        weights = {**weights, "uv_head.weight": global_weights["uv_head.weight"]}
        if self.verify == "both":
            weights.update({"global_" + k: v for k, v in backbone_weights(global_weights).items()})
            return VerifierSpec(self._dual_vnet, weights, None)
        return VerifierSpec(self._global_vnet, weights, self._codeword_for(state))

    def _codeword_for(self, state: ClientState) -> np.ndarray | None:
        """The codeword a verifier scores against (None: cosine template of ``W·g``)."""
        return state.codeword if self.score == "codeword" else None

    def new_user_verifier(self, state: ClientState, global_weights: Weights) -> VerifierSpec:
        """A new user starts from the shipped global model: ``r'`` template for FedFS,
        global backbone + head + a fresh codeword for the FedUV methods."""
        if self.code_length is None:
            return self._split(VerifierSpec(self._personal_vnet, backbone_weights(global_weights), None,
                                            shared_key="global"))
        return self._split(VerifierSpec(self._global_vnet, self._global_head_weights(global_weights),
                                        self._codeword_for(state), shared_key="global"))

    @staticmethod
    def _global_head_weights(global_weights: Weights) -> Weights:
        return {**backbone_weights(global_weights), "uv_head.weight": global_weights["uv_head.weight"]}
