"""The statistics rounds and the in-domain do-no-harm check on the ONNX runtime (an export folder,
no torch) — the same numbers as the torch device's (:mod:`.device_stats`), from the export's graphs:

* ``ort-training/<method>/trunk.onnx`` of a ``scope="top"`` artifact exported with ξ: ξ's trunk
  (images → features), which under ``scope="top"`` is every candidate's trunk too;
* ``onnx/top.onnx``: the backbone's top (features → embedding), into which a candidate's
  ``backbone.embed*`` weights are written;
* ``onnx/verifier.onnx`` with ξ's backbone: ξ's embeddings for ``xi.embedding``.

A candidate verifier's ``embedding`` output is then its top on trunk features, followed by what the
verifier graph does after the backbone (:class:`~fedfs_sdk.nn.model.VerifierNet`: nothing, or
``e Wᵀ`` for the global model's ``head-template``; :class:`~fedfs_sdk.nn.model.DualVerifierNet`:
``unit(q' Wᵀ) ⊕ unit(r' Wᵀ)``) — a matrix product and a normalization, done here in numpy. Impostors
are the features drawn in the federation's conditions (:func:`~fedfs_sdk.stats.in_domain.in_domain_draws`),
through the same top; :func:`~fedfs_sdk.training.selection.check_candidate` scores them, as the simulator does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import CheckpointError, InputError
from ..training.top_keys import is_top_key, trunk_sha256

TOP_FILE = "onnx/top.onnx"
DRAW_CHUNK = 2048


def backbone_arrays(weights: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The ``backbone.*`` entries of a state dict as float32 arrays."""
    return {k: np.asarray(v, dtype=np.float32) for k, v in weights.items() if k.startswith("backbone.")}


def xi_backbone(xi_file: Path, candidate: str, embedding_sum: np.ndarray | None) -> dict[str, np.ndarray]:
    """ξ's backbone as candidate ``candidate`` verifies with it: as it is (``xi``), or ``norm-adapt`` —
    its ``embed_norm`` re-fitted to the federation's published embedding moments
    (:func:`~fedfs_sdk.stats.in_domain.norm_adapt_arrays`)."""
    from safetensors.numpy import load_file

    xi = backbone_arrays(load_file(str(xi_file)))
    if candidate != "norm-adapt":
        return xi
    if embedding_sum is None:
        raise InputError("the norm-adapt candidate needs the federation's published embedding moments "
                         "(a statistics round's xi.embedding)")
    from ..stats.in_domain import norm_adapt_arrays

    return norm_adapt_arrays(xi, embedding_sum)


def xi_trunk_artifact(runtime: Any, xi_sha: str):
    """A ``scope="top"`` training artifact of ``runtime``'s export exported with ξ ``xi_sha`` (its
    ``trunk.onnx`` is ξ's trunk), or None."""
    return next((a for a in runtime.artifacts() if a.info.get("xi_sha256") == xi_sha and a.trunk is not None), None)


def _no_trunk(root: Path, xi_sha: str) -> InputError:
    return InputError(f"{root} has no scope='top' ORT artifact exported with the round's ξ ({xi_sha[:12]}…): its "
                      "trunk graph gives ξ's trunk features; export with --xi and the default scope")


