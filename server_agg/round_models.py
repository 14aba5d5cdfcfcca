"""Global model versions and ξ on the aggregation server: install, validate, publish (file first, then
the row that makes it visible), describe. A mixin of :class:`server_agg.rounds.Coordinator`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from fedfs_sdk.errors import CheckpointError, InputError
from fedfs_sdk.federation.wire import (MODEL_FORMAT, check_finite, check_layout, decode_weights,
                                       encode_weights, sha256_hex)

from .config import RoundPolicy, mismatch_reason, missing_model_field, proj_dim_mismatch
from .errors import Conflict, NotFound, Unprocessable
from .impostor_store import impostors_sha256
from .round_state import GlobalModel, _event
from .store import atomic_write


class ModelStore:
    """A mixin of :class:`~server_agg.rounds.Coordinator` (it uses the coordinator's ``_lock``,
    ``db``, ``layout``, ``policy``, ``model``, ``round`` and ``clock``)."""

    def install_model(self, data: bytes, method: str | None = None) -> dict[str, Any]:
        """Publish an admin-supplied fedfs checkpoint as the next global version; with
        ``method``, also switch the policy's method in the same step. The model must be
        able to run the (resulting) method: else 409 ``model_method_mismatch``."""
        weights, config = self._decode_model(data)
        with self._lock:
            if self.round is not None:
                raise Conflict(f"round {self.round.id} is open; close it before installing a model",
                               code="round_open")
            policy = self.policy
            if method is not None:
                try:
                    policy = policy.updated({"method": method})
                except InputError as e:
                    raise Unprocessable(str(e), code="invalid_policy") from None
            missing = missing_model_field(policy.method, config)
            if missing is not None:
                hint = "" if method is not None else " (to switch both, POST the model with ?method=…)"
                raise Conflict(f"model rejected: {mismatch_reason(policy.method, missing)}{hint}",
                               code="model_method_mismatch")
            why = self._xi_mismatch(policy, config)
            if why is not None:
                raise Conflict(f"model rejected: {why}", code="proj_dim_mismatch")
            if policy != self.policy:
                self.db.set_meta("policy", json.dumps(policy.to_json()))
                self.policy = policy
            version = (self.model.version if self.model else 0) + 1
            self._publish(version, weights, config, round_id=None, count=0, samples=0)
        _event("model installed", version=version, method=self.policy.method)
        return self.model_info()

    @staticmethod
    def _decode_model(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Weights and model config of a fedfs checkpoint; 422 ``invalid_model`` if it is not one."""
        from fedfs_sdk.nn.model import FaceNet, ModelConfig

        try:
            weights, meta = decode_weights(data)
            if meta.get("format") != MODEL_FORMAT:
                raise InputError(f"not a fedfs checkpoint (format={meta.get('format')!r})")
            config = ModelConfig.from_json(meta.get("model_config", "null")).resolved()
            expected = FaceNet(config).state_dict()
            check_layout(weights, expected, "model")
            check_finite(weights, "model")
        except (InputError, TypeError, ValueError, RuntimeError, RecursionError) as e:
            # RuntimeError: torch refusing the architecture (ModelConfig bounds the sizes first)
            raise Unprocessable(f"model rejected: {str(e)[:300]}", code="invalid_model") from None
        return weights, json.loads(config.to_json())

    def _publish(self, version: int, weights: dict[str, torch.Tensor], model_config: dict[str, Any],
                 round_id: int | None, count: int, samples: int | None, reason: str | None = None,
                 dp: dict[str, Any] | None = None) -> str:
        """Write version ``version`` and close its round. ``samples`` is ``Σ|D_c|``, or None in a
        DP round: the accountant covers the model, not the sample counts, so they are not published."""
        meta = {"version": version, "round_id": round_id, "num_updates": count, "total_samples": samples}
        if dp is not None:
            meta["dp"] = dp                            # the (ε, δ) this version is published with
        data = encode_weights(weights, {"format": MODEL_FORMAT, "model_config": json.dumps(model_config, sort_keys=True),
                                        "meta": json.dumps(meta)})
        path = self.layout.model_file(version)
        atomic_write(path, data)                       # the file first …
        sha = sha256_hex(data)
        top_sha = self._publish_top(version, weights, data, sha)
        with self.db.transaction() as c:               # … then the row that makes it visible
            c.execute("INSERT INTO models(version, file, sha256, round_id, num_updates, total_samples, created_at)"
                      " VALUES (?, ?, ?, ?, ?, ?, ?)",
                      (version, path.name, sha, round_id, count, samples or 0, self.clock()))
            if round_id is not None:
                c.execute("UPDATE rounds SET state = 'closed', closed_at = ?, result_version = ?, reason = ?"
                          " WHERE id = ?", (self.clock(), version, reason, round_id))
            if dp is not None:
                c.execute("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                          (f"dp_model_v{version}", json.dumps(dp)))
            if top_sha is not None:
                c.execute("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                          (f"model_top_v{version}", top_sha))
        self.model = GlobalModel(version, sha, {k: v.clone() for k, v in weights.items()}, model_config)
        return sha

    def _publish_top(self, version: int, weights: Mapping[str, torch.Tensor], data: bytes, sha: str) -> str | None:
        """Write version ``version``'s top-only body (:mod:`fedfs_sdk.federation.model_top`) when its trunk is
        the served ξ's, bit for bit; its sha256 (named in round tasks), else None."""
        from fedfs_sdk.federation.model_top import TOP_FORMAT
        from fedfs_sdk.federation.wire_format import read_header
        from fedfs_sdk.training.top_keys import top_entries, trunk_sha256

        xi_trunk = self._xi_trunk_sha256()
        trunk = trunk_sha256(weights)
        if xi_trunk is None or trunk != xi_trunk:
            return None
        body = encode_weights(top_entries(weights), {"format": TOP_FORMAT, "model_sha256": sha, "trunk_sha256": trunk,
                                                    "model_metadata": json.dumps(read_header(data)[1], sort_keys=True)})
        atomic_write(self.layout.model_top_file(version), body)
        return sha256_hex(body)

    def _xi_trunk_sha256(self) -> str | None:
        """:func:`~fedfs_sdk.training.top_keys.trunk_sha256` of the served ξ (computed once per ξ)."""
        xi_sha = self.db.get_meta("xi_sha256")
        if xi_sha is None or not self.layout.xi.is_file():
            return None
        cached = getattr(self, "_xi_trunk_cache", None)
        if cached is None or cached[0] != xi_sha:
            from safetensors.numpy import load_file

            from fedfs_sdk.training.top_keys import trunk_sha256

            cached = self._xi_trunk_cache = (xi_sha, trunk_sha256(load_file(str(self.layout.xi))))
        return cached[1]

    def model_top_file(self, version: int) -> tuple[Path, str]:
        """Version ``version``'s top-only body and its sha256; 404 ``no_top_body`` where there is none
        (its trunk is not ξ's, or the server serves no ξ)."""
        with self._lock:
            sha = self.db.get_meta(f"model_top_v{int(version)}")
        path = self.layout.model_top_file(version)
        if sha is None or not path.is_file():
            raise NotFound(f"model version {version} has no top-only body (its trunk is not ξ's, or the server "
                           "serves no ξ): download the whole model", code="no_top_body")
        return path, sha

    def model_info(self) -> dict[str, Any]:
        with self._lock:
            m = self.model
            if m is None:
                raise NotFound("no global model yet", code="no_model")
            dp = self.db.get_meta(f"dp_model_v{m.version}")
            return {"version": m.version, "sha256": m.sha256, "config": m.model_config,
                    "nbytes": m.nbytes, "dp": json.loads(dp) if dp else None,
                    # what ships with the model (docs/protocol.md): ξ and the public impostor set
                    "xi_sha256": self.db.get_meta("xi_sha256"), "impostors_sha256": impostors_sha256(self),
                    "method": self.policy.method}

    def model_file(self, version: int) -> tuple[Path, str]:
        with self._lock:
            row = self.db.one("SELECT file, sha256 FROM models WHERE version = ?", version)
        if row is None:
            raise NotFound(f"model version {version} does not exist", code="unknown_model_version")
        return self.layout.models / row["file"], row["sha256"]

    def _xi_mismatch(self, policy: RoundPolicy, model_config: Mapping[str, Any] | None) -> str | None:
        """Why devices could not train ``policy`` on ``model_config`` with the served ξ, if so."""
        if not self.layout.xi.is_file() or model_config is None:
            return None
        from fedfs_sdk.nn.model import ModelConfig
        from fedfs_sdk.federation.wire_format import read_header

        try:
            meta = read_header(self.layout.xi.read_bytes())[1]
            xi_config = json.loads(ModelConfig.from_json(meta.get("model_config", "null")).resolved().to_json())
        except (OSError, InputError, ValueError):
            return None                       # a ξ without a readable config: nothing to compare
        bad = proj_dim_mismatch(policy.method, model_config, xi_config, policy.train)
        if bad is None:
            return None
        have, need, xi_dim, combine = bad
        return (f"proj_dim {have} cannot be trained with the served ξ: its embedding has {xi_dim} dims and "
                f"FedFS (combine={combine!r}) needs proj_dim = {need}")

    def xi_sha256(self) -> str | None:
        with self._lock:
            return self.db.get_meta("xi_sha256")

    def install_xi(self, data: bytes) -> str:
        """Store the frozen ξ checkpoint that FedFS devices may download (read-only)."""
        validate_xi(data)
        sha = sha256_hex(data)
        with self._lock:
            atomic_write(self.layout.xi, data)
            self.db.set_meta("xi_sha256", sha)
            m = self.model           # the current version (published before ξ, at start-up): its top body too
            if m is not None and self.db.get_meta(f"model_top_v{m.version}") is None:
                top = self._publish_top(m.version, m.weights, self.layout.model_file(m.version).read_bytes(), m.sha256)
                if top is not None:
                    self.db.set_meta(f"model_top_v{m.version}", top)
        _event("xi installed", sha256=sha)
        return sha


def validate_xi(data: bytes) -> None:
    """:class:`CheckpointError` unless ``data`` is a readable fedfs checkpoint (for ξ)."""
    try:
        _, meta = decode_weights(data)
    except InputError as e:
        raise CheckpointError(f"ξ is not a readable safetensors checkpoint: {e}") from None
    if meta.get("format") != MODEL_FORMAT:
        raise CheckpointError(f"ξ is not a fedfs checkpoint (format={meta.get('format')!r})")


def _version_of(p: Path) -> int:
    try:
        return int(p.name[1:].split(".")[0])
    except ValueError:
        return 1 << 62  # not a version file: treated as an orphan


__all__ = ["ModelStore", "validate_xi"]
