"""The statistics rounds ``fedfs serve`` opens by itself (issue 29, ``policy.stats_rounds``, on by
default; ``--no-stats-rounds`` turns them off).

The defaults' do-no-harm rule (:mod:`fedfs_sdk.stats.in_domain`) needs two sums, and the server opens
a round for each at the point the rule needs it, on every eligible device, under secure aggregation
(``fedfs-secagg/2`` where the server pins ``--secagg-ca``):

1. **ξ's moments** (``xi.embedding``, ``xi.features`` — the latter when ξ's backbone splits into
   trunk + top) before the first weight round: the first weight round opens once this round has
   published or failed — for ``fedfs+feduv`` on a model started from ξ, from version 2: the initial
   model with the default's ``norm_init`` (:func:`norm_init`), as the simulator starts ϕ;
2. **the devices' check results** (``checks``, one block per candidate after ξ) after the last weight
   round, on the final model version; devices enrolling then take part before they choose. Where the
   server ships a public impostor set, the first such round per ξ also asks for ξ's tail histograms
   along the public people (``xi.tail``, :func:`tail_spec`): what ``enroll(far=…)`` sets τ from.

Each round proceeds with the devices that answered by its phase deadlines and publishes only a sum
over ≥ :data:`~fedfs_sdk.stats.MIN_CONTRIBUTORS`; otherwise nothing is published and the outcome says why
(``GET /v1/admin/stats-round/{id}``; devices fall back to the public impostors or keep ξ). A round
that could not even open (fewer eligible devices than the minimum) is recorded as skipped and the
weight rounds go on. Without a pinned CA the automatic rounds are skipped: the secure sum would run
``fedfs-secagg/1``, which devices with the default floor refuse (they would only time out).
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from fedfs_sdk.stats import EMBEDDING_BOUND, FEATURE_BOUND, MAX_PHOTOS, MIN_CONTRIBUTORS, feature_length
from fedfs_sdk.stats.in_domain import CHECKS, EMBEDDING, FEATURES, candidate_names
from fedfs_sdk.stats.transport import SECURE, StatSpec
from fedfs_sdk.training.methods import uses_fedfs

from .errors import ApiError
from .impostor_store import impostors_path, impostors_sha256
from .round_state import _event

STATE, SHAPE = "stats_auto", "stats_xi_shape"


def _get(coord: Any, key: str) -> dict:
    raw = coord.db.get_meta(key)
    return json.loads(raw) if raw else {}


def _note(coord: Any, key: str, value: dict) -> None:
    state = _get(coord, STATE)
    state[key] = value
    coord.db.set_meta(STATE, json.dumps(state))


def wanted(coord: Any) -> bool:
    p = coord.policy
    return bool(getattr(p, "stats_rounds", False)) and p.rounds > 0 and bool(coord.db.get_meta("xi_sha256"))


def xi_shape(coord: Any) -> dict:
    """``{sha, embedding, features, norm}`` of the served ξ: its embedding width, its trunk's feature
    width (None: the backbone does not split) and whether it has an ``embed_norm`` to re-fit (cached)."""
    sha = coord.db.get_meta("xi_sha256")
    cached = _get(coord, SHAPE)
    if cached.get("sha") == sha:
        return cached
    import torch

    from fedfs_sdk.errors import InputError
    from fedfs_sdk.nn.checkpoint import load_checkpoint
    from fedfs_sdk.training.scope import Trunk

    net = load_checkpoint(coord.layout.xi)[0].eval()
    bb = net.backbone
    size = int(getattr(bb, "input_size", 112))
    with torch.no_grad():
        dim = int(bb(torch.zeros(2, 3, size, size)).shape[1])
        try:
            feat: int | None = int(Trunk(bb)(torch.zeros(2, 3, size, size)).shape[1])
        except InputError:
            feat = None
    shape = {"sha": sha, "embedding": dim, "features": feat,
             "norm": isinstance(getattr(bb, "embed_norm", None), torch.nn.Module)}
    coord.db.set_meta(SHAPE, json.dumps(shape))
    return shape


def round_dp(policy: Any) -> dict | None:
    """The automatic rounds' DP (``stats_dp_*``) as a task's ``dp`` field (None: no noise)."""
    z = getattr(policy, "stats_dp_noise_multiplier", None)
    if z is None:
        return None
    return {"noise_multiplier": float(z), "noise": policy.stats_dp_noise, "delta": policy.stats_dp_delta}


def _open(coord: Any, desk: Any, key: str, specs: tuple[StatSpec, ...], extra: dict | None = None) -> bool:
    try:
        out = desk.open_task(specs, SECURE, MIN_CONTRIBUTORS, MAX_PHOTOS, extra, round_dp(coord.policy))
    except ApiError as e:
        _note(coord, key, {"state": "skipped", "reason": str(e)[:500]})
        _event("statistics round skipped", key=key, reason=str(e)[:200])
        return False
    _note(coord, key, {"round_id": out["round_id"]})
    _event("statistics round opened", key=key, round_id=out["round_id"], devices=out["devices"])
    return True


NO_CA = ("the server pins no operator CA (--secagg-ca): its secure sum would run fedfs-secagg/1, which devices "
         "with the default floor refuse; the automatic statistics rounds run only authenticated (an operator may "
         "still open one: POST /v1/admin/stats-round)")


def _skip_without_ca(coord: Any, key: str) -> bool:
    """Without a pinned CA the automatic round is skipped (recorded once, with the reason)."""
    from .secagg_rounds import ca_of

    if ca_of(coord.policy) is not None:
        return False
    _note(coord, key, {"state": "skipped", "reason": NO_CA})
    _event("statistics round skipped", key=key, reason="no --secagg-ca")
    return True


def norm_init(coord: Any, desk: Any) -> None:
    """The default's ``norm_init`` (:data:`~fedfs_sdk.training.methods.DEFAULT_NORM_INIT`, ``fedfs+feduv``:
    ``standardize``): once ξ's moments are published and before round 1, the initial global model —
    when its embedding normalization is ξ's — is published again with that normalization re-fitted to
    the federation's pooled embedding moments, as the simulator starts ϕ (``init_global``)."""
    from fedfs_sdk.training.methods import DEFAULT_NORM_INIT

    mode = DEFAULT_NORM_INIT.get(coord.policy.method, "none")
    sha = coord.db.get_meta("xi_sha256")
    key = f"norm_init:{sha}"
    if mode == "none" or coord.model is None or coord._completed() > 0 or key in _get(coord, STATE):
        return
    rid = _get(coord, STATE).get(f"xi:{sha}", {}).get("round_id")
    out = desk.outcomes().get(str(rid)) if rid is not None else None
    if out is None or out.get("state") != "published":
        _note(coord, key, {"state": "skipped", "reason": "ξ's embedding moments were not published"})
        return
    import numpy as np
    import torch

    from fedfs_sdk.nn.checkpoint import load_checkpoint
    from fedfs_sdk.stats.in_domain import embedding_norm_prefix, norm_adapt_weights

    from fedfs_sdk.errors import InputError

    weights = coord.model.weights
    try:
        pre = embedding_norm_prefix({k: v for k, v in weights.items() if k.startswith("backbone.")})
    except InputError as e:          # no embed_norm to fold into (dlib-resnet): the simulator runs without it too
        _note(coord, key, {"state": "skipped", "reason": str(e)[:300]})
        return
    xi_w = load_checkpoint(coord.layout.xi)[0].state_dict()
    if not all(pre + n in xi_w and xi_w[pre + n].shape == weights[pre + n].shape
               and torch.equal(xi_w[pre + n], weights[pre + n]) for n in ("weight", "bias")):
        _note(coord, key, {"state": "skipped", "reason": "the initial global model's embedding normalization is not "
                           "ξ's (it was not started from ξ): the fold applies to ξ's"})
        return
    total = np.asarray(desk.published(int(rid))["sums"]["xi.embedding"])
    new = norm_adapt_weights(weights, total, mode)
    version = coord.model.version + 1
    coord._publish(version, new, coord.model.model_config, None, 0, 0, f"norm_init={mode}")
    _note(coord, key, {"version": version, "mode": mode, "stats_round": int(rid)})
    _event("norm_init folded", version=version, mode=mode, stats_round=int(rid))


