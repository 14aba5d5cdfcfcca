"""One typed, frozen experiment config: what ``fedfs simulate`` / ``demo`` / ``pretrain`` run.

The command line's :class:`argparse.Namespace` stops at the CLI entry functions: they call
:func:`device_sim.experiment_resolve.experiment_from_args` once, which applies ``--scenario``,
SynthFaces' split defaults and the real-photo ξ default (``dlib-resnet`` where installed) and
validates the combination, and pass the resulting :class:`ExperimentConfig` on. Every module
after that reads typed fields (``cfg.data.split_seed``, ``cfg.runtime.device`` …); a derived
setting (another seed, a distributed rank's threads) is a :func:`dataclasses.replace`, never
a mutation. A script builds one the same way (``experiment_from_args``) or from the
defaults::

    from dataclasses import replace
    from device_sim.experiment import ExperimentConfig, DataConfig
    from device_sim.experiment_resolve import resolve_experiment

    cfg = resolve_experiment(ExperimentConfig(data=DataConfig(scenario="cross-domain", clients=20)))

Field names are the command line's option names (``--split-seed`` → ``split_seed``), so
:meth:`ExperimentConfig.to_settings` is the ``"settings"`` of results.json, key for key.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

SYNTH_DEFAULTS: tuple[tuple[str, int], ...] = (("clients", 100), ("new_users", 20), ("public", 300),
                                                ("train_per_client", 20), ("test_per_client", 10))
"""SynthFaces' split sizes for options left unset (``fedfs simulate`` / ``pretrain``)."""

DEFAULT_METHODS: tuple[str, ...] = ("pretrained", "fedfs", "feduv", "fedfs+feduv")


@dataclass(frozen=True)
class DataConfig:
    """The clients' data, ξ's pre-training data and their split (FedUV's three sets: public
    identities for ξ, clients, never-trained new users; FedFS §4.1's per-identity split).

    ``None`` split sizes are resolved: SynthFaces' defaults (:data:`SYNTH_DEFAULTS`) for
    ``synth``; shares of the folder for a folder (:mod:`device_sim.folder_split`)."""

    data: str = "synth"
    """``synth`` (SynthFaces) or an ImageFolder root (one client per identity)."""
    image_size: int | None = None
    """Input side in pixels; resolved to ξ's own size or 32."""
    difficulty: float = 1.0
    """SynthFaces nuisance strength (0 clean … 1)."""
    synth_seed: int = 0
    clients: int | None = None
    new_users: int | None = None
    public: int | None = None
    train_per_client: int | None = None
    test_per_client: int | None = None
    warmup_per_client: int = 0
    """Fresh warm-up images per client / new user (FedUV Alg. 2's τ), never trained on."""
    public_images: int = 20
    """Images per public SynthFaces identity."""
    split_seed: int = 0
    detect_face: bool | str = False
    """Folders: face alignment — False, True (dlib five-point / Haar) or a named crop (``dlib-chip``)."""
    domain: str = "none"
    """SynthFaces look of the clients' images (:mod:`device_sim.synth_domains`)."""
    pretrain_data: str | None = None
    """Where ξ is pre-trained when not on ``data``'s public identities: ``synth`` or a folder."""
    pretrain_domain: str | None = None
    pretrain_difficulty: float | None = None
    pretrain_public: int = 300
    """Public SynthFaces identities of ξ when ``pretrain_data`` is ``synth`` and ``data`` is not."""
    capture_shift: str = "none"
    """Folders: capture conditions of the phones' photos (:mod:`device_sim.capture_shifts`)."""
    scenario: str | None = None
    """A named setting of the fields above (:mod:`device_sim.scenarios`), applied by resolution."""
    synth_defaults: tuple[tuple[str, int], ...] = SYNTH_DEFAULTS
    """The command's SynthFaces split defaults (``fedfs demo`` has its own)."""


@dataclass(frozen=True)
class XiConfig:
    """The frozen model ξ: a checkpoint / built-in name, or how it is pre-trained here
    (CosFace / ArcFace margin loss on the public identities, cached)."""

    pretrained: str | None = None
    """A ξ checkpoint or a built-in model name (``dlib-resnet``); None: pre-train here."""
    backbone: str | None = None
    width: int | None = None
    embedding_dim: int | None = None
    margin_loss: str = "cosface"
    margin: float | None = None
    """CosFace m (default 0.2) / ArcFace angle (0.5)."""
    scale: float = 16.0
    pretrain_epochs: int = 10
    pretrain_optimizer: str = "adamw"
    pretrain_lr: float = 5e-3
    pretrain_batch_size: int = 128
    cache_dir: str | None = None
    """ξ cache (default ``$FEDFS_CACHE_DIR/pretrained`` or ``~/.cache/fedfs/pretrained``)."""


@dataclass(frozen=True)
class TrainConfig:
    """The federation: methods, rounds T, participation p and the clients' local SGD."""

    method: tuple[str, ...] = DEFAULT_METHODS
    """Method specs (``name:key=value,…``), run side by side on the same clients."""
    rounds: int = 10
    participation: float = 0.5
    local_epochs: int | None = None
    """None: each method's paper value."""
    lr: float | None = None
    head_lr: float | None = None
    batch_size: int = 10
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    """Federation seed (sampling, init, local shuffles)."""
    seeds: int = 1
    """Repeat the experiment K times with ``seed`` and ``split_seed`` advanced by 0 … K−1."""


