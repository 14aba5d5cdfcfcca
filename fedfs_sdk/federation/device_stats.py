"""The device agent's part in statistics rounds and the defaults' full do-no-harm rule at
enrollment (issue 29) — the rule of the simulator's ``check=in-domain``, from the same functions
(:mod:`fedfs_sdk.stats.in_domain`).

* **Rounds.** When the server has a statistics round open for the device (``stats_round`` in a
  ``wait`` task, or the view at enrollment) the agent takes part (:class:`~fedfs_sdk.stats.client.StatsParticipant`,
  with the device's own secure-aggregation floor, identity and state): ξ's embedding moments and,
  under ``scope=top``, ξ's trunk-feature moments of its training photos (the hold-out excluded, as
  the simulator's clients), and after training its per-candidate check results. What it keeps in its
  state folder (``stats/``): the published sums, its own contribution (0600), its ledger and round log.
* **Enrollment** (:func:`stats_choice`): ``norm-adapt`` ξ from the published embedding moments; every
  candidate checked against impostors drawn from the other devices' published trunk-feature moments;
  the federation's verdict from the published check sum (taking part in that round first);
  :func:`~fedfs_sdk.stats.in_domain.decide`. When statistics are missing it raises
  :class:`StatsUnavailable` naming why, and the caller falls back (public impostors, else ξ).

The torch runtime runs all of it, and so does the ORT runtime (an export folder, no torch) from the
export's graphs (:mod:`.ort_check`): ξ's embeddings from the verifier graph with ξ's backbone, trunk
features from a ``scope="top"`` artifact's ``trunk.onnx``, each candidate's top from ``onnx/top.onnx``.
An export without them (``scope="all"`` artifacts) contributes nothing and falls back, saying why.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import FedFSError, InputError
from ..stats.in_domain import CHECKS, EMBEDDING, FEATURES, candidate_names, check_contributions, decide, in_domain_draws
from ..stats.tail import TAIL
from .device_models import device_xi

STATS_DIR = "stats"


class StatsUnavailable(FedFSError):
    """The in-domain rule cannot run on this device now (the reason says what is missing)."""


def participant(agent: Any):
    """The agent's :class:`StatsParticipant` (one per agent; state in ``STATE/stats``)."""
    p = getattr(agent, "_stats_participant", None)
    if p is None:
        from ..stats.client import StatsParticipant
        from ..stats.transport import StatsDevicePolicy

        d = agent.state.path / STATS_DIR
        d.mkdir(mode=0o700, exist_ok=True)
        p = StatsParticipant(agent.client, lambda task: contribution(agent, task),
                             StatsDevicePolicy(secagg=agent.config.secagg), state_dir=d, identity=agent._identity,
                             sleep=agent._sleep, clock=agent._clock, wait_timeout_s=agent.config.wait_timeout_s)
        agent._stats_participant = p
    return p


def take_part(agent: Any, view: Mapping[str, Any] | None = None) -> dict | None:
    """Take part in the statistics round open for this device; events ``stats_round_done`` or
    ``stats_round_refused`` (a round below the device's floors, a statistic it already gave, one it
    cannot compute) — a refusal never stops the device."""
    from ..federation.secagg.http_device import SecAggRoundLost
    from .server_client import ServerError

    p = participant(agent)
    try:
        out = p.take_part(view)
    except (InputError, SecAggRoundLost, StatsUnavailable) as e:
        agent._emit("stats_round_refused", {"reason": str(e)[:300]})
        return None
    except ServerError as e:
        if e.status >= 500:
            raise
        agent._emit("stats_round_lost", {"code": e.code, "reason": e.reason})
        return None
    if out is not None:
        agent._emit("stats_round_done", out)
    return out


