"""Round policy: which method the devices train, how many devices a round samples, when
it closes, how uploads are bounded. Persisted in the server's database as JSON; the admin
changes it with ``PUT /v1/admin/config`` and the change applies from the next round (an
open round keeps the snapshot it was opened with).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.wire_format import MAX_ID, is_finite_number
from fedfs_sdk.training.objective import METHODS, uses_fedfs, uses_feduv

MAX_NEG_CODEWORDS = 1 << 16
"""ℓ_neg codewords a device draws per round: each is a ``c``-bit vector held on the device."""
MAX_NUM_SAMPLES = 2**40
"""|D_c| · weights summed in float64 over many devices: keep the claim far from overflow."""
MAX_SECONDS = 366 * 24 * 3600.0
"""Largest round timeout / liveness window (a year): beyond it a deadline means "never"."""
DEVICE_TTL_POLLS = 10
"""Default liveness window, in the server's poll intervals (``fedfs serve --poll-interval``): a
waiting device asks for a task every interval, so ten missed polls mean it is gone."""
MIN_DEVICE_TTL_S = 60.0
"""… but at least this many seconds: a poll can be late by a slow TLS handshake on a loaded
server or by the client's own retries, and a live device must not drop out of the sample for it."""


@dataclass(frozen=True)
class RoundPolicy:
    """How rounds are run.

    Attributes:
        method: what devices train: ``feduv`` | ``fedfs`` | ``fedfs+feduv``.
        train: training settings published in the task (``fedfs_sdk.federation.wire.TRAIN_KEYS``).
        neg_codewords: FedUV ℓ_neg (Eq. 4): how many random codewords a device draws
            locally when ``train.objective.lambda_neg > 0`` (no other user's codeword exists
            on a device).
        participation: fraction of registered devices sampled per round (FedFS §4.1 uses
            0.01–0.7), in (0, 1].
        min_participants: a round opens only when at least this many devices are
            registered, and samples at least this many.
        quorum: fraction of the sampled devices whose accepted updates close the round
            early, in (0, 1].
        min_updates: at the deadline a round with at least this many updates is
            aggregated; with fewer it fails and the global model stays as it was.
        round_timeout_s: seconds from opening to the deadline.
        rounds: run this many successful rounds automatically (0: the admin opens rounds).
        max_update_norm: optional bound on ``‖w_c − w‖₂``; larger updates are clipped to it.
        max_num_samples: largest ``|D_c|`` a device may claim (bounds one device's weight).
        seed: seeds the participant sampling (round ``t`` uses ``seed`` and ``t``).
        device_ttl_s: liveness: only devices whose last authenticated request (any, e.g.
            ``GET /v1/task``) is at most this many seconds old are sampled; registering is not
            such a request, so a device that registered and never polled is never sampled.
            ``None``: :meth:`device_ttl` — ``DEVICE_TTL_POLLS`` poll intervals, at least
            ``MIN_DEVICE_TTL_S``; ``0``: every registered device is eligible (liveness off).
        dp_noise_multiplier: user-level DP-FedAvg (McMahan et al. 2018; ``server_agg.dp``):
            the noise std ``σ`` in units of the clip norm ``C = max_update_norm`` (required
            then). ``None``: no DP. With DP, rounds sample devices by Poisson sampling at
            rate ``participation``, weigh them ``min(n/dp_weight_cap, 1)`` and divide by the
            fixed ``participation · N``.
        dp_delta: the δ at which ε is reported and the budget is checked (DP on: required).
        dp_epsilon_budget: a round whose opening would take ε above this is refused and the
            automatic federation stops (``None``: no budget, ε is still reported).
        dp_weight_cap: ``ŵ``: a device's weight ``min(|D_c|/ŵ, 1)`` (1: all weigh the same).
        dp_accountant: ``rdp`` or ``pld`` (Google ``dp-accounting``).
        dp_noise: ``central`` (the server adds ``N(0, σ²C²)`` to the sum) or ``distributed``
            (secure aggregation only: each device adds ``N(0, σ²C²/m)`` to its masked input
            and the round fails before unmasking with fewer than ``m`` inputs).
        secure_aggregation: rounds run the secure-aggregation protocol (Bonawitz et al. 2017;
            ``server_agg.secagg_rounds``): the server learns only ``Σ n·w`` and ``Σ n`` of the
            surviving devices. ``max_update_norm`` alone is refused (the server cannot clip an
            update it never sees); with DP-FedAvg each device clips ``Δ`` to it and masks
            ``min(n, ŵ)·Δ``, and the server adds the noise to the unmasked sum (docs/privacy.md).
        secagg_threshold: Shamir threshold ``t`` (``None``: ``⌊2m/3⌋ + 1`` of the ``m`` share
            holders; at least a strict majority).
        secagg_neighbours: ``None`` for full SecAgg, else an even ``k`` (SecAgg+, Bell et al. 2020).
        secagg_clip: fixed-point range: each weight is clipped to ``[-clip, clip]`` (a DP
            round's range is ``max_update_norm`` instead: it masks ``Δ``, ``‖Δ‖₂ ≤ C``).
        secagg_scale_bits: fixed-point resolution ``2^-scale_bits``.
        secagg_min_devices: a round with fewer devices advertising keys fails (≥ 3).
        secagg_phase_timeout_s: deadline of each key / unmasking phase (the masked-input phase,
            which includes training, ends at ``round_timeout_s``).
        stats_rounds: with ``rounds`` > 0 and a served ξ, the server opens the statistics rounds the
            defaults' do-no-harm rule needs by itself (:mod:`server_agg.stats_auto`, issue 29): ξ's
            moments before the first weight round, the devices' check results after the last.
        stats_dp_noise_multiplier: DP on the automatic statistics rounds (:mod:`fedfs_sdk.stats.privacy`):
            Gaussian noise of ``z`` × each statistic's sensitivity (None: no noise); ``stats_dp_noise``
            ``central`` (the server adds it to the unmasked sum) or ``distributed`` (each device adds
            ``1/m`` of the variance before masking); ``stats_dp_delta``: the δ of the published ε
            (None: ``N^-1.1``).
        stats_bound: each photo's L2 clip in the automatic rounds' ξ moments (None: 1e3, which only
            stops a malicious device; under DP the noise grows with ``bound²``: set it near ξ's norms).
        secagg_ca: the operator CA's public key (the ``ca.pub`` document of ``fedfs ca init``).
            Set: secure rounds run ``fedfs-secagg/2`` — devices present CA-certified identity
            keys and sign their advertised keys, the threshold is fixed against the number of
            invited devices, and a consistency check precedes unmasking; the server also checks
            the certificates (devices check them themselves). ``None``: ``fedfs-secagg/1``
            (honest-but-curious server).
    """

    method: str = "feduv"
    train: Mapping[str, Any] = field(default_factory=dict)
    neg_codewords: int = 0
    participation: float = 1.0
    min_participants: int = 1
    quorum: float = 1.0
    min_updates: int = 1
    round_timeout_s: float = 600.0
    rounds: int = 0
    max_update_norm: float | None = None
    max_num_samples: int = 1_000_000
    seed: int = 0
    device_ttl_s: float | None = None
    dp_noise_multiplier: float | None = None
    dp_delta: float | None = None
    dp_epsilon_budget: float | None = None
    dp_weight_cap: int = 1
    dp_accountant: str = "rdp"
    dp_noise: str = "central"
    secure_aggregation: bool = False
    secagg_threshold: int | None = None
    secagg_neighbours: int | None = None
    secagg_clip: float = 256.0
    secagg_scale_bits: int = 24
    secagg_min_devices: int = 3
    secagg_phase_timeout_s: float = 60.0
    secagg_ca: Mapping[str, Any] | None = None
    stats_rounds: bool = True
    stats_dp_noise_multiplier: float | None = None
    stats_dp_noise: str = "central"
    stats_dp_delta: float | None = None
    stats_bound: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; choose one of {METHODS}")
        _check_int("neg_codewords", self.neg_codewords, 0, MAX_NEG_CODEWORDS)
        _check_fraction("participation", self.participation)
        _check_int("min_participants", self.min_participants, 1)
        _check_fraction("quorum", self.quorum)
        _check_int("min_updates", self.min_updates, 1)
        _check_number("round_timeout_s", self.round_timeout_s, positive=True, maximum=MAX_SECONDS)
        _check_int("rounds", self.rounds, 0)
        if self.max_update_norm is not None:
            _check_number("max_update_norm", self.max_update_norm, positive=True)
        _check_int("max_num_samples", self.max_num_samples, 1, MAX_NUM_SAMPLES)
        _check_int("seed", self.seed, 0)
        if self.device_ttl_s is not None:
            _check_number("device_ttl_s", self.device_ttl_s, maximum=MAX_SECONDS)
            if self.device_ttl_s < 0:
                raise InputError(f"device_ttl_s must be ≥ 0 (0 disables the liveness rule), got {self.device_ttl_s!r}")
        self._check_dp()
        if self.stats_dp_noise_multiplier is not None or self.stats_dp_delta is not None \
                or self.stats_dp_noise != "central":
            from fedfs_sdk.stats.privacy import StatsDp

            if self.stats_dp_noise_multiplier is None:
                raise InputError("stats_dp_noise / stats_dp_delta need stats_dp_noise_multiplier (z) too")
            StatsDp(self.stats_dp_noise_multiplier, self.stats_dp_noise, self.stats_dp_delta)   # validates
        if self.stats_bound is not None:
            _check_number("stats_bound", self.stats_bound, positive=True)
        self._check_secagg()
        if not isinstance(self.train, Mapping):
            raise InputError("train must be an object")
        from fedfs_sdk.federation.wire import train_config_from_json
        cfg = train_config_from_json(self.method, self.train)  # raises InputError when invalid
        if cfg.objective.lambda_neg > 0 and uses_feduv(self.method) and self.neg_codewords < 1:
            raise InputError("train.objective.lambda_neg > 0 needs neg_codewords ≥ 1 (FedUV ℓ_neg)")
        object.__setattr__(self, "train", json.loads(json.dumps(dict(self.train))))

    def _check_secagg(self) -> None:
        """Secure-aggregation settings: valid, and not combined with what needs plain updates."""
        if not isinstance(self.secure_aggregation, bool):
            raise InputError(f"secure_aggregation must be true or false, got {str(self.secure_aggregation)[:40]}")
        if self.secagg_threshold is not None:
            _check_int("secagg_threshold", self.secagg_threshold, 2, 1 << 31)
        if self.secagg_neighbours is not None:
            _check_int("secagg_neighbours", self.secagg_neighbours, 2, 1 << 31)
            if self.secagg_neighbours % 2:
                raise InputError(f"secagg_neighbours (SecAgg+ k) must be even, got {self.secagg_neighbours}")
        _check_number("secagg_clip", self.secagg_clip, positive=True, maximum=1e6)
        _check_int("secagg_scale_bits", self.secagg_scale_bits, 0, 52)
        _check_int("secagg_min_devices", self.secagg_min_devices, 3, 1 << 31)
        _check_number("secagg_phase_timeout_s", self.secagg_phase_timeout_s, positive=True, maximum=MAX_SECONDS)
        if self.secagg_ca is not None:
            from fedfs_sdk.federation.secagg import CaPublicKey, IdentityError

            try:
                ca = CaPublicKey.from_json(self.secagg_ca)
            except IdentityError as e:
                raise InputError(f"secagg_ca is not a fedfs CA public key (the ca.pub of fedfs ca init): {e}") from None
            object.__setattr__(self, "secagg_ca", ca.to_json())
        if not self.secure_aggregation:
            return
        from fedfs_sdk.federation.secagg import FixedPoint   # checks range × samples × resolution fits 63 bits

        if self.dp_noise_multiplier is not None:
            if self.dp_noise == "distributed":   # the range must hold the noise tails too
                from .secagg_rounds import dp_range

                FixedPoint(clip=dp_range(self, self.secagg_min_devices), scale_bits=self.secagg_scale_bits,
                           max_devices=1, max_samples=1)
            # DP-FedAvg under secure aggregation: each device clips Δ = w_c − w to C = max_update_norm
            # and masks w_k·Δ, w_k = min(n/ŵ, 1), with weight word 1; the fixed-point range is C (not
            # secagg_clip). The server adds the noise to the unmasked sum (or the devices, distributed).
            FixedPoint(clip=float(self.max_update_norm), scale_bits=self.secagg_scale_bits,  # type: ignore[arg-type]
                       max_devices=1, max_samples=1)
            return
        if self.max_update_norm is not None:
            raise InputError("secure aggregation cannot clip updates to max_update_norm: the server never sees "
                             "one; unset max_update_norm (the fixed-point range secagg_clip bounds each weight), "
                             "or turn DP-FedAvg on (dp_noise_multiplier), where devices clip to it themselves")
        FixedPoint(clip=float(self.secagg_clip), scale_bits=self.secagg_scale_bits, max_devices=1,
                   max_samples=self.max_num_samples)

    def _check_dp(self) -> None:
        """DP-FedAvg settings: consistent, or a clear error naming the missing one."""
        _check_int("dp_weight_cap", self.dp_weight_cap, 1, MAX_NUM_SAMPLES)
        if self.dp_accountant not in ("rdp", "pld"):
            raise InputError(f"dp_accountant must be 'rdp' or 'pld', got {str(self.dp_accountant)[:40]!r}")
        if self.dp_noise not in ("central", "distributed"):
            raise InputError(f"dp_noise must be 'central' or 'distributed', got {str(self.dp_noise)[:40]!r}")
        if self.dp_noise == "distributed" and not (self.secure_aggregation and self.dp_noise_multiplier is not None):
            raise InputError("dp_noise = distributed needs DP (dp_noise_multiplier) and secure_aggregation: "
                             "without masking, each device's noise would be seen alone")
        if self.dp_delta is not None:
            _check_number("dp_delta", self.dp_delta, positive=True)
            if not self.dp_delta < 1:
                raise InputError(f"dp_delta must be in (0, 1), got {self.dp_delta!r}")
        if self.dp_epsilon_budget is not None:
            _check_number("dp_epsilon_budget", self.dp_epsilon_budget, positive=True)
        if self.dp_noise_multiplier is None:
            if self.dp_epsilon_budget is not None:
                raise InputError("dp_epsilon_budget needs DP on: set dp_noise_multiplier (σ) too")
            return
        _check_number("dp_noise_multiplier", self.dp_noise_multiplier, maximum=1e6)
        if self.dp_noise_multiplier < 0:
            raise InputError(f"dp_noise_multiplier must be ≥ 0, got {self.dp_noise_multiplier!r}")
        if self.max_update_norm is None:
            raise InputError("DP (dp_noise_multiplier) needs max_update_norm: it is the clip norm C the noise "
                             "is calibrated to (--max-update-norm)")
        if self.dp_delta is None:
            raise InputError("DP (dp_noise_multiplier) needs dp_delta, the δ that ε is reported at "
                             "(--dp-delta; McMahan et al. use N^-1.1 for N users)")

    @property
    def dp(self) -> bool:
        """Whether rounds run user-level DP-FedAvg."""
        return self.dp_noise_multiplier is not None

    def sample_size(self, registered: int) -> int:
        """How many of ``registered`` devices a round samples: ``max(min, ⌈fraction·N⌉)``, ≤ N."""
        return min(registered, max(self.min_participants, math.ceil(self.participation * registered)))

    def device_ttl(self, poll_interval_s: float) -> float:
        """The liveness window in seconds (0: disabled) of a server that tells waiting devices
        to poll every ``poll_interval_s``: ``device_ttl_s``, else
        ``max(MIN_DEVICE_TTL_S, DEVICE_TTL_POLLS · poll_interval_s)``."""
        if self.device_ttl_s is not None:
            return float(self.device_ttl_s)
        return max(MIN_DEVICE_TTL_S, DEVICE_TTL_POLLS * float(poll_interval_s))

    def quorum_count(self, sampled: int) -> int:
        return max(1, math.ceil(self.quorum * sampled))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RoundPolicy":
        return cls().updated(data)

    def updated(self, changes: Mapping[str, Any]) -> "RoundPolicy":
        """A copy with ``changes`` applied (unknown keys → :class:`InputError`)."""
        if not isinstance(changes, Mapping):
            raise InputError("policy changes must be a JSON object")
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InputError(f"unknown policy settings {unknown}; known: {sorted(known)}")
        try:
            return replace(self, **dict(changes))
        except TypeError as e:
            raise InputError(f"invalid policy: {e}") from None


