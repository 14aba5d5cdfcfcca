"""An ORT on-device training artifact folder (``fedfs export --formats ort-training``,
:mod:`export.ort_training`): where a method's artifacts live (:func:`artifact_subdir`), the
files a complete one has, and its ``artifact.json`` (:class:`TrainingArtifact`). Shared by the
exporter and the torch-free device trainer (:mod:`fedfs_sdk.training.ort_device`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

ARTIFACT_FORMAT = "fedfs-ort-training/1"

def artifact_subdir(method: str) -> str:
    """Folder of ``method``'s artifacts under an export's ``ort-training/`` (``fedfs+feduv`` → ``fedfs_feduv``)."""
    return method.replace("+", "_")


_REQUIRED_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint", "artifact.json")


@dataclass(frozen=True)
class TrainingArtifact:
    """An artifact folder and its ``artifact.json`` (see :mod:`export.ort_training`)."""

    path: Path
    info: dict[str, Any]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "TrainingArtifact":
        p = Path(path)
        if not p.is_dir():
            raise CheckpointError(f"ORT training artifact folder not found: {p}")
        missing = [f for f in _REQUIRED_FILES if not (p / f).exists()]
        if missing:
            raise CheckpointError(f"{p} is not a complete ORT training artifact: missing {missing}")
        try:
            info = json.loads((p / "artifact.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{p / 'artifact.json'} is unreadable: {e}") from e
        if info.get("format") != ARTIFACT_FORMAT:
            raise CheckpointError(f"{p} has artifact format {info.get('format')!r}, expected {ARTIFACT_FORMAT!r}")
        art = cls(p, info)
        if art.scope not in ("all", "top"):
            raise CheckpointError(f"{p / 'artifact.json'} names scope {art.scope!r}; this fedfs knows 'all' and 'top'")
        if art.scope == "top":
            trunk = info.get("trunk")
            if not isinstance(trunk, dict) or not all(trunk.get(k) for k in ("file", "feature_dim", "sha256")):
                raise CheckpointError(f"{p / 'artifact.json'} is a scope='top' artifact without its trunk "
                                      "(file, feature_dim, sha256): export again")
            if not (p / str(trunk["file"])).is_file():
                raise CheckpointError(f"{p} is not a complete ORT training artifact: missing {trunk['file']}")
        return art

    @property
    def method(self) -> str:
        return str(self.info["method"])

    @property
    def uses_soft_labels(self) -> bool:
        return self.info.get("soft_labels") is not None

    @property
    def scope(self) -> str:
        """``all`` (the training graph takes images) or ``top`` (it takes ``trunk.onnx``'s features)."""
        return str(self.info.get("scope") or "all")

    @property
    def trunk(self) -> dict[str, Any] | None:
        """``scope="top"``: the trunk graph (``file``, ``input``, ``output``, ``feature_dim``, ``sha256``)."""
        return self.info.get("trunk") if self.scope == "top" else None

    @property
    def input_size(self) -> int:
        return int(self.info["input_size"])

    @property
    def code_length(self) -> int:
        return int(self.info["code_length"])


__all__ = ["ARTIFACT_FORMAT", "TrainingArtifact", "artifact_subdir"]
