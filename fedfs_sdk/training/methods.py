"""The on-device training methods by name and their default local-training settings
(torch-free, so a phone-like process can read a round task): ``fedfs`` (FedFS Alg. 1),
``feduv`` (FedUV Alg. 1–2), ``fedfs+feduv``. The torch trainer, the simulator, the ORT
training artifacts and the artifact-only device all take their defaults from here."""
from __future__ import annotations

from ..errors import InputError

METHODS: tuple[str, ...] = ("fedfs", "feduv", "fedfs+feduv")

PAPER_LR = {"fedfs": 5e-3, "feduv": 0.1, "fedfs+feduv": 5e-3}
"""The papers' local SGD rates: FedFS §4.1 lr 5e-3; FedUV §6 lr 0.1 (``fedfs+feduv`` takes
FedFS's). The ``paper`` presets (``fedfs+feduv:paper`` in the simulator)."""
DEFAULT_LR = {"fedfs": 5e-3, "feduv": 0.1, "fedfs+feduv": 0.02}
"""The local SGD rate a device uses when the server's task names none. ``fedfs+feduv``: 0.02,
the best measured on the cross-domain benchmark (at 5e-3 the backbones move < 1 % in 20
rounds; 0.02 beat 0.05 and 0.01; docs/personalization.md). The others keep the papers'."""
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
DEFAULT_SCOPE = {"fedfs": "top", "feduv": "top", "fedfs+feduv": "top"}
"""Which layers of ϕ a device trains when the task names none (:mod:`fedfs_sdk.training.scope`):
``top`` — the embedding layer (and FedFS's projection, FedUV's head) on ξ's frozen trunk. A
phone's few photos cannot improve a real recognizer's convolutions, only damage them (issue 23:
the full-model presets cost a real MobileFaceNet 0.11–0.20 AUROC); the papers' ``all`` is the
``:paper`` presets' and ``train.scope = "all"``. ONNX Runtime training artifacts bake in what
they train (all layers): an artifact-only device keeps its artifact's scope."""
PAPER_SCOPE = "all"
DEFAULT_BATCH_SIZE = 32
"""Local mini-batch size (the papers do not state one for the device step)."""

SCORES: tuple[str, ...] = ("codeword", "head-template")
"""How a FedUV model verifies: ``codeword`` (FedUV Eq. 5, ``(1/c) v_uᵀ σ(W g)`` against the
device's secret codeword) or ``head-template`` (a cosine template of ``W g``, the head space
that FedUV's distinct codewords through one shared ``W`` make discriminative). A ``fedfs``
model has no head and always verifies with a cosine template of its embedding."""
VERIFY_MODELS: tuple[str, ...] = ("personal", "global", "both")
"""Which ``fedfs+feduv`` model verifies: ``personal`` (``q'`` of ``ϕ(θ_c)``, FedFS's reading),
``global`` (``r'`` of ``ϕ(w)``) or ``both`` (``unit(W q') ⊕ unit(W r')``, a head-template)."""
PAPER_VERIFICATION = {"fedfs": ("template", "personal"), "feduv": ("codeword", "global"),
                      "fedfs+feduv": ("codeword", "personal")}
"""``(score, model)`` as the papers verify: FedFS with ``q'``, FedUV with its codeword."""
DEFAULT_NORM_INIT = {"fedfs": "none", "feduv": "none", "fedfs+feduv": "standardize"}
"""How the default starts ϕ (``norm_init``): ``fedfs+feduv`` from ξ with its embedding normalization
re-fitted to the federation's pooled embedding moments (a statistics round's ``xi.embedding`` sum;
the simulator's preset and ``fedfs serve``'s initial model after that round, :mod:`server_agg.stats_auto`)."""

DEFAULT_VERIFICATION = {"fedfs": ("template", "personal"), "feduv": ("codeword", "global"),
                        "fedfs+feduv": ("head-template", "both")}
"""``(score, model)`` a device verifies with by default; ``fedfs+feduv``: a head-space template
of both models, the best measured (docs/personalization.md). ``template`` = the embedding's
cosine template (the only choice without a FedUV head)."""


def check_verification(method: str, score: str | None = None, model: str | None = None) -> tuple[str, str]:
    """``(score, model)`` for ``method`` with ``None`` filled from :data:`DEFAULT_VERIFICATION`;
    :class:`InputError` naming the valid choices for a combination the method cannot verify."""
    check_method(method)
    d_score, d_model = DEFAULT_VERIFICATION[method]
    score = d_score if score is None else score
    model = d_model if model is None else model
    if not uses_feduv(method):
        if score != "template" or model != "personal":
            raise InputError(f"{method} verifies with a cosine template of q' (no FedUV head, one model): "
                             f"score/verify options do not apply (got score={score!r}, verify={model!r})")
        return score, model
    if score not in SCORES:
        raise InputError(f"score must be one of {SCORES}, got {score!r}")
    if model not in VERIFY_MODELS:
        raise InputError(f"verify must be one of {VERIFY_MODELS}, got {model!r}")
    if method == "feduv" and model != "global":
        raise InputError(f"feduv has one model (the global one): verify={model!r} needs fedfs+feduv")
    if model == "both" and score != "head-template":
        raise InputError("verify=both verifies with a head-space template: it needs score=head-template")
    return score, model


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


__all__ = ["METHODS", "PAPER_LR", "DEFAULT_LR", "DEFAULT_SCOPE", "DEFAULT_NORM_INIT", "PAPER_SCOPE", "SCORES", "VERIFY_MODELS", "PAPER_VERIFICATION",
           "DEFAULT_VERIFICATION", "check_verification", "DEFAULT_EPOCHS", "DEFAULT_HEAD_LR", "DEFAULT_UV_WEIGHT", "DEFAULT_BATCH_SIZE",
           "check_method", "uses_fedfs", "uses_feduv"]
