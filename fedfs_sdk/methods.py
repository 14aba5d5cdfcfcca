"""The on-device training methods by name and their default local-training settings
(torch-free, so a phone-like process can read a round task): ``fedfs`` (FedFS Alg. 1),
``feduv`` (FedUV Alg. 1–2), ``fedfs+feduv``. The torch trainer, the simulator, the ORT
training artifacts and the artifact-only device all take their defaults from here."""
from __future__ import annotations

from .errors import InputError

METHODS: tuple[str, ...] = ("fedfs", "feduv", "fedfs+feduv")

DEFAULT_LR = {"fedfs": 5e-3, "feduv": 0.1, "fedfs+feduv": 5e-3}
"""FedFS §4.1: SGD lr 5e-3; FedUV §6: SGD lr 0.1."""
DEFAULT_EPOCHS = {"fedfs": 2, "feduv": 1, "fedfs+feduv": 2}
"""FedFS §4.1: 2 local epochs; FedUV §6: 1 local epoch."""
DEFAULT_HEAD_LR = 20.0
"""SGD lr of the FedUV head ``W`` (``feduv``, ``fedfs+feduv``). σ makes ``ℓ_pos`` invariant to
the scale of ``W``, so the effective step on ``W`` is ``lr/‖W‖²``-small, and ``W`` starts
random while the backbone starts from ξ. Measured on SynthFaces (feduv, 100 clients,
p = 0.5, 10 rounds, ξ-initialized tiny backbone, see docs/methods.md): per-client AUROC
0.53 / 0.56 / 0.69 / 0.79 / 0.82 for a head lr of 0.1 / 1 / 5 / 20 / 100."""
DEFAULT_UV_WEIGHT = 10.0
"""μ of ``fedfs+feduv``: ``F_total + μ·½(ℓ_pos(σ(W r')) + ℓ_pos(σ(W q')))`` (our combination;
neither paper defines it). The FedFS lr (5e-3) moves the backbones slowly for the FedUV term,
so μ = 1 leaves the codeword verifier behind FedUV alone. Measured on SynthFaces (100
clients, p = 0.5, 10 rounds, c = 127; FedUV alone 0.800): per-client AUROC 0.732 / 0.841 /
0.863 / 0.866 / 0.814 for μ = 1 / 5 / 10 / 20 / 50 (docs/simulation.md)."""
DEFAULT_BATCH_SIZE = 32
"""Local mini-batch size (the papers do not state one for the device step)."""


def check_method(method: str) -> str:
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; choose one of {METHODS}")
    return method


def uses_fedfs(method: str) -> bool:
    """Trains a personalized model ``θ_c`` next to the global one, against a frozen ξ."""
    return method in ("fedfs", "fedfs+feduv")


def uses_feduv(method: str) -> bool:
    """Has a FedUV head ``W`` and a secret codeword ``v_u``."""
    return method in ("feduv", "fedfs+feduv")


__all__ = ["METHODS", "DEFAULT_LR", "DEFAULT_EPOCHS", "DEFAULT_HEAD_LR", "DEFAULT_UV_WEIGHT", "DEFAULT_BATCH_SIZE",
           "check_method", "uses_fedfs", "uses_feduv"]
