"""The papers' baselines on the simulator's method interface (``docs/baselines.md``).

* ``softmax`` — softmax-FedAvg with a classifier over all clients' classes (FedUV §6.2).
* ``fedaws`` — positive loss + server spread-out regularizer (Yu et al. 2020; FedUV §3.3).
* ``fedgc`` — FedPE + server softmax-regularizer gradient correction (FedGC Eq. 5, Alg. 1).
* ``privacyface`` — DPLC cluster centres + consensus-aware loss (PrivacyFace Alg. 1–2, Eq. 5).
"""
from __future__ import annotations

from typing import Callable

from ..base import FederatedMethod
from .common import ClassEmbeddingBaseline
from .dplc import DPLCResult, dplc, dplc_sigma
from .fedaws import FedAwS, spreadout_regularizer, spreadout_step
from .fedgc import FedGC, gradient_correction_step, softmax_regularizer
from .privacyface import PrivacyFace, consensus_aware_loss
from .server_held import ServerHeldClassEmbeddings
from .softmax import SoftmaxFedAvg

BASELINES: dict[str, Callable[..., FederatedMethod]] = {
    "softmax": SoftmaxFedAvg,
    "fedaws": FedAwS,
    "fedgc": FedGC,
    "privacyface": PrivacyFace,
}

__all__ = ["BASELINES", "ClassEmbeddingBaseline", "ServerHeldClassEmbeddings", "SoftmaxFedAvg", "FedAwS", "FedGC",
           "PrivacyFace", "dplc", "dplc_sigma", "DPLCResult", "spreadout_regularizer", "spreadout_step",
           "softmax_regularizer", "gradient_correction_step", "consensus_aware_loss"]
