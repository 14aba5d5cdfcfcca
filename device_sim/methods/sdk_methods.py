"""The project's methods on top of ``fedfs_sdk``: pretrained-only, FedFS, FedUV, FedFS+FedUV.

All three trained methods evaluate exactly the device objective of
:func:`fedfs_sdk.training.objective.local_objective` (the function the phone's trainer and the ONNX
training graphs use), called functionally on the executor's parameters.

How each verifies, and the do-no-harm choice among ξ, global and personalized:
:mod:`.sdk_verifiers`.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Mapping

import numpy as np
import torch

from fedfs_sdk.runtime.codes import KNOWN_CODES
from fedfs_sdk.errors import InputError
from fedfs_sdk.training.losses.fedfs import FedFSLossConfig
from fedfs_sdk.nn.model import DualVerifierNet, FaceNet, ModelConfig, personal_config
from fedfs_sdk.training.objective import ObjectiveConfig, local_objective, uses_fedfs, uses_feduv
from fedfs_sdk.training.methods import DEFAULT_UV_WEIGHT
from fedfs_sdk.training.scope import TopFaceNet, check_scope, is_top_key, top_state
from fedfs_sdk.training.selection import DEFAULT_HOLDOUT, holdout_count
from fedfs_sdk.training.trainer import DEFAULT_EPOCHS, DEFAULT_HEAD_LR, DEFAULT_LR, initial_global_weights

from ..trunk_cache import trunk_cache

from .base import (ClientState, FederatedMethod, Params, RoundPlan, SimContext, VerifierSpec, Weights,
                   backbone_weights, frozen, verifier_net)

from .client_stats import FederationStats
from .reference import fold_standardization
from .presets import PRESETS, base_vector  # noqa: F401 (re-exported: the presets, the simulated b_u)
from .selection import SimSelection
from .split_top import split_spec
from .sdk_codewords import SDKCodewords
from .sdk_prepare import SDKPrepare
from .sdk_verifiers import SDKVerifiers

NEG_MODES = ("none", "all", "early")


class PretrainedOnly(FederatedMethod):
    """No federation: every client verifies with ξ and a cosine template (FedFS Table 1's
    "pre-trained model" row)."""

    name = "pretrained"
    trains = False

    def setup(self, ctx: SimContext) -> None:
        super().setup(ctx)
        self._net = verifier_net(ctx.model_config.resolved(), with_head=False)

    def init_global(self) -> Weights:
        return {k: v.detach().clone() for k, v in self.context.xi.state_dict().items()}

    def objective(self, plan, params, consts, x, mask):
        raise RuntimeError("the pretrained-only method does not train")

    def verifier(self, state: ClientState, global_weights: Weights, private: Params | None) -> VerifierSpec:
        return split_spec(VerifierSpec(self._net, backbone_weights(global_weights), None, shared_key="xi"),
                          self.context.xi)


class SDKMethod(SDKPrepare, SDKCodewords, SDKVerifiers, FederatedMethod):
    """Shared machinery of ``fedfs``, ``feduv`` and ``fedfs+feduv``.

    Args:
        code_length: FedUV code length ``c`` ∈ {127, 255, 511} (FedUV Table 1).
        neg: ``ℓ_neg`` schedule — ``none``, ``all`` rounds, or ``early`` (rounds ≤
            ``neg_rounds``; FedUV §6.3 "better accuracy at early epochs").
        neg_rounds: last round with ``ℓ_neg`` when ``neg="early"``.
        lambda_neg: weight of ``ℓ_neg`` when active.
        neg_samples: how many other participants' codewords each client sees for
            ``ℓ_neg`` (simulation only: a real device never learns others' codewords).
        uv_weight: μ of the combined objective.
        verify: ``fedfs+feduv`` only — ``personal`` (default, ambiguity 6 in docs/methods.md:
            ``σ(W q')`` with the client's ``θ_c``) or ``global`` (``σ(W r')``, the shared model
            alone, as FedUV verifies).
        score: FedUV methods only — ``codeword`` (FedUV Eq. 5: ``(1/c) v_uᵀ σ(W g)`` against the
            client's secret codeword) or ``head-template`` (a cosine template of the head
            projection ``W·g``, the FedUV-trained space; no codeword at verification time).
        lr, epochs: this method's local SGD learning rate / epochs (default: the paper's;
            the CLI's ``--lr`` / ``--local-epochs`` override every method).
        fedfs_loss: FedFS loss options (``⊕``, logit mode, K, γ, λ); the keyword options
            ``combine``, ``logits``, ``logit_scale``, ``top_k``, ``gamma``, ``lam`` and
            ``soft_score`` override single fields (CLI: ``fedfs:soft_score=cosine,lam=0.5``).
        norm_init: ``none``, ``center`` or ``standardize``: start ϕ from ξ whose embedding
            normalization affine is re-fitted to the clients' pooled embedding statistics
            (``norm-adapt``'s fold; a federation computes them as a FedAvg of per-client sums).
        scope: which layers of ϕ train — ``top`` (the embedding layer, FedFS projection and FedUV
            head on ξ's frozen, cached trunk; the defaults') or ``all`` (``:paper``);
            :mod:`fedfs_sdk.training.scope`.
        select: do no harm (:mod:`.selection`) — ``on``: each client verifies with ξ, the global
            model or its personalized one, whichever its hold-out check (and the federation's
            verdict) supports; ``off``; ``audit``: check and record, verify with the personalized
            model; ``auto`` (the defaults): ``on`` when the federation's data is a
            :class:`~device_sim.methods.selection.HoldoutView` (``fedfs simulate`` / ``fedfs demo``
            give one), else ``off``.
        holdout: share of a client's training photos kept out of training for that check.
        check: which impostors that check scores — ``in-domain`` (the default): draws in the
            federation's own capture conditions from the statistics round's summed trunk-feature
            moments, with ``norm-adapt`` ξ as a fourth candidate (issue 29); ``public``: the
            shipped public impostor set, capture-matched (the issue-23 tables' behaviour).
        stats_dp, stats_bound, stats_photos: DP on the simulated statistics rounds
            (:mod:`fedfs_sdk.stats.privacy`): the noise multiplier ``z`` of the server's central
            Gaussian noise on ξ's moments and the check results, each photo's L2 clip bound in the
            moments (default :data:`~fedfs_sdk.stats.EMBEDDING_BOUND`) and the photos a client
            contributes (default 64). None: no noise (the round as before).
        preset: ``default`` (the best measured configuration, :data:`PRESETS`,
            docs/personalization.md) or ``paper`` (the papers' values as printed: lr, epochs,
            codeword scoring); explicit options override the preset. CLI: ``fedfs+feduv:paper``.
    """

    sdk_method = "fedfs"

    def __init__(self, code_length: int = 127, neg: str = "none", neg_rounds: int = 5,
                 lambda_neg: float = 1.0, neg_samples: int = 64, uv_weight: float | None = None,
                 verify: str | None = None, fedfs_loss: FedFSLossConfig | None = None, combine: str | None = None,
                 logits: str | None = None, logit_scale: float | None = None, top_k: float | None = None,
                 gamma: float | None = None, lam: float | None = None, soft_score: str | None = None,
                 score: str | None = None, lr: float | None = None, epochs: int | None = None,
                 preset: str = "default", norm_init: str | None = None, scope: str | None = None,
                 select: str | None = None, holdout: float | None = None, check: str | None = None,
                 stats_dp: float | None = None, stats_bound: float | None = None,
                 stats_photos: int | None = None) -> None:
        super().__init__()
        if stats_dp is not None and not (isinstance(stats_dp, (int, float)) and 0 <= stats_dp <= 1e6):
            raise InputError(f"stats_dp (the statistics rounds' DP noise multiplier z) must be a number ≥ 0, got {stats_dp!r}")
        if stats_bound is not None and not (isinstance(stats_bound, (int, float)) and stats_bound > 0):
            raise InputError(f"stats_bound (each photo's L2 clip in the statistics) must be > 0, got {stats_bound!r}")
        if stats_photos is not None and not (isinstance(stats_photos, int) and stats_photos >= 1):
            raise InputError(f"stats_photos (photos a client contributes) must be an int ≥ 1, got {stats_photos!r}")
        self.stats_dp, self.stats_bound, self.stats_photos = stats_dp, stats_bound, stats_photos
        chosen = PRESETS.get(self.sdk_method, {}).get(preset)
        if chosen is None:
            raise InputError(f"unknown preset {preset!r} for {self.sdk_method!r}; "
                             f"choose one of {sorted(PRESETS.get(self.sdk_method, {}))}")
        self.preset = preset
        self._preset_values = chosen
        self.norm_init = norm_init if norm_init is not None else chosen.get("norm_init", "none")
        self._norm_init_asked = norm_init is not None
        if self.norm_init not in ("none", "center", "standardize"):
            raise InputError(f"norm_init must be 'none', 'center' or 'standardize', got {self.norm_init!r}")
        score = score if score is not None else chosen.get("score", "codeword")
        verify = verify if verify is not None else chosen.get("verify", "personal")
        lr = lr if lr is not None else chosen.get("lr")
        epochs = epochs if epochs is not None else chosen.get("epochs")
        uv_weight = uv_weight if uv_weight is not None else chosen.get("uv_weight", DEFAULT_UV_WEIGHT)
        if score not in ("codeword", "head-template"):
            raise InputError(f"score must be 'codeword' or 'head-template', got {score!r}")
        if score != "codeword" and not uses_feduv(self.sdk_method):
            raise InputError(f"score={score!r} needs the FedUV head; method {self.sdk_method!r} has none")
        if (lr is not None and not lr > 0) or (epochs is not None and epochs < 1):
            raise InputError(f"lr must be > 0 and epochs ≥ 1, got lr={lr}, epochs={epochs}")
        self.score, self.lr, self.epochs = score, lr, epochs
        self.scope = check_scope(scope if scope is not None else chosen.get("scope", "all"))
        self.select = select if select is not None else chosen.get("select", "off")
        if self.select not in ("on", "off", "audit", "auto"):
            raise InputError(f"select must be 'auto', 'on', 'off' or 'audit' (check and record, keep the "
                             f"personalized model), got {self.select!r}")
        self.holdout = float(holdout if holdout is not None else DEFAULT_HOLDOUT)
        holdout_count(20, self.holdout)          # validates the fraction
        self.check = check if check is not None else chosen.get("check", "in-domain")
        self.selection = (SimSelection(self, audit=self.select == "audit", check=self.check)
                          if self.select != "off" else None)
        if uses_feduv(self.sdk_method) and code_length not in KNOWN_CODES:
            raise InputError(f"code_length must be one of {sorted(KNOWN_CODES)} (FedUV Table 1), got {code_length}")
        if neg not in NEG_MODES:
            raise InputError(f"neg must be one of {NEG_MODES}, got {neg!r}")
        if neg != "none" and not uses_feduv(self.sdk_method):
            raise InputError(f"ℓ_neg is a FedUV term; method {self.sdk_method!r} has no codewords")
        if neg_rounds < 0 or neg_samples < 1 or lambda_neg < 0:
            raise InputError("neg_rounds must be ≥ 0, neg_samples ≥ 1 and lambda_neg ≥ 0")
        if verify not in ("personal", "global", "both"):
            raise InputError(f"verify must be 'personal', 'global' or 'both', got {verify!r}")
        if verify == "both" and score != "head-template":
            raise InputError("verify=both verifies with a head-space template: it needs score=head-template")
        if verify != "personal" and self.sdk_method != "fedfs+feduv":
            raise InputError(f"verify={verify!r} is a fedfs+feduv option")
        self.verify = verify
        self.code_length = int(code_length) if uses_feduv(self.sdk_method) else None
        self.neg, self.neg_rounds, self.lambda_neg = neg, int(neg_rounds), float(lambda_neg)
        self.neg_samples, self.uv_weight = int(neg_samples), float(uv_weight)
        given = dict(combine=combine, logits=logits, logit_scale=logit_scale, top_k=top_k, gamma=gamma, lam=lam,
                     soft_score=soft_score)
        overrides = {**chosen.get("loss", {}), **{k: v for k, v in given.items() if v is not None}}
        if overrides and not uses_fedfs(self.sdk_method):
            raise InputError(f"FedFS loss options {sorted(overrides)} do not apply to {self.sdk_method!r}")
        self.fedfs_loss = replace(fedfs_loss or FedFSLossConfig(), **overrides)
        self._loss_overrides = overrides
        self._codewords: dict[int, np.ndarray] = {}
        self._norm_fold: tuple[torch.Tensor, torch.Tensor | None] | None = None   # set by prepare()
        self._norm_adapt: Weights | None = None      # ξ after norm-adapt (the in-domain check's candidate)
        self.stats: FederationStats | None = None       # the statistics round (prepare())

    # ---- description -------------------------------------------------------------------
    @property
    def label(self) -> str:
        opts = ["paper"] if self.preset == "paper" else []
        opts += [f"{k}={v}" for k, v in sorted(self._loss_overrides.items())
                 if self._preset_values.get("loss", {}).get(k) != v]
        if self.sdk_method == "fedfs+feduv" and self.uv_weight != self._preset_values.get("uv_weight",
                                                                                          DEFAULT_UV_WEIGHT):
            opts.append(f"μ={self.uv_weight:g}")
        # options that differ from the preset's (the preset's own values are its name)
        for key, value, unset in (("verify", self.verify, "personal"), ("score", self.score, "codeword"),
                                  ("norm_init", self.norm_init, "none"), ("lr", self.lr, None),
                                  ("epochs", self.epochs, None), ("scope", self.scope, "all"),
                                  ("select", self.select, "off"), ("check", self.check, "in-domain"),
                                  ("stats_dp", self.stats_dp, None), ("stats_bound", self.stats_bound, None),
                                  ("stats_photos", self.stats_photos, None)):
            if value is not None and value != self._preset_values.get(key, unset):
                opts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
        if self.code_length is not None:
            neg = {"none": [], "all": ["ℓ_neg"], "early": [f"ℓ_neg≤r{self.neg_rounds}"]}[self.neg]
            opts = [f"c={self.code_length}", *neg, *opts]
        return f"{self.name} ({', '.join(opts)})" if opts else self.name

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"fedfs_loss": asdict(self.fedfs_loss)} if uses_fedfs(self.sdk_method) else {}
        if self.code_length is not None:
            opts.update(code_length=self.code_length, neg=self.neg, neg_rounds=self.neg_rounds,
                        lambda_neg=self.lambda_neg, neg_samples=self.neg_samples)
        if self.sdk_method == "fedfs+feduv":
            opts["uv_weight"] = self.uv_weight
            opts["verify"] = self.verify
        opts["preset"] = self.preset
        if self.scope != "all":
            opts["scope"] = self.scope
        if self.select != "off":
            opts.update(select=self.select, holdout=self.holdout, check=self.check)
        if self.norm_init != "none":
            opts["norm_init"] = self.norm_init
        for k in ("stats_dp", "stats_bound", "stats_photos"):
            if getattr(self, k) is not None:
                opts[k] = getattr(self, k)
        if self.score != "codeword":
            opts["score"] = self.score
        if self.lr is not None or self.epochs is not None:
            opts.update(lr=self.lr, epochs=self.epochs)
        return opts

    def default_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.sdk_method]

    def default_local_epochs(self) -> int:
        return self.epochs if self.epochs is not None else DEFAULT_EPOCHS[self.sdk_method]

    def default_head_lr(self) -> float | None:
        """The FedUV head's own rate, the same default a device uses
        (:data:`fedfs_sdk.training.trainer.DEFAULT_HEAD_LR`, measured there)."""
        return DEFAULT_HEAD_LR

    def min_batch(self) -> int:
        return 2 if uses_fedfs(self.sdk_method) else 1

    # ---- set-up ------------------------------------------------------------------------
    def setup(self, ctx: SimContext) -> None:
        super().setup(ctx)
        base = ctx.model_config.resolved()
        proj = self.fedfs_loss.projection_dim(int(base.embedding_dim)) if uses_fedfs(self.sdk_method) else None
        self.model_config: ModelConfig = replace(base, proj_dim=proj, code_length=self.code_length)
        dev = torch.device(ctx.device)
        # Skeletons only: their tensors are replaced by functional_call's params.
        self.global_net = frozen(FaceNet(self.model_config)).to(dev)
        self.personal_net = (frozen(FaceNet(personal_config(self.model_config))).to(dev)
                             if uses_fedfs(self.sdk_method) else None)
        self.xi = frozen(ctx.xi).to(dev) if uses_fedfs(self.sdk_method) else None
        self._personal_vnet = verifier_net(personal_config(self.model_config), with_head=False)
        self._global_vnet = verifier_net(self.model_config, with_head=self.code_length is not None)
        if self.score == "head-template":
            self._global_vnet = verifier_net(self.model_config, with_head=True, project=True)
        if self.verify == "both":
            face, glob = FaceNet(self.model_config), FaceNet(self.model_config)
            self._dual_vnet = DualVerifierNet(face.backbone, glob.backbone, face.uv_head)
        self._tops: dict[int, torch.nn.Module] = {}
        if self.scope == "top":     # ξ, global and personal share ξ's trunk: train and verify on its features
            self._trunk = trunk_cache(frozen(ctx.xi).to(dev).backbone)
            self._global_top = TopFaceNet(self.global_net)
            self._personal_top = TopFaceNet(self.personal_net) if self.personal_net is not None else None
            self._xi_top = TopFaceNet(self.xi) if self.xi is not None else None

    def init_global(self) -> Weights:
        ctx = self.context
        weights = initial_global_weights(self.model_config, ctx.xi, seed=ctx.seed)
        return weights if self._norm_fold is None else fold_standardization(weights, *self._norm_fold)

    def init_private(self, global_weights: Weights) -> Params:
        """``θ_c`` of a client's first participation: the global weights it receives in that
        round without ``uv_head.*`` — what a device does (``LocalTrainer.train`` with
        ``personal_weights=None``). The federation calls it with the current global model
        every round (and with the round-0 one for the client store's delta base). The tensors
        are the global ones, detached, not copies (the store flattens them, executors copy)."""
        if not uses_fedfs(self.sdk_method):
            return {}
        return {"personal": {k: v.detach() for k, v in global_weights.items() if not k.startswith("uv_head.")}}

    @property
    def private_groups(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("personal",) if uses_fedfs(self.sdk_method) else ()

    # ---- one round ---------------------------------------------------------------------
    def configure_round(self, round_idx: int, participants: np.ndarray) -> RoundPlan:
        lneg = self.lambda_neg_at(round_idx) if self.code_length is not None else 0.0
        cfg = ObjectiveConfig(fedfs=self.fedfs_loss, uv_weight=self.uv_weight, lambda_neg=lneg)
        return RoundPlan(round_idx, np.asarray(participants), {"objective": cfg})

    def objective(self, plan: RoundPlan, params: Params, consts: Mapping[str, torch.Tensor],
                  x: torch.Tensor | None, mask: torch.Tensor | None,
                  features: Mapping[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.scope == "top":     # the trunk's tensors get no gradient: they stay ξ's
            features = dict(features or {})
            trunk = features.pop("trunk", None)         # computed once per image by the batched executor
            return local_objective(
                self.sdk_method, plan.extras["objective"], self._trunk(x) if trunk is None else trunk,
                self._global_top,
                personal_model=self._personal_top, xi=self._xi_top,
                codeword=consts.get("codeword"), neg_codewords=consts.get("neg_codewords"),
                global_params=top_state(params["global"]),
                personal_params=top_state(params["personal"]) if "personal" in params else None, mask=mask,
                features=features)
        return local_objective(
            self.sdk_method, plan.extras["objective"], x, self.global_net,
            personal_model=self.personal_net, xi=self.xi,
            codeword=consts.get("codeword"), neg_codewords=consts.get("neg_codewords"),
            global_params=params["global"], personal_params=params.get("personal"), mask=mask,
            features=features)

    def xi_model(self) -> torch.nn.Module | None:
        return self.xi

    def trains_tensor(self, group: str, name: str) -> bool:
        return self.scope != "top" or is_top_key(name)

    def frozen_stem(self) -> torch.nn.Module | None:
        return self._trunk.trunk if self.scope == "top" else None

    def xi_after_stem(self) -> torch.nn.Module | None:
        return self._xi_top if self.scope == "top" else None

    def trunks(self) -> dict[str, torch.nn.Module]:
        if self.scope == "top":     # the trunk is ξ's and frozen: nothing to fold, only the top trains
            return {}
        out = {"global": self.global_net.backbone}
        if self.personal_net is not None:
            out["personal"] = self.personal_net.backbone
        return out

    def learning_rate(self, group: str, name: str, base_lr: float, head_lr: float | None) -> float:
        # The FedUV head W starts random while the backbone starts pre-trained, and σ makes the
        # loss invariant to the scale of W (the effective step shrinks as 1/||W||²): W gets its
        # own learning rate (``head_lr``; ``trainer.TrainConfig`` does the same for fedfs+feduv).
        if name.startswith("uv_head.") and head_lr is not None:
            return head_lr
        return base_lr


class FedFSMethod(SDKMethod):
    """FedFS (FedFS Alg. 1): ``F_total`` (Eq. 9) on global, personalized and frozen ξ."""

    name = sdk_method = "fedfs"


class FedUVMethod(SDKMethod):
    """FedUV (FedUV Alg. 2): ``ℓ_pos`` (+ scheduled ``λ_neg ℓ_neg``) on the global model."""

    name = sdk_method = "feduv"


class FedFSUVMethod(SDKMethod):
    """FedFS + FedUV: FedFS personalization plus the shared FedUV head and codewords."""

    name = sdk_method = "fedfs+feduv"


__all__ = ["PretrainedOnly", "SDKMethod", "FedFSMethod", "FedUVMethod", "FedFSUVMethod", "NEG_MODES",
           "PRESETS", "base_vector"]