def xi_statistics(runtime: Any, agent: Any, xi_file: Path, xi_sha: str, positions: np.ndarray,
                  features: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """ξ's embeddings (and trunk features) of the owner's photos at ``positions`` (module docstring)."""
    from ..runtime.onnx_backend import OnnxBackend

    art = xi_trunk_artifact(runtime, xi_sha)
    if features and art is None:
        raise _no_trunk(runtime.root, xi_sha)
    onnx = runtime.root / "onnx" / "verifier.onnx"
    if not onnx.is_file():
        raise InputError(f"{runtime.root} has no onnx/verifier.onnx to embed with ξ; export with --formats onnx,ort-training")
    xi = xi_backbone(xi_file, "xi", None)
    try:        # another architecture's weights are refused by name or shape, never loaded into other layers
        backend = OnnxBackend(onnx, weights=xi, intra_op_threads=runtime.intra_op_threads)
    except InputError as e:
        raise InputError(f"ξ's backbone does not fit the exported verifier graph ({e}): the ONNX runtime cannot "
                         "embed with ξ (use the torch runtime, or a ξ of the global model's architecture)") from None
    x = agent.all_images_array(backend.input_size)[positions]
    e = backend.run(np.ascontiguousarray(x))["embedding"]
    f = runtime.trunk_features(art, x) if features else None
    return np.asarray(e, dtype=np.float32), f


class TopGraph:
    """``onnx/top.onnx`` with one candidate's ``backbone.embed*`` weights written in."""

    def __init__(self, root: Path, backbone: Mapping[str, np.ndarray], intra_op_threads: int | None = None) -> None:
        from ..runtime.onnx_backend import import_onnxruntime, session_options, with_weights

        path = root / TOP_FILE
        if not path.is_file():
            raise InputError(f"{root} has no {TOP_FILE} (the top graph of the in-domain check): export again with "
                             "--formats onnx,ort-training and the default scope")
        model, _ = with_weights(path, backbone, complete=True)   # names, shapes, finiteness checked there
        ort = import_onnxruntime()
        try:
            self.session = ort.InferenceSession(model, sess_options=session_options(intra_op_threads),
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 — a damaged graph
            raise CheckpointError(f"ONNX Runtime cannot load {path} ({str(e).splitlines()[0][:300]}); export again") from None

    def __call__(self, features: np.ndarray) -> np.ndarray:
        f = np.ascontiguousarray(features, dtype=np.float32)
        return np.concatenate([self.session.run(["embedding"], {"features": f[a:a + DRAW_CHUNK]})[0]
                               for a in range(0, max(len(f), 1), DRAW_CHUNK)]) if len(f) else np.zeros((0, 0), np.float32)


def _unit(x: np.ndarray) -> np.ndarray:
    """:func:`~fedfs_sdk.nn.backbones.layers.l2_normalize` (``x / sqrt(Σx² + 1e-12)``) in float32."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + np.float32(1e-12))


def candidate_embeddings(runtime: Any, backbones: list[Mapping[str, np.ndarray]], head: np.ndarray | None,
                         project: bool, trunk_sha: str):
    """The ``embedding`` output of a candidate verifier as a function of trunk features: one backbone
    (+ ``e Wᵀ`` when ``project``) or two (θ_c, w: the dual verifier). Each backbone's trunk must be
    ξ's bit for bit (``scope="top"``), else the drawn impostors do not apply to it."""
    for bb in backbones:
        if trunk_sha256(bb) != trunk_sha:
            raise InputError("the candidate does not run on ξ's trunk (trained with scope='all', or a global model "
                             "not started from ξ): impostors drawn in ξ's feature space do not apply to it")
    tops = [TopGraph(runtime.root, {k: v for k, v in bb.items() if is_top_key(k)}, runtime.intra_op_threads)
            for bb in backbones]
    w = None if head is None else np.asarray(head, dtype=np.float32)

    def run(features: np.ndarray) -> np.ndarray:
        outs = [t(features) for t in tops]
        if len(outs) == 2:                                  # DualVerifierNet: unit(q' Wᵀ) ⊕ unit(r' Wᵀ)
            return np.concatenate([_unit(o @ w.T) for o in outs], axis=-1)
        return outs[0] @ w.T if project else outs[0]
    return run


def verifier_top(runtime: Any, weights: Mapping[str, np.ndarray], outputs: tuple[str, ...], trunk_sha: str):
    """The outputs of the ORT verifier holding ``weights`` — what :meth:`OrtRuntime.verifier` wrote into
    ``onnx/verifier.onnx`` (``backbone.*`` and the head ``uv_head.weight``: ``embedding``, ``uv =
    √c·unit(e Wᵀ)``, :class:`~fedfs_sdk.nn.model.VerifierNet`) or ``onnx/verifier-dual.onnx`` (with
    ``global_backbone.*``: ``embedding = unit(q' Wᵀ) ⊕ unit(r' Wᵀ)``) — as a function of ξ's trunk features:
    its top(s) through ``onnx/top.onnx``, the head maths in numpy. None where a backbone's trunk is not
    ξ's (``trunk_sha``) or ``outputs`` are not those: the full forward must run then."""
    bbs = [backbone_arrays(weights)]
    if any(k.startswith("global_backbone.") for k in weights):
        bbs.append({k[len("global_"):]: np.asarray(v, dtype=np.float32) for k, v in weights.items()
                    if k.startswith("global_backbone.")})
    if any(trunk_sha256(bb) != trunk_sha for bb in bbs):
        return None
    head = weights.get("uv_head.weight")
    plain = len(bbs) == 2 or head is None           # the dual verifier's (or a headless model's) only output
    if tuple(outputs) != (("embedding",) if plain else ("embedding", "uv")):
        return None
    run = candidate_embeddings(runtime, bbs, head, False, trunk_sha)
    w = None if head is None else np.asarray(head, dtype=np.float32)

    def outs(features: np.ndarray) -> dict[str, np.ndarray]:
        e = run(features)
        if plain:
            return {"embedding": e}
        return {"embedding": e, "uv": _unit(e @ w.T) * np.float32(np.sqrt(w.shape[0]))}
    return outs


def xi_top(runtime: Any, xi_file: Path):
    """ξ's top as a function of trunk features → ξ's embeddings (float64): ``onnx/top.onnx`` with ξ's
    ``backbone.embed*`` weights."""
    graph = TopGraph(runtime.root, {k: v for k, v in xi_backbone(xi_file, "xi", None).items() if is_top_key(k)},
                     runtime.intra_op_threads)
    return lambda f: np.asarray(graph(f), dtype=np.float64)


def far_evidence(runtime: Any, stats: Any, backend: Any, artifact: Any, top: Any, xi_file: Path, impostors: Any):
    """:func:`~fedfs_sdk.stats.evidence.evidence_for_backend` on the ONNX runtime: the enrolled verifier
    (``backend``) as its ``top`` on ξ's trunk features (:func:`verifier_top`), ξ's own top for the tail's
    directions, the public set's features from ``artifact``'s ``trunk.onnx`` — what ``enroll(far=…)``
    needs to set τ in the federation's conditions, torch-free."""
    from ..stats.evidence import in_domain_evidence, read_stat_sum, require_public_people

    stats = read_stat_sum(stats)
    require_public_people(impostors)
    public = runtime.trunk_features(artifact, impostors.batch(int(backend.input_size)))
    ev = in_domain_evidence(stats, top, xi_top(runtime, xi_file), public, impostors.identity)
    ev.record.update(model_id=getattr(backend, "model_id", None), tail_model_id=None)
    return ev


def candidate_check(runtime: Any, agent: Any, name: str, backbones: list[Mapping[str, np.ndarray]],
                    head: np.ndarray | None, project: bool, drawn: np.ndarray, train: np.ndarray, hold: np.ndarray,
                    xi_sha: str):
    """One candidate's in-domain check (:func:`~fedfs_sdk.federation.device_stats.in_domain_check`'s, torch-free):
    template from the training photos, genuine = the hold-out, impostors = ``drawn`` through its top."""
    from ..training.selection import check_candidate

    art = xi_trunk_artifact(runtime, xi_sha)
    if art is None:
        raise _no_trunk(runtime.root, xi_sha)
    run = candidate_embeddings(runtime, backbones, head, project, str(art.trunk["sha256"]))
    feats = runtime.trunk_features(art, agent.all_images_array(art.input_size))
    return check_candidate(name, run(feats[train]), run(feats[hold]), run(drawn).astype(np.float64), far=1e-3)


__all__ = ["TOP_FILE", "backbone_arrays", "xi_backbone", "xi_trunk_artifact", "xi_statistics", "TopGraph", "candidate_embeddings",
           "verifier_top", "xi_top", "far_evidence", "candidate_check"]