# ---- contributions --------------------------------------------------------------------------
def contribution(agent: Any, task) -> dict[str, np.ndarray]:
    """This device's contribution to ``task``: ξ's moments (``xi.embedding``, ``xi.features``) of its
    training photos, or its check results (``checks``, computed at enrollment) with — where the round asks
    for it — the tail histograms ``xi.tail`` (:mod:`.device_tail`)."""
    names = {s.name for s in task.stats}
    if CHECKS in names:
        checks = getattr(agent, "_stats_checks", None)
        if checks is None or checks[0] != task.model_version:
            raise StatsUnavailable(f"statistics round {task.round_id} asks for check results on model version "
                                   f"{task.model_version}; this device has checked none on it")
        out = {CHECKS: check_contributions(checks[1], list(task.extra.get("candidates") or []))}
        tail = next((s for s in task.stats if s.name == TAIL), None)
        if tail is not None:          # the federation's tail for enroll(far=…), under ξ (.device_tail)
            from .device_tail import tail_contribution

            try:
                xi_pub, _ = xi_sums(agent, task.extra.get("xi_sha256"))
                out[TAIL] = tail_contribution(agent, task, tail.length, np.asarray(xi_pub["sums"][FEATURES]))
            except (InputError, StatsUnavailable) as e:
                # zeros leave the pooled tail's shape alone (it is read per direction, normalized) and keep this
                # device's check results in the federation's verdict, which a refusal of the round would drop
                out[TAIL] = np.zeros(tail.length)
                agent._emit("stats_tail_unavailable", {"reason": str(e)[:300]})
        unknown = names - set(out)
        if unknown:
            raise StatsUnavailable(f"statistics {sorted(unknown)} are unknown to this device")
        return out
    return xi_moments(agent, task)


def xi_moments(agent: Any, task) -> dict[str, np.ndarray]:
    """ξ's embedding and trunk-feature moments of the training photos (clipped by the task's bounds)."""
    from ..stats import embedding_moments, feature_moments
    from .device_runtime import TorchRuntime
    from .wire_format import sha256_hex

    sha = task.extra.get("xi_sha256")
    if not sha:
        raise StatsUnavailable("the statistics round names no ξ (xi_sha256)")
    path = agent.xi_file(sha)
    if sha256_hex(Path(path).read_bytes()) != sha:
        raise StatsUnavailable(f"the round's ξ ({sha[:12]}…) is not this device's ξ ({path})")
    specs = {s.name: s for s in task.stats}
    if isinstance(agent.runtime, TorchRuntime):
        net = device_xi(agent, path).eval()                   # the agent's kept ξ (read-only)
        x = agent.all_images_array(int(net.backbone.input_size))[agent.holdout_split()[0]]
        e, f = _embed_xi(net, x, FEATURES in specs, agent=agent, xi_sha=sha)
    elif hasattr(agent.runtime, "xi_statistics"):          # ONNX Runtime: verifier.onnx with ξ, trunk.onnx
        e, f = agent.runtime.xi_statistics(agent, Path(path), sha, agent.holdout_split()[0], FEATURES in specs)
    else:
        raise StatsUnavailable(f"the {agent.runtime.name} runtime cannot compute ξ's statistics")
    out: dict[str, np.ndarray] = {}
    if EMBEDDING in specs:
        out[EMBEDDING] = embedding_moments(e, specs[EMBEDDING].bound, task.max_photos)
    if FEATURES in specs:
        out[FEATURES] = feature_moments(f, specs[FEATURES].bound, task.max_photos)
    unknown = set(specs) - set(out)
    if unknown:
        raise StatsUnavailable(f"statistics {sorted(unknown)} are unknown to this device")
    return out


