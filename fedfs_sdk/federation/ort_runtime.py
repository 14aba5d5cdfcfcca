"""The phone's device runtime: local training and verification from an export folder alone, no torch
(:class:`OrtRuntime`; the torch runtime and what both share: :mod:`.device_runtime`).

An export (``fedfs export --formats onnx,ort-training``) holds, per method the server may ask for, the
ONNX Runtime training artifacts (``ort-training/<method>/``; by default they train the top on
``trunk.onnx``'s features, :mod:`export.ort_top`) and the verifier graphs (``onnx/verifier.onnx``,
``onnx/verifier-dual.onnx``, ``onnx/top.onnx``). :class:`OrtRuntime` trains from the former
(:class:`~fedfs_sdk.training.ort_device.OrtDeviceTrainer`), enrolls with the latter
(:class:`~fedfs_sdk.runtime.onnx_backend.OnnxBackend`), and takes part in the statistics rounds and the
in-domain check from the same graphs (:mod:`.ort_check`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..errors import CheckpointError, InputError
from ..training.methods import check_method, uses_fedfs, uses_feduv
from .device_runtime import (DUAL_ONNX_FILE, DeviceContext, LocalUpdate, clip_upload, negative_codewords, round_seed,
                             verifier_model, xi_path)
from .ort_check import backbone_arrays, xi_backbone
from .ort_settings import OrtTrainSettings, ort_settings_for
from .wire_format import read_header

if TYPE_CHECKING:
    from ..runtime.inference import InferenceBackend


class OrtRuntime:
    """Local training and verification from an export folder alone (no torch).

    Args:
        export_dir: what ``fedfs export --formats onnx,ort-training`` wrote:
            ``ort-training/<method>/`` (one artifact per method the server may ask for)
            and ``onnx/verifier.onnx`` (for enrollment).
        intra_op_threads: ONNX Runtime threads (None = ORT's default).
    """

    name = "ort"

    def __init__(self, export_dir: str | Path, intra_op_threads: int | None = None) -> None:
        self.root = Path(export_dir)
        if not (self.root / "ort-training").is_dir():
            raise CheckpointError(f"{self.root} is not a fedfs export with ORT training artifacts (no ort-training/); "
                                  "write one with `fedfs export --formats onnx,ort-training`")
        self.intra_op_threads = intra_op_threads
        self._trainers: dict[tuple[str, OrtTrainSettings], Any] = {}
        self._artifacts: list[Any] | None = None
        self._trunks: dict[str, Any] = {}              # artifact folder → its TrunkGraph (scope=top)
        self._features: dict[tuple[str, str], np.ndarray] = {}     # (trunk sha256, photos' sha256) → features
        self._written: dict[str, dict[str, np.ndarray]] = {}      # a built verifier's model id → its weights

    def check(self, enroll: bool = False) -> int:
        """Check the export folder before the device registers: every ``ort-training/*``
        artifact complete and readable (at least one), and ``onnx/verifier.onnx`` when the
        device will enroll. Returns the model's input size (for preprocessing the images).

        First the folder must be exactly what ``fedfs export`` wrote: every file's sha256 as
        its ``manifest.json`` lists it, nothing missing or added (a swapped graph or edited
        metadata would otherwise run, or fail later with a raw ONNX Runtime error)."""
        from export.manifest import MANIFEST_NAME, verify_manifest

        if not (self.root / MANIFEST_NAME).is_file():
            raise CheckpointError(f"{self.root} has no {MANIFEST_NAME}: not a complete fedfs export; "
                                  "write one with `fedfs export --formats onnx,ort-training`")
        try:
            changed = verify_manifest(self.root)
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(f"{self.root / MANIFEST_NAME} is unreadable ({e}); export again") from None
        if changed:
            raise CheckpointError(f"{self.root} differs from its {MANIFEST_NAME} (changed, missing or extra: "
                                  f"{', '.join(changed[:5])}{' …' if len(changed) > 5 else ''}); the export was "
                                  "modified or damaged: export again")
        arts = self.artifacts()
        if not arts:
            raise CheckpointError(f"{self.root / 'ort-training'} holds no ORT training artifact; "
                                  "write one with `fedfs export --formats onnx,ort-training`")
        if enroll and not (self.root / "onnx" / "verifier.onnx").is_file():
            raise CheckpointError(f"{self.root} has no ONNX verifier (onnx/verifier.onnx) to enroll with; "
                                  "export with --formats onnx,ort-training")
        return arts[0].input_size

    def artifacts(self) -> list[Any]:
        """Every training artifact of the export (``ort-training/*``), read once: a checked export does not
        change under a running device."""
        if self._artifacts is None:
            from ..training.ort_device import TrainingArtifact

            self._artifacts = [TrainingArtifact.load(p) for p in sorted((self.root / "ort-training").iterdir())
                               if p.is_dir()]
        return self._artifacts

    def _artifact(self, method: str) -> Path:
        from ..training.ort_device import artifact_subdir

        path = self.root / "ort-training" / artifact_subdir(method)
        if not path.is_dir():
            raise CheckpointError(f"the server trains {method!r}, but {self.root} has no ORT training artifact for it "
                                  f"({path.relative_to(self.root)}); export with --methods {method}")
        return path

    def train(self, task: Mapping[str, Any], model: bytes, agent: DeviceContext) -> LocalUpdate:
        from ..training.ort_device import OrtDeviceTrainer, TrainingArtifact, decode_model, encode_update

        method = check_method(str(task["method"]))
        path = self._artifact(method)
        settings = ort_settings_for(task, TrainingArtifact.load(path).info)
        key = (method, settings)
        if key not in self._trainers:
            self._trainers = {key: OrtDeviceTrainer(path, lr=settings.lr, local_epochs=settings.local_epochs,
                                                    batch_size=settings.batch_size,
                                                    intra_op_threads=self.intra_op_threads)}
        trainer = self._trainers[key]
        art = trainer.artifact
        weights, _ = decode_model(model)
        codeword = agent.state.codeword(art.code_length) if uses_feduv(method) else None
        neg = negative_codewords(task, art.code_length) if uses_feduv(method) and settings.lambda_neg > 0 else None
        personal = agent.state.load_arrays("personal") if uses_fedfs(method) else None
        images = agent.images_array(art.input_size)
        feats = self.trunk_features(art, images) if art.trunk is not None else None
        up = trainer.train(weights, images, personal_weights=personal, features=feats,
                           codeword=codeword, neg_codewords=neg, seed=round_seed(settings.seed, int(task["round_id"])))
        metrics = dict(up.metrics)
        upload = clip_upload(up.weights, weights, task, metrics)   # DP round: w_c − w clipped to C (float64)
        body = encode_update(upload, round_id=int(task["round_id"]), model_version=int(task["model_version"]),
                             num_samples=up.num_samples)
        personal_bytes = None
        if up.personal_weights is not None:
            from safetensors.numpy import save

            personal_bytes = save({k: np.ascontiguousarray(v) for k, v in up.personal_weights.items()})
        return LocalUpdate(body, up.num_samples, metrics, personal_bytes)   # θ_c stays on the device

    def trunk_features(self, artifact: Any, images: np.ndarray) -> np.ndarray:
        """A ``scope="top"`` artifact's trunk features of ``images``, computed once: the photos and the
        trunk (its sha256) do not change between rounds, so later rounds train the top alone, and a
        statistics round of ξ reuses them, as the torch runtime does (:mod:`.device_features`)."""
        import hashlib

        from ..training.ort_device import TrunkGraph

        key = str(artifact.path)
        if key not in self._trunks:
            self._trunks[key] = TrunkGraph(artifact, self.intra_op_threads)
        trunk = self._trunks[key]
        fkey = (trunk.sha256, hashlib.sha256(np.ascontiguousarray(images).tobytes()).hexdigest())
        if fkey not in self._features:
            if len(self._features) >= 4:      # a device's photo sets: training, hold-out-less, all
                self._features.pop(next(iter(self._features)))
            self._features[fkey] = trunk.features(images)
        return self._features[fkey]

    def xi_statistics(self, agent: DeviceContext, xi_file: Path, xi_sha: str, positions: np.ndarray,
                      features: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """ξ's embeddings (and trunk features) of the owner's photos at ``positions``, for a statistics
        round (:func:`~fedfs_sdk.federation.device_stats.xi_moments`), torch-free (:mod:`.ort_check`)."""
        from .ort_check import xi_statistics

        return xi_statistics(self, agent, xi_file, xi_sha, positions, features)

    def in_domain_check(self, agent: DeviceContext, name: str, method: str, model: bytes, verify: str | None,
                        score: str | None, drawn: np.ndarray, train: np.ndarray, hold: np.ndarray, xi_file: Path,
                        xi_sha: str, embedding_sum: np.ndarray | None):
        """Candidate ``name``'s in-domain check, torch-free (:func:`.ort_check.candidate_check`): the
        verifier :meth:`verifier` would build for it, as a function of trunk features."""
        from ..training.ort_device import decode_model
        from .ort_check import candidate_check

        chosen = {"xi": "xi", "norm-adapt": "xi", "global": "global"}.get(name) or verifier_model(method, verify)
        w, _ = decode_model(model)
        if chosen == "xi":
            backbones = [xi_backbone(xi_file, name, embedding_sum)]
        elif chosen == "global":
            backbones = [backbone_arrays(w)]
        else:
            personal = agent.state.load_arrays("personal")
            if personal is None:
                raise InputError(f"method {method!r} verifies with θ_c, which this device has not trained yet")
            backbones = [backbone_arrays(personal)] + ([backbone_arrays(w)] if chosen == "both" else [])
        head = w.get("uv_head.weight") if uses_feduv(method) and chosen != "xi" else None
        project = name == "global" and score == "head-template" and head is not None
        return candidate_check(self, agent, name, backbones, head, project, drawn, train, hold, xi_sha)

    def verifier(self, method: str, model: bytes, agent: DeviceContext, version: int,
                 verify: str | None = None, candidate: str = "personalized", persist: bool = True) -> "InferenceBackend":
        # (persist is ignored: an ONNX Runtime session runs from the verifier file, so it is always written)
        from ..runtime.onnx_backend import OnnxBackend, with_weights
        from ..training.ort_device import decode_model, dual_verifier_weights, verifier_weights

        chosen = {"xi": "xi", "norm-adapt": "xi", "global": "global"}.get(candidate) or verifier_model(method, verify)
        rel = DUAL_ONNX_FILE if chosen == "both" else "onnx/verifier.onnx"
        onnx = self.root / rel
        if not onnx.is_file():
            raise CheckpointError(f"{self.root} has no ONNX verifier {rel} to enroll with (verify={chosen}); "
                                  "export with --formats onnx,ort-training"
                                  + (" --methods fedfs+feduv" if chosen == "both" else ""))
        weights, _ = decode_model(model)
        if chosen == "xi":      # ξ's backbone in the verifier graph (its FedUV head, if any, stays the global one)
            xi_file = xi_path(agent)
            archs = [json.loads(read_header(b)[1].get("model_config") or "{}").get("backbone")
                     for b in (xi_file.read_bytes(), model)]
            if archs[0] != archs[1]:   # the export's graph is the global model's: ξ's weights would fill other layers
                raise InputError(f"ξ is {archs[0]} but the exported verifier graph is {archs[1]}: the ONNX runtime "
                                 "cannot check ξ on it (use the torch runtime, or a ξ of the global model's architecture)")
            xi = xi_backbone(xi_file, candidate, getattr(agent, "stats_embedding_sum", None))
            weights = {**{k: v for k, v in weights.items() if not k.startswith("backbone.")}, **xi}
            chosen = "global"
        personal = None
        if chosen in ("personal", "both"):
            personal = agent.state.load_arrays("personal")
            if personal is None:
                raise InputError(f"method {method!r} verifies with θ_c, which this device has not trained yet")
        # The device's own verifier (θ_c's and/or w's backbone + W), kept in the state (0600) like
        # the torch runtime's verifier.safetensors: what `fedfs verify --model` takes, with no torch.
        chosen_weights = (dual_verifier_weights(weights, personal) if chosen == "both"
                          else verifier_weights(weights, personal if chosen == "personal" else None))
        model_bytes, _ = with_weights(onnx, chosen_weights)
        path = agent.state.save_file("verifier.onnx", model_bytes)
        backend = OnnxBackend(path, intra_op_threads=self.intra_op_threads)
        if uses_feduv(method) and chosen != "both" and "uv" not in backend.outputs:
            raise CheckpointError(f"{onnx} has no FedUV head output, but the server trains {method!r}")
        if len(self._written) >= 4:       # the candidates of one enrollment
            self._written.pop(next(iter(self._written)))
        self._written[str(backend.model_id)] = chosen_weights
        return backend

    def _top_of(self, backend: "InferenceBackend", xi_sha: str):
        """``(artifact, features → backend's outputs)`` for a verifier :meth:`verifier` built whose
        backbones run on ξ's trunk (:func:`.ort_check.verifier_top`), or None."""
        from .ort_check import verifier_top, xi_trunk_artifact

        weights = self._written.get(str(getattr(backend, "model_id", "")))
        art = xi_trunk_artifact(self, xi_sha) if weights is not None else None
        top = verifier_top(self, weights, tuple(backend.outputs), str(art.trunk["sha256"])) if art is not None else None
        return None if top is None else (art, top)

    def impostor_outputs(self, backend: "InferenceBackend", impostors: Any, xi_sha: str):
        """A function computing ``backend``'s outputs on the public impostor set as
        :func:`~fedfs_sdk.runtime.impostor_outputs.impostor_outputs` does — from ξ's trunk features of the
        set (``trunk.onnx``, once per set: every candidate and both halves of the dual verifier share
        them) and the verifier's top — or None where it does not run on ξ's trunk (then ``enroll`` runs
        the full forward). Scores agree with the full forward to float32 rounding."""
        found = self._top_of(backend, xi_sha)
        if found is None:
            return None
        art, top = found

        def compute() -> tuple[dict[str, np.ndarray], ...]:
            from ..runtime.impostor_outputs import CHUNK, impostor_batch

            feats = self.trunk_features(art, impostor_batch(backend, impostors))
            out = []
            for a in range(0, len(feats), CHUNK):
                o = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in top(feats[a:a + CHUNK]).items()}
                for v in o.values():
                    v.setflags(write=False)
                out.append(o)
            return tuple(out)
        return compute

    def far_evidence(self, stats: Any, backend: "InferenceBackend", xi_file: Path, xi_sha: str, impostors: Any):
        """The federation's evidence for ``enroll(far=…)`` (:func:`.ort_check.far_evidence`) for a verifier
        :meth:`verifier` built on ξ's trunk."""
        from .ort_check import _no_trunk, far_evidence, xi_trunk_artifact

        if xi_trunk_artifact(self, xi_sha) is None:
            raise _no_trunk(self.root, xi_sha)
        found = self._top_of(backend, xi_sha)
        if found is None:
            raise InputError("the enrolled verifier's trunk is not ξ's (or this runtime did not build it): the "
                             "federation's statistics describe ξ's trunk features (scope=top); enroll with a scope=top "
                             "model of this ξ, or without --far-stats")
        return far_evidence(self, stats, backend, *found, xi_file, impostors)


__all__ = ["OrtRuntime"]
