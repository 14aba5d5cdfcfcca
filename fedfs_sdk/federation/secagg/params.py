"""Parameters of a secure-aggregation round and the communication graph.

Full SecAgg (Bonawitz et al. 2017): every device shares its secrets with, and masks against,
every other device of the round. SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation
with (Poly)Logarithmic Overhead"): each device does so only with its ``k`` neighbours in a
k-regular graph, so device and server cost grow with k ≈ O(log n) instead of n.

The graph here is a Harary graph (a ring where each node links to the k/2 nearest on each
side) over the roster in an order shuffled from public round data; Bell et al. analyse a
random graph — both are k-regular, and the shuffled ring keeps every degree exactly k.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ...errors import InputError
from .encoding import FixedPoint

MAX_DEVICE_ID = (1 << 31) - 2   # ids are Shamir x-coordinates in GF(2^31 − 1), 0 excluded
PROTOCOL_V1 = "fedfs-secagg/1"
"""Honest-but-curious server: unauthenticated advertisements, no ConsistencyCheck."""
PROTOCOL_V2 = "fedfs-secagg/2"
"""Active server: certified identity keys sign the advertisements; ConsistencyCheck round."""


def default_threshold(m: int) -> int:
    """⌊2m/3⌋ + 1 shares of m: tolerates m − t dropouts, and t > m/2 keeps a reconstruction
    set unique."""
    return 2 * m // 3 + 1


def min_threshold(m: int) -> int:
    """The smallest threshold a device accepts: a strict majority of the m share holders."""
    return m // 2 + 1


@dataclass(frozen=True)
class SecAggParams:
    """What the server and every device of a round agree on beforehand.

    ``dim``: number of float parameters; ``threshold``: shares needed to reconstruct a secret
    (``None`` → :func:`default_threshold` of the number of holders); ``neighbours``: ``None``
    for full SecAgg, else an even k ≥ 2 for SecAgg+; ``min_devices``: a round with fewer
    devices in the roster fails (with 1 device the "sum" is that device's update).

    ``participants``: the number of devices invited to the round (``n``). Set, the threshold
    is a function of ``n`` — not of the roster the server shows — and a roster may not be
    larger than ``n`` (Bonawitz et al. 2017 fix ``t`` against ``n`` for the active-adversary
    proof). ``authenticated``: the round runs ``fedfs-secagg/2`` — advertised keys signed by
    certified identity keys (:mod:`.identity`, :mod:`.auth`) and the ConsistencyCheck step
    before unmasking; it needs ``participants``."""

    round_id: int
    dim: int
    fixed_point: FixedPoint = field(default_factory=FixedPoint)
    threshold: int | None = None
    neighbours: int | None = None
    min_devices: int = 3
    participants: int | None = None
    authenticated: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.round_id, bool) or not isinstance(self.round_id, int) or self.round_id < 0:
            raise InputError(f"round_id must be an int ≥ 0, got {self.round_id!r}")
        if not isinstance(self.dim, int) or self.dim < 1:
            raise InputError(f"dim must be a positive int, got {self.dim!r}")
        if self.min_devices < 2:
            raise InputError("min_devices must be ≥ 2: one device's 'sum' is its own update")
        if self.neighbours is not None and (self.neighbours < 2 or self.neighbours % 2):
            raise InputError(f"SecAgg+ neighbours k must be an even int ≥ 2, got {self.neighbours}")
        if self.threshold is not None and self.threshold < 2:
            raise InputError(f"threshold must be ≥ 2, got {self.threshold}")
        if self.participants is not None and (isinstance(self.participants, bool) or not isinstance(
                self.participants, int) or not 2 <= self.participants <= MAX_DEVICE_ID):
            raise InputError(f"participants must be an int ≥ 2, got {self.participants!r}")
        if self.authenticated and self.participants is None:
            raise InputError("an authenticated round (fedfs-secagg/2) needs participants: its threshold is "
                             "fixed against the number of invited devices")

    @property
    def protocol(self) -> str:
        """The wire protocol: ``fedfs-secagg/2`` (identities + ConsistencyCheck) or ``/1``."""
        return PROTOCOL_V2 if self.authenticated else PROTOCOL_V1

    def digest(self) -> bytes:
        """SHA-256 of every agreed parameter: signed into each advertisement (:mod:`.auth`), so
        devices that were told different parameters cannot be put in one roster."""
        fp = self.fixed_point
        doc = [self.protocol, self.round_id, self.dim, repr(float(fp.clip)), fp.scale_bits, fp.max_devices,
               fp.max_samples, self.threshold, self.neighbours, self.min_devices, self.participants]
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).digest()

    @property
    def words(self) -> int:
        """Length of a masked vector in uint64 words: dim values and the sample count."""
        return self.dim + 1

    def holders_per_secret(self, n_roster: int) -> int:
        if self.neighbours is None or self.neighbours >= n_roster - 1:
            return n_roster
        return self.neighbours + 1

    def share_holders(self, n_roster: int) -> int:
        """``m``, the share holders per secret the threshold is measured against: those of the
        invited ``participants`` when set, else of the roster."""
        return self.holders_per_secret(self.participants if self.participants is not None else n_roster)

    def threshold_for(self, n_roster: int) -> int:
        """The threshold of a round whose roster has ``n_roster`` devices; :class:`InputError`
        if the configured one is below the majority minimum."""
        m = self.share_holders(n_roster)
        t = self.threshold if self.threshold is not None else default_threshold(m)
        if t < min_threshold(m):
            raise InputError(f"threshold {t} is below the minimum {min_threshold(m)} for {m} share holders")
        return t


def consistency_quorum(params: SecAggParams, t: int) -> int:
    """Signatures over the same survivor set a device needs before it unmasks (authenticated
    rounds): ``max(t, ⌊2n/3⌋ + 1)`` of the ``n`` invited devices. Under SecAgg+ ``t`` counts
    share holders of one neighbourhood (k + 1); a quorum that small would let two disjoint
    groups of honest devices each sign a different survivor set — see docs/privacy.md."""
    n = params.participants if params.participants is not None else 0
    return max(int(t), default_threshold(n) if n else 0)


def neighbours(params: SecAggParams, roster: Sequence[int], seed: bytes | None = None) -> dict[int, list[int]]:
    """The communication graph on ``roster``: ``{device: sorted neighbours (not itself)}``.

    ``seed``: in an authenticated round the run's :func:`~.auth.run_digest`, a hash of every
    roster device's fresh keys — so the server cannot pick the graph by trying round ids
    (issue 30, attack 2); ``None`` (``fedfs-secagg/1``): round id and roster only."""
    ids = sorted(int(i) for i in roster)
    n = len(ids)
    k = params.neighbours
    if k is None or k >= n - 1:
        return {u: [v for v in ids if v != u] for u in ids}
    if seed is not None:
        digest = hashlib.sha256(b"fedfs-secagg/2|graph|" + bytes(seed)).digest()
    else:
        digest = hashlib.sha256(b"fedfs-secagg/1|graph|%d|" % params.round_id
                                + b",".join(str(i).encode() for i in ids)).digest()
    order = np.random.default_rng(int.from_bytes(digest[:16], "little")).permutation(ids).tolist()
    pos = {u: i for i, u in enumerate(order)}
    return {u: sorted(order[(pos[u] + s) % n] for s in range(-k // 2, k // 2 + 1) if s != 0) for u in ids}
