"""The device owner's enrollment record (:class:`Enrollment`): the model it was made with, the
scoring mode, the threshold ``τ`` and target TPR ``q`` of FedUV Alg. 2, the warm-up count ``n``,
the secret codeword ``v_u`` (codeword mode) or the unit template (template mode), and ``meta``;
and its JSON form (what :mod:`fedfs_sdk.runtime.enrollment_store` encrypts). Moved down from
:mod:`fedfs_sdk.runtime.enrollment` (which re-exports it) so the store imports it without an
import circle.
"""
from __future__ import annotations

import base64
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import EnrollmentError


@dataclass
class Enrollment:
    """The device owner's enrollment. Secret: never leaves the device."""

    model_id: str
    mode: str                      # "codeword" | "template"
    threshold: float
    q: float
    n_warmup: int
    codeword: np.ndarray | None = None   # int8 ±1 [c]
    template: np.ndarray | None = None   # float32 unit vector [D]
    created_at: float = field(default_factory=time.time)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def template_output(self) -> str:
        """Template mode: which backend output the template is built on — ``embedding`` (the
        backbone's) or ``uv`` (the FedUV head ``σ(W g)``: its cosine is that of ``W·g``, the
        ``head-template`` verifier of docs/personalization.md). Kept in ``meta`` so the file's
        keys stay those older readers know; files without it are ``embedding``."""
        out = self.meta.get("template_output", "embedding")
        if out not in ("embedding", "uv"):
            raise EnrollmentError(f"enrollment names an unknown template output {out!r}; re-enroll")
        return str(out)

    @property
    def dropped(self) -> list[int]:
        """Indices (in the images given to :func:`enroll`) of the warm-up images dropped as
        outliers; details in ``meta["dropped"]`` (index, file name for paths, score) and
        ``meta["outlier_rule"]``. Empty for enrollments made before outlier rejection (their
        files load unchanged: the record lives in ``meta``, so the format is the same)."""
        return [int(d["index"]) for d in self.meta.get("dropped", [])]

    def to_json(self) -> bytes:
        d = asdict(self)
        d["codeword"] = None if self.codeword is None else np.packbits(self.codeword < 0).tobytes().hex()
        d["code_length"] = None if self.codeword is None else int(self.codeword.size)
        d["template"] = None if self.template is None else base64.b64encode(
            np.asarray(self.template, dtype="<f4").tobytes()).decode()
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Enrollment":
        try:
            d = json.loads(data)
            c = d.pop("code_length")
            if d["codeword"] is not None:
                bits = np.unpackbits(np.frombuffer(bytes.fromhex(d["codeword"]), dtype=np.uint8))[:c]
                d["codeword"] = (1 - 2 * bits.astype(np.int8)).astype(np.int8)
            if d["template"] is not None:
                d["template"] = np.frombuffer(base64.b64decode(d["template"]), dtype="<f4").astype(np.float32)
            return cls(**d)
        except (ValueError, KeyError, TypeError) as e:
            raise EnrollmentError(f"enrollment content is malformed: {e}") from e


__all__ = ["Enrollment"]
