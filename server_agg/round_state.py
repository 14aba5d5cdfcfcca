"""What the round modules share: the published model held in memory, the open round, the event log
and the device constants (moved down from :mod:`server_agg.rounds`, which re-exports them)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from fedfs_sdk.federation.wire import model_nbytes

from .aggregate import StreamingFedAvg
from .config import RoundPolicy
from .dp import DpFedAvg
from .secagg_rounds import SecAggRound

log = logging.getLogger("fedfs.server")

BASE_BITS = 32
SEEN_WRITE_INTERVAL_S = 5.0
"""``devices.last_seen`` is rewritten at most this often per device (it only has to survive a
restart; the in-memory time decides liveness). A polling device costs no write per poll."""
@dataclass(frozen=True)
class GlobalModel:
    """A published global version held in memory (the reference of the open round)."""

    version: int
    sha256: str
    weights: dict[str, torch.Tensor]
    model_config: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return model_nbytes(self.weights)


@dataclass
class OpenRound:
    id: int
    model_version: int
    task: dict[str, Any]
    policy: RoundPolicy
    participants: frozenset[str]
    quorum: int
    opened_at: float
    deadline: float
    acc: StreamingFedAvg | DpFedAvg
    accepted: dict[str, dict[str, Any]] = field(default_factory=dict)
    secagg: SecAggRound | None = None          # a secure-aggregation round (server_agg.secagg_rounds)


def _event(msg: str, **fields: Any) -> None:
    log.info(msg, extra={"fields": fields})


__all__ = ["GlobalModel", "OpenRound", "BASE_BITS", "SEEN_WRITE_INTERVAL_S"]