def _embed_xi(net, x: np.ndarray, features: bool, batch: int | None = None, agent: Any = None,
              xi_sha: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """ξ's embeddings (and trunk features) of ``x``. With features, the embedding is the top of the
    trunk's features (one forward, not two; bit-equal to ``bb(x)``), and the features are kept on
    ``agent`` for its check (:mod:`.device_features`)."""
    import torch

    from ..training.scope import EmbeddingTop, Trunk
    from .device_features import xi_trunk_features

    from .device_features import STATS_CHUNK

    batch = STATS_CHUNK if batch is None else batch
    bb = net.backbone
    if not features:
        with torch.inference_mode():
            return np.concatenate([bb(torch.from_numpy(np.ascontiguousarray(x[a:a + batch]))).double().numpy()
                                   for a in range(0, x.shape[0], batch)]), None
    if agent is not None and xi_sha is not None:
        fs = xi_trunk_features(agent, xi_sha, net, x, batch)
    else:
        trunk = Trunk(bb)
        with torch.inference_mode():
            fs = [trunk(torch.from_numpy(np.ascontiguousarray(x[a:a + batch]))) for a in range(0, x.shape[0], batch)]
    top = EmbeddingTop(bb)
    with torch.inference_mode():
        es = [top(f).double().numpy() for f in fs]
    return np.concatenate(es), np.concatenate([f.double().numpy() for f in fs])


# ---- published sums -------------------------------------------------------------------------
def published(agent: Any) -> list[dict]:
    """Every published statistics sum (downloaded once, kept in ``STATE/stats``), oldest first."""
    from .server_client import ServerError

    p = participant(agent)
    try:        # the ids only: each sum (a d×d matrix for ξ's features) is downloaded once, below
        ids = p.client.request("GET", "/v1/stats/rounds").json()["published_rounds"]
    except ServerError as e:
        if e.status in (404, 405):
            return []
        raise
    out, parsed = [], p.__dict__.setdefault("_published_parsed", {})
    for rid in ids:
        path = p.dir / f"stats-r{int(rid):06d}.json"
        if not path.is_file():
            p.fetch_published(path, int(rid))
        key = (str(path), path.stat().st_mtime_ns)
        if key not in parsed:       # a published sum never changes: parsed once (ξ's features: a d×d matrix)
            parsed[key] = json.loads(path.read_text())
        out.append(parsed[key])
    return out


def own_contribution(agent: Any, round_id: int) -> dict[str, np.ndarray] | None:
    path = participant(agent).dir / f"stats-own-r{round_id:06d}.npz"
    if not path.is_file():
        return None
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def xi_sums(agent: Any, xi_sha: str | None, rounds: list[dict] | None = None) -> tuple[dict, dict | None]:
    """The newest published ξ round for this ξ and the device's own part of it (None: it was not in it);
    ``rounds``: :func:`published`'s list when the caller has it already."""
    rounds = [d for d in (published(agent) if rounds is None else rounds) if FEATURES in d["sums"]
              and (xi_sha is None or d["task"].get("extra", {}).get("xi_sha256") == xi_sha)]
    if not rounds:
        raise StatsUnavailable("no statistics of ξ's trunk features were published (the server opened no "
                               "statistics round for this ξ, or fewer than the minimum of devices answered)")
    d = rounds[-1]
    return d, own_contribution(agent, int(d["round_id"]))


def published_far_stats(agent: Any, xi_sha: str):
    """The published sums ``enroll(far=…)`` reads — the newest ``xi.tail`` for this ξ (:mod:`.device_tail`)
    and this ξ's ``xi.features`` its directions came from — as one
    :class:`~fedfs_sdk.stats.contributions.StatSum`, or None when no round published a tail."""
    from ..stats.contributions import StatSum

    rounds = published(agent)
    tails = [d for d in rounds if TAIL in d["sums"] and (d["task"].get("extra") or {}).get("xi_sha256") == xi_sha]
    if not tails:
        return None
    try:
        xi_pub, _ = xi_sums(agent, xi_sha, rounds)
    except StatsUnavailable:
        return None
    return StatSum({FEATURES: np.asarray(xi_pub["sums"][FEATURES], dtype=np.float64),
                    TAIL: np.asarray(tails[-1]["sums"][TAIL], dtype=np.float64)}, int(tails[-1]["count"]))


# ---- the rule at enrollment -----------------------------------------------------------------
def stats_choice(agent: Any, method: str, model: bytes, version: int, verify: str,
                 score: str | None = None) -> tuple[str, dict]:
    """The defaults' in-domain choice (module docstring); :class:`StatsUnavailable` when it cannot run."""
    from ..training.methods import uses_fedfs
    from .device_enrollment import has_xi
    from .device_runtime import TorchRuntime, xi_path
    from .wire_format import sha256_hex

    torch_runtime = isinstance(agent.runtime, TorchRuntime)
    if not torch_runtime and not hasattr(agent.runtime, "in_domain_check"):
        raise StatsUnavailable(f"the {agent.runtime.name} runtime cannot score drawn trunk features")
    if not has_xi(agent):
        raise StatsUnavailable("no ξ to compare with")
    train, hold = agent.holdout_split()
    if hold.size == 0:
        raise StatsUnavailable("no hold-out photos (too few photos)")
    xi_sha = sha256_hex(xi_path(agent).read_bytes())
    xi_pub, own = xi_sums(agent, xi_sha)
    has_norm = EMBEDDING in xi_pub["sums"] and _has_embed_norm(xi_path(agent))
    agent.stats_embedding_sum = np.asarray(xi_pub["sums"][EMBEDDING]) if has_norm else None
    # a device that never trained (enrolling late, offline during the rounds) has no θ_c: its candidates
    # are ξ, norm-adapt and the global model
    trained = uses_fedfs(method) and agent.state.file("personal.safetensors").is_file()
    names = candidate_names(trained, has_norm)
    seed = int(xi_pub["task"].get("extra", {}).get("draw_seed", 0))
    drawn = in_domain_draws(np.asarray(xi_pub["sums"][FEATURES]), None if own is None else own.get(FEATURES), seed)
    xi_net = device_xi(agent, xi_path(agent)).eval() if torch_runtime else None
    try:
        if torch_runtime:
            checks = [in_domain_check(agent, name, method, model, version, verify, drawn, xi_net, train, hold, score,
                                      xi_sha=xi_sha) for name in names]
        else:                         # ONNX Runtime: the export's trunk and top graphs (.ort_check)
            checks = [agent.runtime.in_domain_check(agent, name, method, model, verify, score, drawn, train, hold,
                                                    xi_path(agent), xi_sha, agent.stats_embedding_sum) for name in names]
    except InputError as e:          # a candidate this device cannot build (e.g. no θ_c yet): the fallback decides
        raise StatsUnavailable(f"a candidate cannot be checked here: {e}") from None
    agent._stats_checks = (version, checks)
    check_sum, verdict_note = federation_verdict(agent, version, names)
    sel = decide(checks, check_sum[0] if check_sum else None, check_sum[1] if check_sum else names)
    out = {**sel.to_dict(), "check": "in-domain", "stats_round": int(xi_pub["round_id"]),
           "in_stats_round": own is not None, "verdict": verdict_note}
    agent._emit("model_chosen", {"chosen": sel.chosen, "reason": sel.reason, "check": "in-domain",
                                 "verdict": verdict_note})
    return sel.chosen, out


def _has_embed_norm(path: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return any(k.endswith("embed_norm.weight") for k in f.keys())


def in_domain_check(agent: Any, name: str, method: str, model: bytes, version: int, verify: str, drawn: np.ndarray,
                    xi_net, train: np.ndarray, hold: np.ndarray, score: str | None = None, xi_sha: str | None = None):
    """One candidate's check: template from the training photos, genuine = the hold-out, impostors =
    the drawn trunk features through the candidate's top (:func:`~fedfs_sdk.training.selection.check_candidate`,
    the simulator's function), on the candidate's ``embedding`` output as the simulator scores it (the
    global model of a ``head-template`` FedUV method: its head projection ``W·e``). With ``xi_sha``, a
    candidate on ξ's own trunk (``xi``, ``norm-adapt``) reuses the device's cached ξ trunk features of
    its photos (:mod:`.device_features`: the same numbers, one trunk forward fewer)."""
    import torch

    from ..nn.model import VerifierNet
    from ..stats.in_domain import top_verifier
    from ..training.methods import uses_feduv
    from ..training.selection import check_candidate
    from .device_features import embeddings_on_xi_trunk, has_xi_trunk

    backend = agent.runtime.verifier(method, model, agent, version, verify, candidate=name, persist=False)
    net = backend.verifier
    exact = has_xi_trunk(net, xi_net.backbone)             # ξ's trunk bit for bit (tasks naming scope=top)
    if not exact:
        _require_xi_trunk(net, xi_net.backbone, name)      # else within the secure sum's rounding, or refused
    if name == "global" and score == "head-template" and uses_feduv(method) and isinstance(net, VerifierNet) \
            and net.uv_head is not None and not net.project:
        net = VerifierNet(net.backbone, net.uv_head, project=True).eval()     # the simulator's global spec
        from ..runtime.inference import TorchBackend

        backend = TorchBackend(net, backend.model_id, device=getattr(backend, "device", "cpu"))
    x = agent.all_images_array(backend.input_size)
    # (the head-template wrap above keeps the trunk: `exact` still holds)
    if xi_sha is not None and getattr(backend, "device", "cpu") == "cpu" and exact:
        chunk = int(getattr(backend, "batch_size", 256))      # backend.run's chunks: the same computation
        tr, ho = (embeddings_on_xi_trunk(agent, net, xi_sha, xi_net, np.ascontiguousarray(x[i]), chunk)
                  for i in (train, hold))
    else:
        tr, ho = (backend.run(np.ascontiguousarray(x[i]))["embedding"] for i in (train, hold))
    top = top_verifier(net).eval()
    outs = []
    with torch.inference_mode():
        for a in range(0, drawn.shape[0], 2048):
            outs.append(top(torch.from_numpy(drawn[a:a + 2048]))[0].double().numpy())
    return check_candidate(name, tr, ho, np.concatenate(outs), far=1e-3)


def _require_xi_trunk(net, xi_backbone, name: str) -> None:
    """Drawn ξ-trunk features apply to a candidate only if its trunk *is* ξ's (``scope=top``)."""
    import torch

    from ..training.scope import is_top_key

    ref = {k: v for k, v in xi_backbone.state_dict().items() if not is_top_key(k)}
    for bb in [net.backbone] + ([net.global_backbone] if hasattr(net, "global_backbone") else []):
        mine = bb.state_dict()
        # exact when the rounds' tasks name scope=top (server_agg/frozen_trunk.py: torch.equal, cheap);
        # within the secure sum's fixed-point rounding when they name none (the trunk is then averaged as received)
        if any(k not in mine or mine[k].shape != v.shape
               or not (torch.equal(mine[k], v) or torch.allclose(mine[k].double(), v.double(), rtol=1e-5, atol=1e-6))
               for k, v in ref.items()):
            raise StatsUnavailable(f"candidate {name!r} does not run on ξ's trunk (trained with scope='all', or a "
                                   "global model not started from ξ): impostors drawn in ξ's feature space do not "
                                   "apply to it")


def federation_verdict(agent: Any, version: int, names: tuple[str, ...]) -> tuple[tuple | None, str]:
    """Take part in the check-results round on ``version`` (waiting while the server says it is still
    to come) and return ``((sum, candidates), note)`` of its published sum, or ``(None, why not)``."""
    p = participant(agent)
    t0, handled = agent._clock(), set()
    while True:
        v = p.view()
        rid = v.get("round_id")
        if v.get("phase") in ("secure", "plain") and rid not in handled:
            handled.add(rid)
            take_part(agent, v)                    # the check round (or any other open for it: answer it too)
            continue
        opened = v.get("phase") in ("secure", "plain")     # answered (plain) or refused: wait for its end
        if not opened and "checks" not in (v.get("pending") or []):
            break
        if agent._clock() - t0 > agent.config.wait_timeout_s:
            return None, f"the check-results round did not open within {agent.config.wait_timeout_s:.0f} s"
        agent._sleep(min(max(float(v.get("retry_after") or 0.5), 0.05), 10.0))
    for d in reversed(published(agent)):
        if CHECKS in d["sums"] and int(d["task"]["model_version"]) == int(version):
            cands = list(d["task"].get("extra", {}).get("candidates") or names)
            return (np.asarray(d["sums"][CHECKS]), cands), f"published over {d['count']} devices"
    return None, "no check results published for this model version (no round, or too few devices answered)"


__all__ = ["StatsUnavailable", "participant", "take_part", "contribution", "xi_moments", "published", "xi_sums",
           "published_far_stats",
           "stats_choice", "in_domain_check", "federation_verdict", "STATS_DIR"]
