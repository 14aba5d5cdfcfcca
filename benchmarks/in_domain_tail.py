"""Which impostor model predicts a device's in-domain FAR, down to 1e-3 (issue 29, item 2)?

ξ and norm-adapt ξ (no training). For every client of a ``fedfs simulate`` split (same flags), its
template (the unit mean of its training photos' unit embeddings) is scored against draws of each
impostor model built from the *other* clients' summed statistics; each model sets τ for a target
FAR; the FAR is measured at τ on real impostors: the other clients' photos (in the statistics) and
the new users' (held-out people, in no statistic). Models:

* ``gauss`` — the default: trunk features ``f ~ N(μ, C)`` through the candidate's top
  (:mod:`fedfs_sdk.stats.impostor_model`);
* ``t5``, ``t10`` — the same covariance, Student-t radial scale (heavier tails);
* ``normal-score`` — the score normal with mean ``uᵀμ_e`` and variance ``uᵀΣ_e u`` of the others'
  unit embeddings (D×D moments *per candidate*);
* ``public-tail`` — the Gaussian's location/scale with the tail shape ``z*`` of the public set
  (each public person's template against the other public people's photos, standardized by their
  mean/SD): no new statistic, out-of-domain shape;
* ``fed-tail`` — the Gaussian's location/scale with the tail shape ``z*`` the federation measures
  along public directions (:mod:`fedfs_sdk.stats.tail`: summed histograms of devices' scores on
  public templates, standardized by the Gaussian's own location/scale there) — the histograms
  under the candidate itself;
* ``fed-tail(ξ)`` — norm-adapt's τ from the tail shape measured under ξ (what a candidate no other
  device can run — the personalized one — would use).

Per candidate, model, target FAR and impostor set: mean / median measured FAR over devices, the mean
and median of measured/target, and the share of devices above 2× target. Trunk features are cached
(``--cache``), so a rerun costs the per-device draws only (about a minute per candidate).

    python benchmarks/in_domain_tail.py --data lfw-112 --pretrained xi.safetensors --image-size 112 \
        --backbone mobilefacenet-affine --scenario real-night --seed 0 --split-seed 0 --threads 1
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.stats import norm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FARS = (1e-3, 1e-2, 1e-1)
DRAWS = 8192


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _sqrtm(c: np.ndarray, power: float, ridge: float = 1e-3) -> np.ndarray:
    """``(C + ε I)^power`` of a covariance (ε relative to its mean variance)."""
    w, v = np.linalg.eigh(0.5 * (c + c.T) + ridge * np.trace(c) / c.shape[0] * np.eye(c.shape[0]))
    return (v * np.clip(w, 1e-12, None) ** power) @ v.T


def load_features(sim_argv: list[str], cache: Path) -> dict:
    """Trunk features of every client's training photos, every new user's photos and the public
    impostor set (with its people), and ξ's top weights and norm-adapt's — cached by the flags."""
    key = hashlib.sha256(" ".join(sim_argv).encode()).hexdigest()[:16]
    path = cache / f"features-{key}.pt"
    if path.is_file():
        return torch.load(path, weights_only=False)
    from device_sim.cli_simulate import experiment_from_argv
    from device_sim.experiment_data import build_data, build_pretrain_data
    from device_sim.methods.base import backbone_weights, verifier_net
    from device_sim.methods.client_stats import EMBEDDING, client_statistics
    from device_sim.methods.reference import fold_standardization
    from device_sim.methods.selection import top_verifier
    from device_sim.population import Population
    from device_sim.xi_source import resolve_xi
    from fedfs_sdk.stats import norm_fold_from_sum
    from fedfs_sdk.training.scope import Trunk

    cfg = experiment_from_argv(sim_argv + ["--out", str(cache / "sim")])
    ds, splits = build_data(cfg)
    pop = Population(ds, splits)
    xi, _ = resolve_xi(cfg, ds, splits, quiet=True)
    xi = xi.eval()
    trunk = Trunk(xi.backbone).eval()

    @torch.no_grad()
    def feats(x: torch.Tensor) -> np.ndarray:
        return torch.cat([trunk(x[a:a + 128]) for a in range(0, x.shape[0], 128)]).double().numpy() \
            if x.shape[0] else np.zeros((0, 1))

    clients = [feats(pop.train_images(c)) for c in range(pop.num_clients)]
    new_users = [feats(pop.new_user_images(u)) for u in range(pop.num_new_users)]
    src_ds, src_splits = build_pretrain_data(cfg, ds, splits)
    ids, idx, _ = src_splits.pairs("public", "train")
    public = feats(src_ds.batch(ids, idx)) if ids.size else np.zeros((0, clients[0].shape[1]))
    net = verifier_net(xi.config.resolved(), with_head=False).eval()
    w = backbone_weights(xi.state_dict())
    top = top_verifier(net).eval()
    names = set(top.state_dict())
    from device_sim.methods.client_stats import FederationStats  # noqa: F401  (the same sum below)
    from fedfs_sdk.stats import embedding_moments, sum_contributions
    from torch.func import functional_call
    with torch.no_grad():
        embs = [functional_call(top, {k: v for k, v in w.items() if k in names},
                                (torch.from_numpy(f).float(),))[0].double().numpy() for f in clients]
    total = sum_contributions({EMBEDDING: embedding_moments(e)} for e in embs)
    fold = norm_fold_from_sum(total.sums[EMBEDDING], "standardize")
    na = fold_standardization(w, torch.from_numpy(fold[0]).float(), torch.from_numpy(fold[1]).float())
    out = {"clients": clients, "new_users": new_users, "public": public, "public_ids": ids,
           "tops": {"xi": {k: v for k, v in w.items() if k in names}, "norm-adapt": {k: v for k, v in na.items() if k in names}},
           "top": top, "plan": splits.meta.get("plan")}
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def evaluate(d: dict, cands: list[str], limit: int | None = None) -> dict:
    """``{(cand, model, far, set): [measured FAR per device]}`` (module docstring)."""
    from torch.func import functional_call

    from fedfs_sdk.stats import (calibrated_threshold, draw_location_scale, feature_moments, gaussian_factor,
                                 moments_of, public_directions, standard_draws, sum_contributions, tail_histogram, tail_z)

    top, tops = d["top"], d["tops"]

    def emb(cand: str, f: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            e = functional_call(top, tops[cand], (torch.from_numpy(np.asarray(f, dtype=np.float32)),))[0]
        return _unit(e.double().numpy())

    feats, newf = d["clients"], [f for f in d["new_users"] if f.shape[0]]
    clients = [c for c in range(len(feats)) if feats[c].shape[0] >= 2][:limit]
    total = sum_contributions({"f": feature_moments(feats[c])} for c in range(len(feats)) if feats[c].shape[0]).sums["f"]
    units = {cand: [emb(cand, f) for f in feats] for cand in cands}
    new_units = {cand: np.concatenate([emb(cand, f) for f in newf]) for cand in cands}
    pub = {cand: emb(cand, d["public"]) for cand in cands}
    pids = np.asarray(d["public_ids"])
    # public directions: the public people's templates as shipped, and moved into the federation's
    # conditions with the published feature moments (a mean shift; CORAL: mean and covariance)
    mu_f, cov_f, _ = moments_of(total)
    pf = np.asarray(d["public"], dtype=np.float64)
    mu_p, cov_p = pf.mean(0), np.cov(pf.T, bias=True)
    coral = _sqrtm(cov_f, 0.5) @ _sqrtm(cov_p, -0.5)
    moved = {"": pf, "/shift": pf - mu_p + mu_f, "/coral": (pf - mu_p) @ coral.T + mu_f}
    dirs = {(cand, v): public_directions(emb(cand, f), pids) for cand in cands for v, f in moved.items()}
    hist = {k: [tail_histogram(u, t) for u in units[k[0]]] for k, t in dirs.items()}
    hist_total = {k: np.sum(h, axis=0) for k, h in hist.items()}
    # the public set's own tail shape: each person's template vs the other people's photos
    pub_z = {}
    for cand in cands:
        zs = []
        for pp in [q for q in np.unique(pids) if (pids == q).sum() >= 2]:
            s = pub[cand][pids != pp] @ _unit(pub[cand][pids == pp].sum(0))
            zs.append((s - s.mean()) / s.std())
        zs = np.concatenate(zs)
        pub_z[cand] = {far: float(np.quantile(zs, 1 - far)) for far in FARS}
    z = standard_draws(feats[0].shape[1], DRAWS, 0).astype(np.float64)
    chi = {nu: np.sqrt(np.random.default_rng(1).chisquare(nu, size=(DRAWS, 1)) / nu) for nu in (5, 10)}
    res: dict[tuple, list[float]] = {}
    for i, c in enumerate(clients):
        mu, cov, _ = moments_of(total - feature_moments(feats[c]))
        g = z @ gaussian_factor(cov)
        others = {cand: np.concatenate([units[cand][o] for o in range(len(feats)) if o != c and feats[o].shape[0]])
                  for cand in cands}
        draws = {cand: emb(cand, mu + g) for cand in cands}
        zstar = {}
        for k, t in dirs.items():
            loc, sc = draw_location_scale(draws[k[0]], t)
            zstar[k] = {far: tail_z(hist_total[k] - hist[k][c], loc, sc, far) for far in FARS}
        for cand in cands:
            u = _unit(units[cand][c].sum(0))
            real = {"other clients": others[cand] @ u, "new users": new_units[cand] @ u}
            gs = draws[cand] @ u
            models = {"gauss": gs}
            for nu, s in chi.items():
                models[f"t{nu}"] = emb(cand, mu + g / s) @ u
            taus = {}
            for far in FARS:
                for name, s in models.items():
                    taus[(name, far)] = float(np.sort(s)[::-1][int(far * s.size)])
                oth = others[cand]
                m_e, c_e = oth.mean(0), np.cov(oth.T, bias=True)
                taus[("normal-score", far)] = float(u @ m_e + norm.isf(far) * np.sqrt(u @ c_e @ u))
                taus[("public-tail", far)] = calibrated_threshold(gs, pub_z[cand][far])
                for v in moved:
                    taus[(f"fed-tail{v}", far)] = calibrated_threshold(gs, zstar[(cand, v)][far])
                    if cand != "xi" and ("xi", v) in zstar:
                        taus[(f"fed-tail{v}(ξ)", far)] = calibrated_threshold(gs, zstar[("xi", v)][far])
            for (name, far), tau in taus.items():
                for set_name, s in real.items():
                    res.setdefault((cand, name, far, set_name), []).append(float((s > tau).mean()))
        if (i + 1) % 20 == 0:
            print(f"  {i + 1}/{len(clients)} devices", file=sys.stderr, flush=True)
    return res


class LookupBackend:
    """An inference backend over embeddings computed once (``photo i`` is a tiny array holding ``i``),
    so :func:`fedfs_sdk.runtime.enrollment.enroll` runs unchanged (as benchmarks/enroll_far.py)."""

    outputs = ("embedding",)
    input_size = 4

    def __init__(self, emb: np.ndarray, model_id: str) -> None:
        self.emb, self.model_id = np.asarray(emb, np.float32), model_id

    def photos(self, n: int) -> np.ndarray:
        x = np.zeros((n, 3, 4, 4), np.float32)
        x[:, 0, 0, 0] = np.arange(n)
        return x

    def run(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return {"embedding": self.emb[x[:, 0, 0, 0].astype(np.int64)]}


def enroll_far(d: dict, cands: list[str], q: float, limit: int | None = None, tail: str = "self") -> dict:
    """``enroll(far=…)`` itself, per device, from a published statistics sum (``xi.features`` and
    ``xi.tail`` under ξ, :mod:`fedfs_sdk.stats.evidence`; the device's own contribution subtracted),
    the shipped public set of 40 people too small for 1e-3: ``{(cand, far, set): [FAR]}`` measured at
    the enrolled τ on the other clients' photos and the new users'; refusals counted under
    ``(cand, far, "refused")``. ``tail``: the histograms under the enrolled verifier itself
    (``self``: a model every device can run) or under ξ (``xi``: what a personalized top would get)."""
    from torch.func import functional_call

    from fedfs_sdk.errors import OperatingPointError
    from fedfs_sdk.runtime.enrollment import enroll
    from fedfs_sdk.stats import TAIL, feature_moments, impostor_features, moments_of, sum_contributions, tail_histogram
    from fedfs_sdk.stats.evidence import FEATURES, in_domain_evidence, tail_directions

    top, tops = d["top"], d["tops"]

    def emb(cand: str, f: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return functional_call(top, tops[cand], (torch.from_numpy(np.asarray(f, dtype=np.float32)),))[0].double().numpy()

    feats = d["clients"]
    newf = np.concatenate([f for f in d["new_users"] if f.shape[0]])
    total = sum_contributions({FEATURES: feature_moments(f)} for f in feats if f.shape[0]).sums[FEATURES]
    stats, dirs = {}, {}
    for tc in {("xi" if tail == "xi" else c) for c in cands}:
        dirs[tc] = tail_directions(d["public"], d["public_ids"], lambda f: emb(tc, f), total)
        stats[tc] = sum_contributions({FEATURES: feature_moments(f), TAIL: tail_histogram(emb(tc, f), dirs[tc])}
                                      for f in feats if f.shape[0])
    units = {c: [_unit(emb(c, f)) for f in feats] for c in cands}
    new_units = {c: _unit(emb(c, newf)) for c in cands}
    res: dict[tuple, list[float]] = {}
    clients = [c for c in range(len(feats)) if feats[c].shape[0] >= 2][:limit]
    for i, c in enumerate(clients):
        mu, cov, _ = moments_of(total - feature_moments(feats[c]))
        drawn = impostor_features(mu, cov)              # once per device: every verifier's τ uses the same draws
        for cand in cands:
            tc = "xi" if tail == "xi" else cand
            ev = in_domain_evidence(stats[tc], lambda f: {"embedding": emb(cand, f)}, lambda f: emb(tc, f), d["public"],
                                    d["public_ids"], own_features=feats[c], directions=dirs[tc], features=drawn)
            be = LookupBackend(units[cand][c], f"{cand}")
            others = np.concatenate([units[cand][o] for o in range(len(feats)) if o != c and feats[o].shape[0]])
            for far in FARS:
                try:
                    e = enroll(be, be.photos(feats[c].shape[0]), q=q, far=far, in_domain=ev)
                except OperatingPointError:
                    res.setdefault((cand, far, "refused"), []).append(1.0)
                    continue
                assert e.meta["operating_point"]["far_evidence"] == "federation-statistics"
                t = e.template.astype(np.float64)
                for set_name, u in (("other clients", others), ("new users", new_units[cand])):
                    res.setdefault((cand, far, set_name), []).append(float((u @ t >= e.threshold).mean()))
        if (i + 1) % 20 == 0:
            print(f"  {i + 1}/{len(clients)} devices enrolled", file=sys.stderr, flush=True)
            print(f"after {i + 1} devices:\n{enroll_table(res)}", file=sys.stderr, flush=True)
    return res


def enroll_table(res: dict) -> str:
    lines = ["| verifier | target FAR | impostors (devices) | mean measured | median | mean× | median× | > 2× target |",
             "|---|---|---|---|---|---|---|---|"]
    for (cand, far, st), v in sorted(res.items(), key=lambda kv: (kv[0][0] != "xi", kv[0][0], kv[0][1], kv[0][2])):
        if st == "refused":
            lines.append(f"| {cand} | {far:g} | refused (q) | {len(v)} devices | | | | |")
            continue
        a = np.asarray(v)
        lines.append(f"| {cand} | {far:g} | {st} ({a.size}) | {a.mean():.4f} | {np.median(a):.4f} | {a.mean() / far:.2f} | "
                     f"{np.median(a) / far:.2f} | {np.mean(a > 2 * far):.0%} |")
    return "\n".join(lines)


def table(res: dict) -> str:
    """One row per candidate, impostor set and model; per target FAR: mean measured FAR over devices,
    mean and median of measured/target, share of devices above 2× target."""
    order = ["gauss", "t10", "t5", "normal-score", "public-tail"] + [f"fed-tail{v}{x}" for v in ("", "/shift", "/coral")
                                                                        for x in ("", "(ξ)")]
    head = " | ".join(f"{f:g}: mean FAR · mean× · median× · >2×" for f in FARS)
    lines = [f"| candidate | impostors | model | {head} |", "|---|---|---|" + "---|" * len(FARS)]
    rows = sorted({(c, st, m) for c, m, _, st in res}, key=lambda r: (r[0] != "xi", r[0], r[1] != "other clients",
                                                                        order.index(r[2])))
    for c, st, m in rows:
        cells = []
        for f in FARS:
            v = np.asarray(res[(c, m, f, st)])
            cells.append(f"{v.mean():.4f} · {v.mean() / f:.2f} · {np.median(v) / f:.2f} · {np.mean(v > 2 * f):.0%}")
        lines.append(f"| {c} | {st} ({v.size}) | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    p.add_argument("--cache", type=Path, default=Path("/tmp/fartail"))
    p.add_argument("--candidates", default="xi,norm-adapt")
    p.add_argument("--limit", type=int, default=None, help="first N devices only (a quick look)")
    p.add_argument("--enroll", action="store_true", help="run enroll(far=…) itself from a statistics sum (the "
                   "chosen estimator, ξ's tail for every verifier) instead of the comparison")
    p.add_argument("--q", type=float, default=0.5, help="with --enroll: the warm-up TPR the enrollment must keep")
    p.add_argument("--tail", choices=("self", "xi"), default="self", help="with --enroll: the tail histograms under "
                   "the enrolled verifier itself (default) or under ξ")
    a, sim = p.parse_known_args(argv)
    torch.set_num_threads(1)
    d = load_features(sim, a.cache)
    if d.get("plan"):
        print("split:", "; ".join(map(str, d["plan"]))[:400])
    print(f"{len(d['clients'])} clients, {len(d['new_users'])} new users, {len(d['public'])} public photos of "
          f"{np.unique(d['public_ids']).size} people")
    if a.enroll:
        res = enroll_far(d, a.candidates.split(","), a.q, a.limit, a.tail)
        print(f"enroll(far=…, in_domain=…) per device (warm-up: its training photos, q = {a.q:g}; tail histograms under "
              f"{'each verifier itself' if a.tail == 'self' else 'ξ'}); FAR measured at the "
              "enrolled τ on the other clients' real photos and on the new users' (held out)")
        print(enroll_table(res))
        return 0
    res = evaluate(d, a.candidates.split(","), a.limit)
    print("measured FAR at each model's τ for the target: other clients' real photos (in the statistics) and new "
          "users' (held out); per device")
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
