"""What a device accepts in a secure round, whatever the server says: the device's floors.

The round's parameters (threshold ``t``, SecAgg+ degree ``k``, how many devices, the DP noise)
come from the server's task. Against an active server they cannot be trusted: a threshold of
a bare majority lets a server that splits the devices' views unmask one of them, a tiny
roster or a sparse graph makes "the sum" a sum of one or two updates, a distributed-noise
request for ``min_inputs`` above what can be unmasked leaves the sum with less noise than
promised. :class:`DevicePolicy` holds the device's own settings; the device state machine
(:class:`~.device.SecAggDevice`) refuses a round below any of them with a
:class:`~.errors.RefusedError` naming the setting, before it sends a key.

Secure by default (issue 30): :class:`DevicePolicy()` takes part only in authenticated
rounds (``fedfs-secagg/2``, which need a pinned CA); an unauthenticated ``fedfs-secagg/1``
round — safe against an honest-but-curious server only — needs ``allow_unauthenticated``.
With ``n`` invited devices (authenticated rounds) the floors follow from ``n``: a roster of
at least ``q(n) = ⌊2n/3⌋ + 1`` devices, and a threshold over each device's share holders of
at least ``2q(n) − n``: the guarantee of docs/privacy.md ("Against an active server holding s
certified devices") holds for ``s ≤ 2q(n) − n − 1`` certified devices of the server's, and
that many must never hold ``t`` of one device's shares.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ...errors import InputError
from .errors import RefusedError
from .identity import CaPublicKey
from .params import SecAggParams, default_threshold, min_threshold

THRESHOLD_RULES: dict[str, Callable[[int], int]] = {"two-thirds": default_threshold, "majority": min_threshold}
"""``two-thirds``: ``t ≥ ⌊2m/3⌋ + 1`` of ``m`` share holders — what Bonawitz et al. 2017 need
against an active server (two disjoint groups of ``t`` cannot exist even with < m/3 colluding
devices); ``majority``: ``t ≥ ⌊m/2⌋ + 1``, enough only against an honest-but-curious server."""
ABSOLUTE_MIN_ROSTER = 3
"""With 2 devices each learns the other's update from the published sum."""