def missing_model_field(method: str, model_config: Mapping[str, Any] | None) -> str | None:
    """The model setting devices need to train ``method`` that a model with ``model_config``
    lacks: ``"code_length"`` (the FedUV head) or ``"proj_dim"`` (the FedFS projection); None
    if they can train it (or there is no model yet)."""
    if model_config is None:
        return None
    if uses_feduv(method) and not model_config.get("code_length"):
        return "code_length"
    if uses_fedfs(method) and not model_config.get("proj_dim"):
        return "proj_dim"
    return None


def mismatch_reason(method: str, missing: str, model: str = "this model") -> str:
    """The sentence for a :func:`missing_model_field` result ``missing``, naming ``model``."""
    what = "a FedUV head" if missing == "code_length" else "the FedFS projection"
    return f"method {method!r} needs a model with {what} ({missing}), and {model} has none"


def proj_dim_mismatch(method: str, model_config: Mapping[str, Any] | None, xi_config: Mapping[str, Any] | None,
                      train: Mapping[str, Any]) -> tuple[int, int, int, str] | None:
    """``(proj_dim, needed, ξ dims, combine)`` when a FedFS ``method`` cannot train a model
    with ``model_config`` against a ξ with ``xi_config``; None when it can (or nothing to check).

    FedFS Eq. 2 compares ``z = r ⊕ q`` with ``v = ξ(x)``: with ``combine = concat`` each of
    ``r``, ``q`` has half of ξ's embedding size, with ``sum`` all of it. A mismatch fails
    every device in its first round (``set proj_dim = …``)."""
    if not uses_fedfs(method) or model_config is None or xi_config is None or not model_config.get("proj_dim"):
        return None
    from fedfs_sdk.training.losses.fedfs import FedFSLossConfig

    cfg = FedFSLossConfig(**dict((train.get("objective") or {}).get("fedfs") or {}))
    xi_dim = int(xi_config["embedding_dim"])
    need = cfg.projection_dim(xi_dim)
    have = int(model_config["proj_dim"])
    return None if have == need else (have, need, xi_dim, cfg.combine)


def _check_int(name: str, v: Any, minimum: int, maximum: int = MAX_ID) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise InputError(f"{name} must be an integer in [{minimum}, {maximum}], got {str(v)[:40]}")


def _check_number(name: str, v: Any, positive: bool = False, maximum: float | None = None) -> None:
    if not is_finite_number(v) or (positive and v <= 0):
        raise InputError(f"{name} must be a finite{' positive' if positive else ''} number, got {str(v)[:40]}")
    if maximum is not None and v > maximum:
        raise InputError(f"{name} must be ≤ {maximum:g}, got {str(v)[:40]}")


def _check_fraction(name: str, v: Any) -> None:
    _check_number(name, v)
    if not 0 < v <= 1:
        raise InputError(f"{name} must be in (0, 1], got {v!r}")


__all__ = ["RoundPolicy", "missing_model_field", "mismatch_reason", "proj_dim_mismatch", "MAX_NEG_CODEWORDS", "MAX_NUM_SAMPLES", "MAX_SECONDS"]