def before_weight_round(coord: Any, desk: Any) -> bool:
    """Whether the next weight round may open now. Before the first one, ξ's moments round is opened
    first (once per ξ) and the weight round waits until it has ended (then the default's
    :func:`norm_init`)."""
    if desk.round is not None:
        return False                       # one thing at a time: devices answer the statistics round first
    if not wanted(coord) or coord._completed() > 0:
        return True
    key = f"xi:{coord.db.get_meta('xi_sha256')}"
    if key in _get(coord, STATE):
        norm_init(coord, desk)
        return True
    if _skip_without_ca(coord, key):
        return True
    shape = xi_shape(coord)
    bound = getattr(coord.policy, "stats_bound", None)
    specs = [StatSpec(EMBEDDING, "embedding", 2 * shape["embedding"] + 1, bound or EMBEDDING_BOUND)]
    if shape["features"] is not None:
        specs.append(StatSpec(FEATURES, "features", feature_length(shape["features"]), bound or FEATURE_BOUND))
    # the devices' impostor draws are seeded by the federation's seed (the simulator's --seed)
    return not _open(coord, desk, key, tuple(specs), {"draw_seed": int(coord.policy.seed)})


def after_weight_rounds(coord: Any, desk: Any) -> None:
    """After the last weight round: the check-results round on the final model version (once)."""
    p = coord.policy
    if desk.round is not None or coord.round is not None or not wanted(coord) or coord.model is None \
            or coord._completed() < p.rounds:
        return
    key = f"checks:v{coord.model.version}"
    if key in _get(coord, STATE) or _skip_without_ca(coord, key):
        return
    shape = xi_shape(coord)
    xi_published = any(v.get("state") == "published" and EMBEDDING in v.get("names", [])
                       for v in desk.outcomes().values())
    names = candidate_names(uses_fedfs(p.method), bool(shape["norm"]) and xi_published)
    specs, extra = [StatSpec(CHECKS, "checks", 4 * (len(names) - 1), 1.0)], {"candidates": list(names)}
    tail = tail_spec(coord, desk, shape)
    if tail is not None:        # once per ξ: a second tail over another cohort would reveal the difference
        specs.append(tail)
        extra.update(xi_sha256=coord.db.get_meta("xi_sha256"), impostors_sha256=impostors_sha256(coord))
    if _open(coord, desk, key, tuple(specs), extra) and tail is not None:
        _note(coord, f"tail:{coord.db.get_meta('xi_sha256')}", {"checks_round": key})