@dataclass(frozen=True)
class EvalSettings:
    """Evaluation of the trained verifiers (:mod:`device_sim.evaluate`)."""

    q: float | None = None
    """FedUV warm-up target TPR; None: 0.9, or the largest a folder's warm-up images allow."""
    eval_every: int = 0
    eval_clients: int = 1000
    impostor_pool: int = 2000


@dataclass(frozen=True)
class DpConfig:
    """User-level DP-FedAvg (McMahan et al. 2018; :mod:`device_sim.dp_sim`). All None: off."""

    dp_epsilon: float | None = None
    dp_noise: float | None = None
    dp_clip: float | None = None
    dp_delta: float | None = None


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the simulation runs; none of these changes a result."""

    device: str = "cpu"
    threads: int | None = None
    """torch CPU threads (None: torch's choice; a distributed rank: cores per process)."""
    executor: str = "auto"
    chunk_size: int = 0
    amp: str = "off"
    store_dtype: str = "fp32"
    store_location: str = "cpu"
    prefetch: str = "auto"
    compile: str = "auto"
    """the batched executor's folded trunk through torch.compile: auto (CUDA with Triton) | on | off"""
    data_cache: str = "auto"
    distributed: bool = False
    workers: int = 1
    rank_split: str = "balanced"
    face_workers: int | None = None
    """Processes that find the faces of a folder's photos (None: the machine's cores)."""


@dataclass(frozen=True)
class OutputConfig:
    """Where results and checkpoints go and what is shown."""

    out: str = "runs/simulate"
    quiet: bool = False
    resume: bool = False
    checkpoint_every: int = 0


GROUPS: tuple[tuple[str, type], ...] = (("data", DataConfig), ("xi", XiConfig), ("train", TrainConfig),
                                        ("evaluation", EvalSettings), ("dp", DpConfig),
                                        ("runtime", RuntimeConfig), ("output", OutputConfig))
"""The field groups of :class:`ExperimentConfig`; their field names are all distinct."""


@dataclass(frozen=True)
class ExperimentConfig:
    """Everything one experiment runs on, grouped by what consumes it.

    ``resolved``: made by :func:`device_sim.experiment_resolve.resolve_experiment` (scenario,
    split defaults and ξ's input applied); the data builders refuse one that is not.
    ``notes``: lines that resolution adds to a folder run's notes (the ξ chosen, what to install).
    ``command``: the CLI command it came from (kept in results.json's settings)."""

    data: DataConfig = field(default_factory=DataConfig)
    xi: XiConfig = field(default_factory=XiConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluation: EvalSettings = field(default_factory=EvalSettings)
    dp: DpConfig = field(default_factory=DpConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    command: str | None = None
    notes: tuple[str, ...] = ()
    resolved: bool = False

    def require_resolved(self, who: str) -> None:
        if not self.resolved:
            raise ValueError(f"{who} needs a resolved ExperimentConfig: pass it through "
                             "device_sim.experiment_resolve.resolve_experiment() first")

    def with_fields(self, **changes: Any) -> ExperimentConfig:
        """A copy with fields changed by their (unique) names, e.g. ``with_fields(seed=1, out="x")``."""
        unknown = sorted(set(changes) - set(_field_groups()))
        if unknown:
            raise TypeError(f"unknown experiment field(s) {unknown}")
        return replace(self, **{g: replace(getattr(self, g), **kv) for g, kv in _by_group(changes).items()})

    def to_settings(self) -> dict[str, Any]:
        """The flat ``settings`` of results.json: each option by its command-line name."""
        out: dict[str, Any] = {}
        for g, _ in GROUPS:
            group = getattr(self, g)
            for f in fields(group):
                out[f.name] = getattr(group, f.name)
        out["method"] = list(out["method"])
        out["synth_defaults"] = dict(out["synth_defaults"])
        if self.command is not None:
            out["command"] = self.command
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ExperimentConfig:
        """An unresolved config from option values by name (``vars(namespace)``, a results.json
        ``settings``); names it does not hold (``func``, ``force``, ``json`` …) are ignored and
        missing ones keep their defaults."""
        by_group = _by_group(values)
        groups = {g: t(**_typed(by_group.get(g, {}))) for g, t in GROUPS}
        command = values.get("command")
        return cls(**groups, command=command if isinstance(command, str) else None)


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    """Lists and dicts of a Namespace / JSON as the frozen config's tuples."""
    out = dict(values)
    if "method" in out and out["method"] is not None:
        out["method"] = tuple(out["method"])
    if isinstance(out.get("synth_defaults"), Mapping):
        out["synth_defaults"] = tuple(out["synth_defaults"].items())
    elif out.get("synth_defaults") is None:
        out.pop("synth_defaults", None)
    return out


def _field_groups() -> dict[str, str]:
    return {f.name: g for g, t in GROUPS for f in fields(t)}


def _by_group(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{group: {field: value}}`` of the values that name a field (the others are left out)."""
    where = _field_groups()
    out: dict[str, dict[str, Any]] = {}
    for k, v in values.items():
        if k in where:
            out.setdefault(where[k], {})[k] = v
    return out


__all__ = ["ExperimentConfig", "DataConfig", "XiConfig", "TrainConfig", "EvalSettings", "DpConfig",
           "RuntimeConfig", "OutputConfig", "GROUPS", "SYNTH_DEFAULTS", "DEFAULT_METHODS"]
