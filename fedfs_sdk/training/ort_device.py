"""Artifact-only local training: a device's FedFS / FedUV step driven by ONNX Runtime
on-device training artifacts alone — no torch anywhere in the process, as on a phone.

The artifacts come from ``fedfs export --formats ort-training`` (:mod:`export.ort_training`).
This module drives them through ``onnxruntime.capi._pybind_state`` (``load_checkpoint``,
``Module``, ``Optimizer``): the same on-device training C API that the
``onnxruntime-training-android`` / ``-objc`` packages expose to Kotlin/Swift apps, reached
without ``onnxruntime.training.api`` (whose Python package imports torch).

One round on the device (FedFS Alg. 1 client step / FedUV Alg. 1):

1. copy the server's global weights ``w`` (and the device's personalized ``θ_c``) into
   the training state;
2. local SGD epochs over the device's images — for FedFS each step first runs the eval
   graph to get the soft labels ``α`` for the batch (``alpha_next``), then the training
   graph with ``α`` as an input, so no gradient flows through ``α`` (FedFS Eq. 6–7);
3. read back ``w_c`` as a dict of float32 arrays with :class:`~fedfs_sdk.nn.model.FaceNet`
   ``state_dict`` keys — the upload format (:func:`encode_update`) — and ``θ_c``, which
   stays on the device.

A ``scope="top"`` artifact (the methods' default, :mod:`export.ort_top`) trains the top alone: the
device runs the artifact's ``trunk.onnx`` once over its photos (:meth:`OrtDeviceTrainer.trunk_features`;
a caller keeps them across rounds) and steps 2–3 run on those features, as the torch trainer does
with ``trunk_features``. The server's model must carry the trunk the artifact was exported with
(``artifact.json`` ``trunk.sha256``); the trunk goes back up as received.

Differences from :class:`fedfs_sdk.training.trainer.LocalTrainer`: batches are shuffled with numpy
(not torch's generator), and only plain SGD exists (ORT's optimizer graph): momentum and
weight decay must be 0.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..errors import CheckpointError, InputError, TrainingError
from ..runtime.inference import check_batch
from ..runtime.onnx_backend import import_onnxruntime
from ..federation.wire_format import MODEL_FORMAT, UPDATE_FORMAT, read_header, update_metadata  # noqa: F401 (re-exported)
from .numpy_weights import (Weights, decode_model, dual_verifier_weights, encode_update, load_weights,  # noqa: F401
                            save_weights, verifier_weights)  # (re-exported: the numpy weights and wire moved down)
from .ort_artifact import ARTIFACT_FORMAT, TrainingArtifact, artifact_subdir  # noqa: F401 (re-exported)
from .top_keys import trunk_sha256

TRUNK_BATCH = 32
"""Images per ``trunk.onnx`` run (bounds its activation memory on a phone)."""


class TrunkGraph:
    """A ``scope="top"`` artifact's ``trunk.onnx`` (images ``[N,3,S,S]`` → features ``[N,F]``),
    run in batches of :data:`TRUNK_BATCH`; torch-free. The trainer trains on its output, and an
    artifact exported with ξ gives ξ's trunk features for a statistics round (its trunk is ξ's)."""

    def __init__(self, artifact: TrainingArtifact, intra_op_threads: int | None = None) -> None:
        trunk = artifact.trunk
        if trunk is None:
            raise InputError(f"the {artifact.method} artifact trains every layer (scope='all'): it has no trunk graph")
        self.artifact, self.info = artifact, trunk
        ort = import_onnxruntime()
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if intra_op_threads is not None:
            so.intra_op_num_threads = int(intra_op_threads)
        try:
            self.session = ort.InferenceSession(str(artifact.path / trunk["file"]), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 — a damaged graph file
            raise CheckpointError(f"ONNX Runtime cannot load {artifact.path / trunk['file']} "
                                  f"({str(e).splitlines()[0][:300]}); export again") from None

    @property
    def sha256(self) -> str:
        """:func:`~fedfs_sdk.training.top_keys.trunk_sha256` of the trunk inside."""
        return str(self.info["sha256"])

    def features(self, images: np.ndarray) -> np.ndarray:
        x = check_batch(images, self.artifact.input_size)
        name_in, name_out = self.info.get("input", "x"), self.info.get("output", "features")
        parts = [self.session.run([name_out], {name_in: np.ascontiguousarray(x[i:i + TRUNK_BATCH])})[0]
                 for i in range(0, x.shape[0], TRUNK_BATCH)]
        out = np.concatenate(parts) if parts else np.zeros((0, int(self.info["feature_dim"])), np.float32)
        return np.ascontiguousarray(out, dtype=np.float32)


@dataclass
class DeviceUpdate:
    """Result of one local update. Only ``weights`` and ``num_samples`` are uploaded."""

    weights: Weights
    num_samples: int
    personal_weights: Weights | None
    metrics: dict[str, float] = field(default_factory=dict)


class OrtDeviceTrainer:
    """Local training from ORT artifacts (no torch).

    Args:
        artifact_dir: one method's folder written by ``fedfs export --formats ort-training``.
        lr: SGD learning rate (default: the artifact's, i.e. the method's paper value). For
            ``fedfs+feduv`` the head's rate stays ``lr·(head_lr/lr)`` of the artifact.
        local_epochs, batch_size: default to the artifact's.
        intra_op_threads: ORT thread count (None = ORT default).
    """

    def __init__(self, artifact_dir: str | os.PathLike[str], *, lr: float | None = None,
                 local_epochs: int | None = None, batch_size: int | None = None,
                 intra_op_threads: int | None = None) -> None:
        self.artifact = TrainingArtifact.load(artifact_dir)
        info = self.artifact.info
        self.method = self.artifact.method
        self.lr = float(info["lr"] if lr is None else lr)
        self.local_epochs = int(info["local_epochs"] if local_epochs is None else local_epochs)
        self.batch_size = int(info["batch_size"] if batch_size is None else batch_size)
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise InputError(f"lr must be a positive number, got {self.lr}")
        if self.local_epochs < 1 or self.batch_size < int(info["min_batch"]):
            raise InputError(f"need local_epochs ≥ 1 and batch_size ≥ {info['min_batch']}, got "
                             f"{self.local_epochs} and {self.batch_size}")
        self._prefix = info["prefixes"]
        shapes = info.get("state_shapes")
        roles = ("global", "personal") if self.artifact.uses_soft_labels else ("global",)
        if not isinstance(shapes, dict) or not all(isinstance(shapes.get(r), dict) for r in roles):
            raise CheckpointError(f"{self.artifact.path / 'artifact.json'} lacks the model's state_shapes "
                                  "(exported by an older fedfs): re-export the artifacts")
        self._shapes: dict[str, dict[str, list[int]]] = {r: shapes[r] for r in roles}
        self._scales = {k: float(v) for k, v in info.get("param_scales", {}).items()}
        self._inputs: list[str] = list(info["inputs"])
        self._outputs: list[str] = list(info["outputs"])
        ort = import_onnxruntime()
        from onnxruntime.capi import _pybind_state as C   # the on-device training C API, torch-free
        self._ortvalue = ort.OrtValue
        self._vector = C.OrtValueVector
        p = self.artifact.path
        device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
        so = C.SessionOptions()
        so.log_severity_level = 3
        if intra_op_threads is not None:
            so.intra_op_num_threads = int(intra_op_threads)
        try:    # ORT raises its own RuntimeError subclasses for a damaged or mismatched file
            self._state = C.load_checkpoint(str(p / "checkpoint"))
            self._module = C.Module(str(p / "training_model.onnx"), self._state, str(p / "eval_model.onnx"),
                                    device, so)
            self._optimizer = C.Optimizer(str(p / "optimizer_model.onnx"), self._state, device, so)
        except Exception as e:  # noqa: BLE001 — any ORT failure here means the artifact is unusable
            raise CheckpointError(f"ONNX Runtime cannot load the training artifact {p} (checkpoint, training, "
                                  f"eval or optimizer graph damaged or from another export: "
                                  f"{str(e).splitlines()[0][:300]}); export again") from None
        self._optimizer.set_learning_rate(self.lr)
        self._threads = intra_op_threads
        self._trunk: TrunkGraph | None = None      # scope=top: trunk.onnx, opened on first use
        self._global_base: Weights | None = None
        self._personal_base: Weights | None = None
        if list(self._module.input_names(True)) != self._inputs:
            raise CheckpointError(f"training graph inputs {list(self._module.input_names(True))} differ from "
                                  f"artifact.json {self._inputs}")

    # ---- weights in and out ---------------------------------------------------------------

    def _param(self, name: str) -> np.ndarray:
        return self._state.get_parameter(name).data.numpy()

    def _set_param(self, name: str, value: np.ndarray) -> None:
        self._state.copy_parameter_from(name, self._ortvalue.ortvalue_from_numpy(
            np.ascontiguousarray(value, dtype=np.float32))._ortvalue)

    def _checked(self, role: str, weights: Mapping[str, Any], what: str) -> Weights:
        """``weights`` as float32 arrays after checking them against the model the artifact was
        exported for: exactly its state-dict keys (missing and unexpected ones named), each
        key's shape, finite values. Nothing is written here."""
        expected: dict[str, list[int]] = self._shapes[role]
        if not isinstance(weights, Mapping):
            raise InputError(f"{what} must be a mapping of state-dict keys to arrays, got {type(weights).__name__}")
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(str(k) for k in set(weights) - set(expected))
        if missing or unexpected:
            def listed(keys: list[str]) -> str:
                return repr(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
            parts = ([f"missing {listed(missing)}"] if missing else []) + \
                    ([f"unexpected {listed(unexpected)}"] if unexpected else [])
            raise InputError(f"{what} do not fit the {self.method} artifact's model: {'; '.join(parts)}")
        out: Weights = {}
        for key, want in expected.items():
            try:
                arr = np.asarray(weights[key], dtype=np.float32)
            except (TypeError, ValueError) as e:
                raise InputError(f"{what}: {key} is not a numeric array ({e})") from None
            if list(arr.shape) != list(want):
                raise InputError(f"{what}: {key} has shape {list(arr.shape)}, the artifact expects {list(want)}")
            if not np.isfinite(arr).all():
                raise InputError(f"{what}: {key} contains NaN or Inf")
            out[key] = arr
        return out

    def _write(self, role: str, weights: Weights) -> None:
        prefix = self._prefix[role]
        for key in self.artifact.info["trainable"][role]:
            name = prefix + key
            self._set_param(name, weights[key] / self._scales.get(name, 1.0))

    def _read(self, role: str, base: Mapping[str, Any]) -> Weights:
        prefix = self._prefix[role]
        out = {k: np.array(v, dtype=np.float32, copy=True) for k, v in base.items()}
        for key in self.artifact.info["trainable"][role]:
            name = prefix + key
            out[key] = (self._param(name) * np.float32(self._scales.get(name, 1.0))).astype(np.float32)
        return out

    def _check_trunk(self, weights: Weights, what: str) -> None:
        """``scope="top"``: ``weights`` must hold the trunk ``trunk.onnx`` was exported with — the
        top trains on that trunk's features, so another trunk's model would get a top that does not fit it."""
        trunk = self.artifact.trunk
        if trunk is not None and trunk_sha256(weights) != trunk["sha256"]:
            raise InputError(f"{what}: the trunk differs from the one this scope='top' artifact was exported with "
                             f"(sha256 {trunk_sha256(weights)[:12]}… vs {str(trunk['sha256'])[:12]}…): export the "
                             "artifacts from the server's model; a server whose rounds name no scope averages the "
                             "trunk (a secure sum rounds it), so start it with --train '{\"scope\": \"top\"}' to "
                             "keep the trunk exact")

    def load_weights(self, global_weights: Mapping[str, Any], personal_weights: Mapping[str, Any] | None = None) -> None:
        """Put ``w`` (and ``θ_c``; from ``w`` without the head when None) into the training state.

        Both are checked in full first (:meth:`_checked`, and under ``scope="top"`` their trunks
        against the artifact's); on bad input nothing changes."""
        g = self._checked("global", global_weights, "global weights")
        self._check_trunk(g, "global weights")
        personal = None
        if self.artifact.uses_soft_labels:
            src = personal_weights if personal_weights is not None else {
                k: v for k, v in g.items() if not k.startswith("uv_head.")}
            personal = self._checked("personal", src, "personalized weights")
            self._check_trunk(personal, "personalized weights")
        self._write("global", g)
        if personal is not None:
            self._write("personal", personal)
        self._global_base, self._personal_base = g, personal

    def global_weights(self) -> Weights:
        """``w_c``: all keys of the server's model; the ones this method trains, updated."""
        if self._global_base is None:
            raise InputError("no weights loaded yet: call load_weights() or train() first")
        return self._read("global", self._global_base)

    def personal_weights(self) -> Weights | None:
        """``θ_c`` (FedFS methods), None otherwise. Never uploaded."""
        if not self.artifact.uses_soft_labels:
            return None
        if self._personal_base is None:
            raise InputError("no weights loaded yet: call load_weights() or train() first")
        return self._read("personal", self._personal_base)

    # ---- training --------------------------------------------------------------------------

    def _feeds(self, x: np.ndarray, alpha: np.ndarray | None, codeword: np.ndarray | None,
               neg_codewords: np.ndarray | None) -> list[np.ndarray]:
        feeds = []
        for name in self._inputs:
            if name == self._inputs[0]:        # images x, or (scope=top) trunk features
                feeds.append(x)
            elif name == "alpha":
                feeds.append(alpha)
            elif name == "codeword":
                feeds.append(codeword)
            elif name == "neg_codewords":
                feeds.append(neg_codewords)
            else:  # pragma: no cover - artifact.json lists only the names above
                raise CheckpointError(f"unknown training graph input {name!r}")
        return feeds

    def step(self, x: np.ndarray, codeword: np.ndarray | None = None,
             neg_codewords: np.ndarray | None = None) -> dict[str, float]:
        """One SGD step on batch ``x`` (float32 ``[B,3,S,S]``, or ``[B,F]`` trunk features for a
        ``scope="top"`` artifact; validated by :meth:`train`) with the weights in the state
        (:meth:`load_weights`). Returns the loss parts."""
        if self._global_base is None:
            raise InputError("no weights loaded yet: call load_weights() first")
        x = np.ascontiguousarray(x, dtype=np.float32)
        vec = self._vector
        alpha = None
        if self.artifact.uses_soft_labels:
            b = x.shape[0]
            fetches = vec()
            # Eval graph: same parameters, no gradient — α is a label (FedFS Eq. 6), computed
            # from the current z, v and fed to the training graph as an input.
            self._module.eval_step(self._feeds(x, np.zeros((b, b), np.float32), codeword, neg_codewords), fetches)
            alpha = np.ascontiguousarray(fetches[self._outputs.index("alpha_next")].numpy())
        fetches = vec()
        self._module.lazy_reset_grad()
        self._module.train_step(self._feeds(x, alpha, codeword, neg_codewords), fetches)
        parts = {name: float(fetches[i].numpy()) for i, name in enumerate(self._outputs) if name != "alpha_next"}
        if not math.isfinite(parts["loss"]):
            raise TrainingError(f"local loss became {parts['loss']} (lr={self.lr} too high?)")
        self._optimizer.optimizer_step()
        return parts

    def _codeword(self, codeword: Any) -> np.ndarray | None:
        if "codeword" not in self._inputs:
            return None
        if codeword is None:
            raise InputError(f"method {self.method!r} needs the device's codeword")
        v = np.asarray(codeword)
        c = self.artifact.code_length
        if v.shape != (c,) or not np.isin(v, (-1, 1)).all():
            raise InputError(f"codeword must be a ±1 vector of length {c}, got shape {list(v.shape)}")
        return v.astype(np.float32)

    def _negatives(self, neg_codewords: Any) -> np.ndarray | None:
        if "neg_codewords" not in self._inputs:
            return None
        if neg_codewords is None:
            raise InputError("this artifact was exported with λ_neg > 0 and needs neg_codewords [U, c]")
        try:
            n = np.asarray(neg_codewords, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise InputError(f"neg_codewords must be a numeric [U, {self.artifact.code_length}] array ({e})") from None
        if n.ndim != 2 or n.shape[1] != self.artifact.code_length or n.shape[0] < 1:
            raise InputError(f"neg_codewords must have shape [U, {self.artifact.code_length}], got {list(n.shape)}")
        bad = ~np.isin(n, (-1.0, 1.0))
        if bad.any():
            rows = sorted({int(r) for r in np.nonzero(bad)[0]})
            kind = "NaN or Inf" if not np.isfinite(n).all() else "values other than ±1"
            raise InputError(f"neg_codewords must be ±1 codewords: row(s) {rows[:8]} contain {kind} "
                             f"(e.g. {n[bad][0]!r})")
        return n

    def trunk_features(self, images: np.ndarray) -> np.ndarray:
        """``scope="top"``: the trunk's features ``[N, F]`` of ``images`` (``trunk.onnx``, in batches
        of :data:`TRUNK_BATCH`). A device computes them once: its photos and the trunk do not change."""
        if self._trunk is None:
            self._trunk = TrunkGraph(self.artifact, self._threads)
        return self._trunk.features(images)

    def _checked_features(self, features: Any, images: np.ndarray) -> np.ndarray:
        """``features`` after checking they are the trunk's output of ``images``: one float row per
        image of width ``F``, finite, and the first image's row recomputed (as the torch trainer checks)."""
        n, width = int(images.shape[0]), int(self.artifact.trunk["feature_dim"])
        f = np.asarray(features)
        if f.ndim != 2 or f.shape != (n, width) or not np.issubdtype(f.dtype, np.floating):
            raise InputError(f"features must be a float [{n}, {width}] array (one row per image), "
                             f"got {f.dtype} {list(f.shape)}")
        f = np.ascontiguousarray(f, dtype=np.float32)
        ref = self.trunk_features(images[:1])
        if not np.isfinite(f).all() or not np.allclose(f[:1], ref, rtol=1e-4, atol=1e-4):
            raise InputError("features are not this artifact's trunk output of these images (the first row differs, "
                             "or a value is not finite): compute them with trunk_features() on the same photos")
        return f

    def train(self, global_weights: Mapping[str, Any], images: np.ndarray, *,
              personal_weights: Mapping[str, Any] | None = None, codeword: Any = None,
              neg_codewords: Any = None, seed: int = 0, features: Any = None) -> DeviceUpdate:
        """One local update (FedFS Alg. 1 client / FedUV Alg. 1 client) from the artifacts.

        ``images``: float32 ``[N, 3, S, S]`` from :func:`fedfs_sdk.runtime.preprocess.preprocess`.
        ``features`` (``scope="top"``): :meth:`trunk_features` of ``images``, kept by the caller
        across rounds (computed here when None); ignored by a ``scope="all"`` artifact.
        """
        x_all = check_batch(images, self.artifact.input_size)
        if self.artifact.trunk is not None:     # scope=top: the top trains on the trunk's output
            x_all = (self.trunk_features(x_all) if features is None else self._checked_features(features, x_all))
        n = x_all.shape[0]
        if n == 0:
            raise InputError("no images to train on")
        if n < int(self.artifact.info["min_batch"]):
            raise InputError(f"{self.method} needs at least {self.artifact.info['min_batch']} images "
                             "(F_insub contrasts images within a batch)")
        v = self._codeword(codeword)
        neg = self._negatives(neg_codewords)
        self.load_weights(global_weights, personal_weights)
        rng = np.random.default_rng(seed)
        bs = min(self.batch_size, n)
        history: dict[str, list[float]] = {}
        for _epoch in range(self.local_epochs):
            order = rng.permutation(n)
            for start in range(0, n, bs):
                idx = order[start:start + bs]
                if idx.size < int(self.artifact.info["min_batch"]):
                    continue  # a lone leftover image has nothing to contrast with
                for k, val in self.step(x_all[idx], v, neg).items():
                    history.setdefault(k, []).append(val)
        metrics = {f"{k}_first": vals[0] for k, vals in history.items()}
        metrics.update({f"{k}_last": vals[-1] for k, vals in history.items()})
        metrics.update({f"{k}_mean": float(np.mean(vals)) for k, vals in history.items()})
        return DeviceUpdate(self.global_weights(), int(n), self.personal_weights(), metrics)


__all__ = ["OrtDeviceTrainer", "TrunkGraph", "TRUNK_BATCH", "DeviceUpdate", "TrainingArtifact", "ARTIFACT_FORMAT", "artifact_subdir", "Weights",
           "verifier_weights", "dual_verifier_weights", "encode_update", "decode_model", "save_weights", "load_weights",
           "MODEL_FORMAT", "UPDATE_FORMAT", "read_header", "update_metadata"]