@dataclass(frozen=True)
class DevicePolicy:
    """A device's floors for secure rounds (device settings, never the server's).

    Attributes:
        ca: the operator CA's public key pinned on the device. Set: the device takes part only
            in authenticated rounds (``fedfs-secagg/2``), checks every roster entry's
            certificate and signature, and needs its own identity certificate.
        min_roster: fewest devices in the roster (≥ 3).
        threshold_rule: ``two-thirds`` (``t ≥ ⌊2m/3⌋+1`` of the ``m`` share holders; default) or
            ``majority`` (honest-but-curious only).
        min_neighbours: SecAgg+: the smallest degree ``k`` accepted when the graph is sparse
            (``k < roster − 1``); a full graph is always accepted.
        min_noise_multiplier: distributed DP: refuse a round whose ``σ`` is below this; in any
            distributed-noise round the device also refuses ``min_inputs > t`` (a sum of ``t``
            inputs, which the server may unmask, would then hold less than ``σ²C²``).
        require_connected: SecAgg+: refuse to unmask when the survivors' graph is not connected
            (the server would learn each component's sum, not only the total).
        allow_unauthenticated: take part in ``fedfs-secagg/1`` rounds (no identities, no
            consistency check): **honest-but-curious server only** — an active server
            substitutes keys and reads every update. Off by default; the owner's opt-in
            (``fedfs device --allow-unauthenticated-secagg``).
        max_revocation_age_s: require the operator's signed revocation list in every
            authenticated round, issued at most this long ago (``None``: a list is checked when
            the task carries one, but none is required). :mod:`.revocation`.
        allow_dp_clipped_delta: accept the older DP input ``dp_clipped_delta``, whose weight
            word reveals ``Σ min(n, ŵ)`` (sample counts no DP accountant covers). Off by default.
    """

    ca: CaPublicKey | None = None
    min_roster: int = ABSOLUTE_MIN_ROSTER
    threshold_rule: str = "two-thirds"
    min_neighbours: int = 4
    min_noise_multiplier: float | None = None
    require_connected: bool = True
    allow_unauthenticated: bool = False
    allow_dp_clipped_delta: bool = False
    max_revocation_age_s: float | None = None

    def __post_init__(self) -> None:
        if self.ca is not None and not isinstance(self.ca, CaPublicKey):
            raise InputError("ca must be a CaPublicKey (CaPublicKey.load('ca.pub'))")
        if isinstance(self.min_roster, bool) or not isinstance(self.min_roster, int) \
                or self.min_roster < ABSOLUTE_MIN_ROSTER:
            raise InputError(f"min_roster must be an int ≥ {ABSOLUTE_MIN_ROSTER}, got {self.min_roster!r}")
        if self.threshold_rule not in THRESHOLD_RULES:
            raise InputError(f"threshold_rule must be one of {sorted(THRESHOLD_RULES)}, got {self.threshold_rule!r}")
        if isinstance(self.min_neighbours, bool) or not isinstance(self.min_neighbours, int) or self.min_neighbours < 2:
            raise InputError(f"min_neighbours must be an int ≥ 2, got {self.min_neighbours!r}")
        a = self.max_revocation_age_s
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0):
            raise InputError(f"max_revocation_age_s must be a number of seconds > 0, got {a!r}")
        s = self.min_noise_multiplier
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0):
            raise InputError(f"min_noise_multiplier must be a finite number ≥ 0, got {s!r}")

    @classmethod
    def legacy(cls) -> "DevicePolicy":
        """The acceptance rules of ``fedfs-secagg/1`` before device floors existed: a bare
        majority threshold, SecAgg+ degree 2, no connectivity check, no identities. Safe only
        against an honest-but-curious server; kept to show what the floors stop (tests)."""
        return cls(threshold_rule="majority", min_neighbours=2, require_connected=False, allow_unauthenticated=True,
                   allow_dp_clipped_delta=True)

    @classmethod
    def honest_but_curious(cls, **kw: object) -> "DevicePolicy":
        """The default floors, and ``fedfs-secagg/1`` allowed: for a server trusted to follow
        the protocol (``--allow-unauthenticated-secagg``)."""
        return cls(allow_unauthenticated=True, **kw)  # type: ignore[arg-type]

    def min_threshold(self, holders: int) -> int:
        return THRESHOLD_RULES[self.threshold_rule](holders)

    def quorum(self, params: SecAggParams, t: int) -> int:
        """Signatures over one survivor set needed before unmasking (authenticated rounds)."""
        n = params.participants or 0
        return max(int(t), self.min_threshold(n) if n else 0)

    # ---- checks ------------------------------------------------------------------------
    def check_params(self, params: SecAggParams, where: str) -> None:
        """What can be checked before the roster: the protocol and, in an authenticated round
        (whose threshold depends on the invited ``n``), the threshold, size and degree."""
        if not params.authenticated and self.ca is None and not self.allow_unauthenticated:
            raise RefusedError(f"{where}: the round runs {params.protocol} (unauthenticated keys, no consistency "
                               "check: safe only against an honest-but-curious server) and this device pins no "
                               "identity CA; pin one (fedfs device --secagg-ca ca.pub) or opt in with "
                               "--allow-unauthenticated-secagg")
        if self.ca is not None and not params.authenticated:
            raise RefusedError(f"{where}: the round runs {params.protocol} (unauthenticated keys, no consistency "
                               "check) and this device pins an identity CA: it takes part only in fedfs-secagg/2 "
                               "rounds")
        if params.authenticated and self.ca is None:
            raise RefusedError(f"{where}: the round is authenticated (fedfs-secagg/2) and this device pins no "
                               "identity CA to check the others' certificates against")
        if params.participants is not None:
            self._check_size(params, params.participants, "invites", where)

    def check_roster(self, params: SecAggParams, n_roster: int, t: int, where: str) -> None:
        if params.participants is not None and n_roster > params.participants:
            raise RefusedError(f"{where}: the roster lists {n_roster} devices, the round invited "
                               f"{params.participants}")
        need = max(self.min_roster, params.min_devices, self.roster_floor(params))
        if n_roster < need:
            raise RefusedError(f"{where}: roster has {n_roster} devices, fewer than min_devices={need} (this device's "
                               "minimum roster, the round's, or ⌊2n/3⌋ + 1 of the n invited); the sum would reveal "
                               "too much")
        if n_roster < t:
            raise RefusedError(f"{where}: roster has {n_roster} devices, fewer than the threshold {t}")
        self._check_size(params, n_roster, "lists", where, t)

    def roster_floor(self, params: SecAggParams) -> int:
        """``⌊2n/3⌋ + 1`` of the ``n`` invited (0 when ``n`` is not stated, ``fedfs-secagg/1``):
        a roster the server trimmed to the victim and its own devices is refused."""
        n = params.participants
        return 2 * n // 3 + 1 if n else 0

    def _check_size(self, params: SecAggParams, n: int, verb: str, where: str, t: int | None = None) -> None:
        if n < self.min_roster:
            raise RefusedError(f"{where}: the round {verb} {n} devices, fewer than this device's minimum roster "
                               f"{self.min_roster}")
        k = params.neighbours
        if k is not None and k < n - 1 and k < self.min_neighbours:
            raise RefusedError(f"{where}: SecAgg+ degree k = {k} is below this device's minimum {self.min_neighbours}")
        m = params.share_holders(n)
        try:
            t = params.threshold_for(n) if t is None else t
        except InputError as e:
            raise RefusedError(f"{where}: {e}") from None
        need = self.min_threshold(m)
        if t < need:
            raise RefusedError(f"{where}: threshold {t} is below this device's floor {need} ({self.threshold_rule} "
                               f"of {m} share holders)")
        self.check_sybil_floor(params, t, m, where)

    def max_sybils(self, params: SecAggParams) -> int:
        """``s* = 2q(n) − n − 1``: the most certified devices of the ``n`` invited a server may
        hold for the guarantee of docs/privacy.md (with ``2q − n`` it can split the honest
        devices into two groups that each reach the quorum ``q`` with its devices)."""
        n = params.participants or 0
        return max(0, 2 * self.roster_floor(params) - n - 1) if n else 0

    def check_sybil_floor(self, params: SecAggParams, t: int, m: int, where: str) -> None:
        """Authenticated rounds: ``t > s*`` (:meth:`max_sybils`). If the server's ``s*``
        devices could hold ``t`` of one device's ``m`` shares (a sparse SecAgg+ graph the server
        steered — e.g. by choosing its devices' keys after seeing the others' — or chance),
        they would rebuild its secrets, whatever the graph. Then also every device has an
        honest neighbour: ``k + 1 > t > s*``. A full graph always passes (``t ≥ q > s*``)."""
        s = self.max_sybils(params)
        if params.authenticated and params.participants and t <= s:
            raise RefusedError(f"{where}: SecAgg+ threshold {t} of {m} share holders is not above {s}, the "
                               f"certified devices of {params.participants} a server may hold within this protocol's "
                               "guarantee (2⌊2n/3⌋ + 1 − n): use a larger degree k")

    def check_dp_floor(self, dp: object, where: str) -> None:
        """The owner's DP floor holds whatever the task says: with ``min_noise_multiplier`` set,
        a round without DP, or with ``σ`` below the floor (central or distributed), is refused."""
        floor = self.min_noise_multiplier
        if floor is None:
            return
        if dp is None:
            raise RefusedError(f"{where}: the round runs without differential privacy and this device requires a "
                               f"noise multiplier of at least {floor:g}")
        sigma = float(getattr(dp, "noise_multiplier"))
        if not sigma >= floor:
            raise RefusedError(f"{where}: the round's DP noise multiplier σ = {sigma:g} is below this device's "
                               f"minimum {floor:g}")

    def check_dp_noise(self, noise_multiplier: float, min_inputs: int, t: int, where: str) -> None:
        """A distributed-noise DP round: each device adds ``N(0, σ²C²/m)``; any sum of ``≥ t``
        inputs the server may unmask holds ``≥ σ²C²`` only if ``m ≤ t``."""
        if min_inputs > t:
            raise RefusedError(f"{where}: the round asks each device for 1/{min_inputs} of the noise variance, but "
                               f"the server may unmask a sum of {t} inputs (the threshold): that sum would hold "
                               f"only {t}/{min_inputs} of σ²C²")
        floor = self.min_noise_multiplier
        if floor is not None and noise_multiplier < floor:
            raise RefusedError(f"{where}: the round's DP noise multiplier σ = {noise_multiplier:g} is below this "
                               f"device's minimum {floor:g}")


__all__ = ["DevicePolicy", "THRESHOLD_RULES", "ABSOLUTE_MIN_ROSTER"]
