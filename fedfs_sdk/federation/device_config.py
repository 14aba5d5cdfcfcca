"""What a device is told to do (:class:`DeviceConfig`) and the checks of its local inputs
(images, ξ) that run before it registers, so a bad folder fails before the server knows it.
Importing this module does not import torch.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .device_runtime import DeviceRuntime
from .ort_runtime import OrtRuntime
from ..errors import CheckpointError, InputError
from ..training.methods import SCORES, VERIFY_MODELS
from .secagg.policy import DevicePolicy
from .wire_format import MODEL_FORMAT, read_header


CHECK_INPUT_SIZE = 112
"""Size the images are preprocessed at when checked before registration, when the model's
input size is not known yet (MobileFaceNet's; an export folder says its own)."""


@dataclass
class DeviceConfig:
    """How a device behaves.

    Attributes:
        rounds: rounds to take part in during this run (0: until the server says ``done``).
        device: torch device for local training (``cpu``, ``cuda``).
        artifacts: an export folder (``fedfs export --formats onnx,ort-training``): train and
            verify with ONNX Runtime from it, as a phone does — no torch (:class:`OrtRuntime`).
        xi_path: local ξ checkpoint for FedFS methods (else the server's ξ is downloaded).
        wait_timeout_s: stop (with an error) after this long without progress: no task, or
            the server unreachable / failing.
        detect_face: crop faces with OpenCV before training / enrolling.
        enroll: after the last round, enroll the owner with the final model.
        q: target TPR of the enrollment warm-up (FedUV Alg. 2).
        outliers: the enrollment's outlier rule (``mad``: drop photos scoring far below the
            others before τ is set, :func:`fedfs_sdk.runtime.enrollment.enroll`; ``none``: keep all).
        enrollment_key: the device key (16/24/32 bytes): encrypts the enrollment and the
            FedUV secrets (else ``enrollment.key`` in the state).
        registration_token: presented at registration when the server requires one.
        score: how a FedUV model verifies, ``codeword`` (FedUV Eq. 5) or ``head-template``
            (a cosine template of ``W g``); ``None``: the method's default
            (:data:`fedfs_sdk.training.methods.DEFAULT_VERIFICATION`).
        verify: which ``fedfs+feduv`` model verifies: ``personal``, ``global`` or ``both``
            (``unit(W q') ⊕ unit(W r')``); ``None``: the method's default.
        require_secure_aggregation: take part only in secure-aggregation rounds: a round whose
            task has no ``secagg`` is refused (event ``round_refused``, nothing is trained or
            sent) — the server cannot quietly turn secure aggregation off for this device.
            ``None`` (default): required with a server on another machine (no trust on first
            use: an on-path attacker could strip the first offers), once the server has offered
            secure aggregation (in its registration answer or any round; remembered in the
            state), and whenever ``secagg.ca`` is pinned; a loopback server that never offers
            it keeps plain FedAvg rounds.
            ``False``: plain rounds are accepted. When required, the server URL must be
            ``https://`` or loopback.
        secagg: the device's own floors for secure rounds (:class:`~fedfs_sdk.federation.secagg.policy.DevicePolicy`:
            the pinned operator CA, minimum roster, threshold rule, SecAgg+ degree, DP noise).
        identity_certificate: the operator's certificate of this device's identity key
            (``fedfs ca sign``) — checked against ``secagg.ca`` and installed in the state.
        impostors: the public impostor set shipped with the model (``fedfs impostors``). With
            it the device keeps ``holdout`` of its photos out of training and, at enrollment,
            verifies with whichever of ξ, the global model and its personalized model does best
            on them against the impostors (do no harm, :mod:`fedfs_sdk.training.selection`);
            the enrollment records the choice and its operating point.
        holdout: share of the owner's photos held out for that check (at least 2).
        far: the enrollment's false-accept target on the impostor set (None: FedUV's q only).
        far_stats: a statistics round's published sum (``xi.features``, ``xi.tail``): with ``far``,
            τ is set in the federation's capture conditions where the impostor set is too small for
            ``far`` (:mod:`fedfs_sdk.stats.evidence`; both runtimes). None: the sums the server's
            automatic rounds published (:mod:`.device_tail`), when they carry a tail.
        select: ``auto`` (default) — the do-no-harm check at every enrollment: ``holdout`` of the
            photos are never trained on, and the device verifies with the candidate the check picks
            on the public impostor set (``impostors``, else the one the server ships with its model);
            with no impostor set at all it keeps ξ and says so. ``off`` — enroll the method's own
            model unchecked, on every photo (the papers' behaviour; e.g. to study that model).
        helps: candidates (``global``, ``personalized``) the federation found better than ξ
            across its devices (:func:`fedfs_sdk.training.selection.population_verdict`); for
            them the device only checks that they do no harm *here*. Empty (the default, and all
            a device knows without statistics rounds): a candidate must show on the device's own
            photos that it is better.
        stats: take part in the server's statistics rounds (ξ's moments, the check results; under
            secure aggregation with the device's own ``secagg`` floor, :mod:`fedfs_sdk.federation.device_stats`)
            and, at enrollment, run the defaults' in-domain rule from the published sums — norm-adapt
            ξ as a candidate, impostors drawn in the federation's capture conditions, the federation's
            verdict — falling back (and saying why) to the public impostors, else ξ, when no
            statistics are available. ``False``: neither.
    """

    rounds: int = 1
    device: str = "cpu"
    artifacts: Path | None = None
    xi_path: Path | None = None
    wait_timeout_s: float = 3600.0
    detect_face: bool = False
    enroll: bool = False
    q: float = 0.9
    enrollment_key: bytes | None = None
    registration_token: str | None = None
    outliers: str = "mad"
    score: str | None = None
    verify: str | None = None
    require_secure_aggregation: bool | None = None
    secagg: DevicePolicy = field(default_factory=DevicePolicy)
    identity_certificate: Path | None = None
    impostors: Path | None = None
    holdout: float = 0.2
    far: float | None = None
    far_stats: Path | None = None
    select: str = "auto"
    helps: tuple[str, ...] = ()
    stats: bool = True

    def __post_init__(self) -> None:
        if self.select not in ("auto", "off"):
            raise InputError(f"select must be 'auto' (the do-no-harm check) or 'off', got {self.select!r}")
        if not 0 < self.holdout < 1:
            raise InputError(f"holdout (the share of photos kept out of training) must be in (0, 1), got {self.holdout!r}")
        if self.far is not None and self.impostors is None and self.select == "off":
            # (with select="auto" the server's set may serve: checked at enrollment, device_enrollment)
            raise InputError("a false-accept target (far) needs the public impostor set (impostors / --impostors)")
        if self.far is not None and not 0 < self.far < 1:
            raise InputError(f"far must be in (0, 1), got {self.far!r}")
        if self.far_stats is not None and (self.far is None or not Path(self.far_stats).is_file()):
            # checked before the device registers or trains: the statistics are read only at enrollment
            raise InputError(f"far_stats (--far-stats) {self.far_stats}: " + ("not a file" if self.far is not None else
                             "sets τ for a false-accept target: give far (--far) too"))
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 0:
            raise InputError(f"rounds must be an integer ≥ 0 (0: until the server is done), got {self.rounds!r}")
        w = self.wait_timeout_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise InputError(f"the wait timeout must be a positive number of seconds, got {w!r}")
        if isinstance(self.q, bool) or not isinstance(self.q, (int, float)) or not 0 < self.q < 1:
            raise InputError(f"q (the enrollment's target TPR) must be in (0, 1), got {self.q!r}")
        if self.enrollment_key is not None and len(self.enrollment_key) not in (16, 24, 32):
            raise InputError(f"the enrollment key must be 16, 24 or 32 raw bytes, got {len(self.enrollment_key)}")
        if self.outliers not in ("mad", "none"):
            raise InputError(f"outliers (the enrollment's outlier rule) must be 'mad' or 'none', got {self.outliers!r}")
        if self.score is not None and self.score not in SCORES:
            raise InputError(f"score must be one of {SCORES} (or None for the method's default), got {self.score!r}")
        if self.require_secure_aggregation is not None and not isinstance(self.require_secure_aggregation, bool):
            raise InputError("require_secure_aggregation must be True, False or None (automatic), got "
                             f"{self.require_secure_aggregation!r}")
        if not isinstance(self.secagg, DevicePolicy):
            raise InputError(f"secagg must be a DevicePolicy, got {type(self.secagg).__name__}")
        if self.identity_certificate is not None and self.secagg.ca is None:
            raise InputError("an identity certificate needs the operator CA it is checked against (secagg.ca, "
                             "fedfs device --secagg-ca)")
        if self.verify is not None and self.verify not in VERIFY_MODELS:
            raise InputError(f"verify must be one of {VERIFY_MODELS} (or None for the method's default), "
                             f"got {self.verify!r}")


def check_xi_file(path: str | os.PathLike[str]) -> Path:
    """``path`` if it is a readable fedfs checkpoint (ξ for FedFS methods), else
    :class:`~fedfs_sdk.errors.CheckpointError` naming the problem (read without torch)."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"ξ checkpoint not found: {p}")
    try:
        meta = read_header(p.read_bytes())[1]
    except OSError as e:
        raise CheckpointError(f"ξ checkpoint {p} is unreadable: {e.strerror or e}") from None
    except InputError as e:
        raise CheckpointError(f"ξ checkpoint {p} is not a safetensors file: {e}") from None
    if meta.get("format") != MODEL_FORMAT:
        raise CheckpointError(f"ξ checkpoint {p} is not a fedfs checkpoint (format={meta.get('format')!r})")
    return p


def check_local_inputs(images: Sequence[Any], config: DeviceConfig,
                       runtime: DeviceRuntime | None = None) -> dict[int, np.ndarray]:
    """Everything a device needs locally, checked before it registers (so a bad image or a
    wrong path never leaves a registered device that stalls every round): every image
    decodes (and has a face with ``detect_face``), ``config.xi_path`` is a fedfs checkpoint,
    ``config.artifacts`` is a complete export. Returns the preprocessed images by input
    size (a cache for :class:`DeviceAgent`)."""
    from ..runtime.preprocess import preprocess

    if len(images) == 0:
        raise InputError("a device needs at least one image")
    if config.enroll:     # refused now, not after registering, training and uploading (issue 29)
        from ..runtime.enrollment import min_warmup_images

        need = min_warmup_images(config.q)
        if len(images) < need:
            raise InputError(f"--enroll with target TPR q={config.q} needs at least {need} photos of the owner, "
                             f"got {len(images)}: add photos, or lower --q (q=0.8 needs 5)")
    size = CHECK_INPUT_SIZE
    if config.artifacts is not None:
        rt = runtime if isinstance(runtime, OrtRuntime) else OrtRuntime(config.artifacts)
        size = rt.check(enroll=config.enroll)
    if config.xi_path is not None:
        check_xi_file(config.xi_path)
    return {size: preprocess(list(images), size, detect_face=config.detect_face)}
