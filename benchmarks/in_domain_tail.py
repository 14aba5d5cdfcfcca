"""Which impostor model predicts in-domain FAR best (issue 29, item 2)? ξ and norm-adapt ξ only (no
training: minutes, not the half hour of a full run).

For every client of a ``fedfs simulate`` split (same flags), its template (ξ's, and norm-adapt ξ's
from the summed embedding moments) is scored against (a) draws of the candidate impostor models built
from the *other* clients' summed statistics and (b) the other clients' real photos. Models:

* ``gauss-trunk`` — the default: trunk features ``f ~ N(μ, C)`` through the candidate's top
  (:mod:`fedfs_sdk.stats.impostor_model`);
* ``t{ν}-trunk`` — the same covariance, Student-t radial scale (heavier tails), ``ν`` = 5, 10;
* ``normal-score`` — the score itself normal with mean ``uᵀμ_e`` and variance ``uᵀΣ_e u`` from the
  moments of the others' unit embeddings (needs D×D moments *per candidate*).

Prints, per model and target FAR, the mean / median measured FAR at the predicted threshold over
clients, and the mean |log10(measured/target)|.

    python benchmarks/in_domain_tail.py --data lfw-112 --pretrained xi.safetensors --image-size 112 \
        --backbone mobilefacenet-affine --scenario real-night --seed 0 --split-seed 0 --threads 1
"""
from __future__ import annotations

import sys
import numpy as np
import torch
from scipy.stats import norm


def main(argv: list[str] | None = None) -> int:
    from device_sim.cli_simulate import experiment_from_argv
    from device_sim.experiment_data import build_data
    from device_sim.methods.base import backbone_weights, verifier_net
    from device_sim.methods.client_stats import EMBEDDING, FEATURES, client_statistics
    from device_sim.methods.reference import fold_standardization
    from device_sim.methods.selection import top_verifier
    from device_sim.population import Population
    from device_sim.trunk_cache import trunk_cache
    from device_sim.xi_source import resolve_xi
    from fedfs_sdk.stats import feature_moments, gaussian_factor, moments_of, norm_fold_from_sum, standard_draws
    from torch.func import functional_call

    cfg = experiment_from_argv(list(sys.argv[1:] if argv is None else argv) + ["--out", "/tmp/in_domain_tail"])
    torch.set_num_threads(1)
    ds, splits = build_data(cfg)
    pop = Population(ds, splits)
    xi, _ = resolve_xi(cfg, ds, splits, quiet=True)
    xi = xi.eval()
    net = verifier_net(xi.config.resolved(), with_head=False).eval()
    w = backbone_weights(xi.state_dict())
    top = top_verifier(net).eval()
    stats = client_statistics(net, w, pop, range(pop.num_clients), trunk=trunk_cache(xi.backbone), top=top)
    fold = norm_fold_from_sum(stats.total.sums[EMBEDDING], "standardize")
    na = fold_standardization(w, torch.from_numpy(fold[0]).float(), torch.from_numpy(fold[1]).float())
    names = set(top.state_dict())
    tops = {"xi": {k: v for k, v in w.items() if k in names}, "norm-adapt": {k: v for k, v in na.items() if k in names}}

    def emb(cand: str, f: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            e = functional_call(top, tops[cand], (torch.from_numpy(np.asarray(f, dtype=np.float32)),))[0].double().numpy()
        return e / np.linalg.norm(e, axis=1, keepdims=True)

    clients = sorted(stats.features)
    feats = stats.features
    units = {c: {cand: emb(cand, feats[c]) for cand in tops} for c in clients}
    fars = (1e-3, 1e-2)
    z = standard_draws(feats[clients[0]].shape[1], 8192, 0).astype(np.float64)
    chi = {nu: np.sqrt(np.random.default_rng(1).chisquare(nu, size=(8192, 1)) / nu) for nu in (5, 10)}
    res: dict[tuple[str, str, float], list[float]] = {}
    for c in clients:
        mu, cov, _ = moments_of(stats.total.sums[FEATURES] - feature_moments(feats[c]))
        L = gaussian_factor(cov)
        g = z @ L
        others = np.concatenate([feats[o] for o in clients if o != c])
        for cand in tops:
            u = units[c][cand].sum(0)
            u /= np.linalg.norm(u)
            real = emb(cand, others) @ u
            models = {"gauss-trunk": emb(cand, mu + g) @ u}
            for nu, s in chi.items():
                models[f"t{nu}-trunk"] = emb(cand, mu + g / s) @ u
            oth_e = np.concatenate([units[o][cand] for o in clients if o != c])
            m_e, c_e = oth_e.mean(0), np.cov(oth_e.T, bias=True)
            mean_s, sd_s = float(u @ m_e), float(np.sqrt(u @ c_e @ u))
            for far in fars:
                for name, s in models.items():
                    tau = np.sort(s)[::-1][int(far * s.size)]
                    res.setdefault((cand, name, far), []).append(float((real > tau).mean()))
                tau = mean_s + norm.isf(far) * sd_s
                res.setdefault((cand, "normal-score", far), []).append(float((real > tau).mean()))
    print(f"{len(clients)} clients; measured FAR on the other clients' real photos at each model's predicted τ")
    print("| candidate | model | target FAR | mean measured | median | mean abs log10(measured/target) |")
    print("|---|---|---|---|---|---|")
    for (cand, name, far), v in sorted(res.items()):
        a = np.asarray(v)
        err = np.mean(np.abs(np.log10(np.maximum(a, 1e-4) / far)))
        print(f"| {cand} | {name} | {far:g} | {a.mean():.4f} | {np.median(a):.4f} | {err:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