def tail_spec(coord: Any, desk: Any, shape: dict) -> StatSpec | None:
    """The ``xi.tail`` statistic the check-results round carries (``enroll(far=…)`` in the federation's
    conditions, :mod:`fedfs_sdk.federation.device_tail`), or None: where ξ's backbone splits, ξ's feature
    moments were published, the server ships a public set with ≥ 2 people of ≥ 2 photos (its directions),
    the rounds carry no DP noise, and no round asked for this ξ's tail before."""
    from fedfs_sdk.runtime.impostors import load_impostors
    from fedfs_sdk.stats.tail import TAIL, TAIL_BINS

    sha = coord.db.get_meta("xi_sha256")
    if shape["features"] is None or impostors_sha256(coord) is None or f"tail:{sha}" in _get(coord, STATE):
        return None
    if round_dp(coord.policy) is not None:
        # noise for one device's worst case (all its photos in one bin of every direction: 64·√P) buries the
        # per-bin counts the tail's quantile reads; under statistics DP a FAR target uses the public set alone
        return None
    if not any(v.get("state") == "published" and FEATURES in v.get("names", []) for v in desk.outcomes().values()):
        return None
    ids = load_impostors(impostors_path(coord)).identity
    if ids is None:
        return None
    people = int((np.unique(np.asarray(ids), return_counts=True)[1] >= 2).sum())
    return StatSpec(TAIL, "tail", people * TAIL_BINS, 1.0) if people >= 2 else None


def pending(coord: Any) -> list[str]:
    """The automatic rounds a device should still wait for: ``checks`` once the weight rounds are over
    and its round is still to open (devices enrolling then wait for it); ``xi`` before round 1."""
    if not wanted(coord):
        return []
    state = _get(coord, STATE)
    done = coord._completed()
    out = []
    if done == 0 and f"xi:{coord.db.get_meta('xi_sha256')}" not in state:
        out.append("xi")
    if coord.model is not None and done >= coord.policy.rounds and f"checks:v{coord.model.version}" not in state:
        out.append("checks")
    return out


__all__ = ["before_weight_round", "after_weight_rounds", "pending", "wanted", "xi_shape"]
