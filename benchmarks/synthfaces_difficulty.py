"""How hard is SynthFaces? Verification AUROC of simple baselines on identities never seen in training.

Protocol (the per-client verification of docs/evaluation.md): each new identity enrolls a
template from ``--enroll`` images (L2-normalized mean embedding) and is probed with
``--probes`` of its own held-out images (genuine) and the held-out images of every other
new identity (impostors); the per-identity AUROC is averaged, and the pooled AUROC and
TAR@FAR are reported too.

Baselines:
* ``pixels``: the centred, L2-normalized pixel vector of a 32×32 image;
* ``random-cnn``: the ``tiny`` fedfs backbone with random weights;
* ``cosface-cnn``: the same backbone trained with a CosFace margin loss on
  ``--public`` identities × ``--per-public`` images for ``--epochs`` epochs (a small stand-in
  for the pre-trained ξ), evaluated on new identities and, for reference, on held-out
  images of its own training identities (closed set: how much better the model is on faces
  it has learned — the headroom personalization can claim).

Usage: PYTHONPATH=. python benchmarks/synthfaces_difficulty.py [--difficulty 0 0.5 1 1.5]
Prints one table row per (difficulty, baseline).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from device_sim.metrics import per_client_verification, template_scores
from device_sim.synthfaces import SynthFaces
from fedfs_sdk.nn.backbones import get_backbone


def evaluate(emb: np.ndarray, n_id: int, n_enroll: int, n_probe: int) -> dict:
    """``emb`` rows ordered identity-major, ``n_enroll + n_probe`` per identity."""
    per = n_enroll + n_probe
    e = emb.reshape(n_id, per, -1)
    probes = e[:, n_enroll:].reshape(n_id * n_probe, -1)
    owner = np.repeat(np.arange(n_id), n_probe)
    pairs = []
    for c in range(n_id):
        s = template_scores(e[c, :n_enroll], probes)
        pairs.append((s[owner == c], s[owner != c]))
    r = per_client_verification(pairs)
    return {"auroc_mean": r["auroc"]["mean"], "auroc_pooled": r["pooled"]["auroc"],
            "tar@1e-2": r["tar_at_far"][0.01]["mean"], "eer": r["eer"]["mean"]}


def embed(model: torch.nn.Module, x: torch.Tensor, bs: int = 512) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return torch.cat([model(x[i:i + bs]) for i in range(0, len(x), bs)]).numpy()


def train_cosface(x: torch.Tensor, y: torch.Tensor, n_cls: int, epochs: int, seed: int,
                  s: float = 16.0, m: float = 0.25) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = get_backbone("tiny", input_size=x.shape[-1])
    w = torch.nn.Parameter(torch.randn(n_cls, model.embedding_dim) * 0.01)
    opt = torch.optim.SGD(list(model.parameters()) + [w], lr=0.1, momentum=0.9, weight_decay=5e-4)
    steps = epochs * ((len(x) + 127) // 128)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=steps)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), 128):
            b = perm[i:i + 128]
            xb = x[b]
            if torch.rand(1, generator=g).item() < 0.5:   # horizontal flip augmentation
                xb = xb.flip(3)
            cos = F.normalize(model(xb)) @ F.normalize(w).T
            logits = s * (cos - m * F.one_hot(y[b], n_cls))
            loss = F.cross_entropy(logits, y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--difficulty", type=float, nargs="+", default=[0.0, 0.5, 1.0, 1.5])
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--public", type=int, default=300)
    ap.add_argument("--per-public", type=int, default=24)
    ap.add_argument("--new", type=int, default=100)
    ap.add_argument("--enroll", type=int, default=10)
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    print(f"| difficulty | baseline | AUROC per-id mean | AUROC pooled | TAR@FAR=1e-2 | EER | seconds |")
    print("|---|---|---|---|---|---|---|")
    per = a.enroll + a.probes
    for d in a.difficulty:
        faces = SynthFaces(seed=a.seed, image_size=a.size, difficulty=d)
        new_ids = np.repeat(np.arange(100_000, 100_000 + a.new), per)
        new_idx = np.tile(np.arange(per), a.new)
        xn = faces.render(new_ids, new_idx)

        t = time.time()
        px = xn.reshape(len(xn), -1).numpy().astype(np.float64)
        px -= px.mean(1, keepdims=True)
        r = evaluate(px, a.new, a.enroll, a.probes)
        print(f"| {d} | pixels | {r['auroc_mean']:.4f} | {r['auroc_pooled']:.4f} | {r['tar@1e-2']:.4f} | {r['eer']:.4f} | {time.time() - t:.1f} |", flush=True)

        t = time.time()
        torch.manual_seed(a.seed)
        rnd = get_backbone("tiny", input_size=a.size)
        r = evaluate(embed(rnd, xn), a.new, a.enroll, a.probes)
        print(f"| {d} | random-cnn | {r['auroc_mean']:.4f} | {r['auroc_pooled']:.4f} | {r['tar@1e-2']:.4f} | {r['eer']:.4f} | {time.time() - t:.1f} |", flush=True)

        t = time.time()
        pub_ids = np.repeat(np.arange(a.public), a.per_public + per)
        pub_idx = np.tile(np.arange(a.per_public + per), a.public)
        xp = faces.render(pub_ids, pub_idx).view(a.public, a.per_public + per, 3, a.size, a.size)
        xtr = xp[:, :a.per_public].reshape(-1, 3, a.size, a.size)
        ytr = torch.arange(a.public).repeat_interleave(a.per_public)
        model = train_cosface(xtr, ytr, a.public, a.epochs, a.seed)
        r = evaluate(embed(model, xn), a.new, a.enroll, a.probes)
        # closed set: held-out images of the first `new` training identities
        xc = xp[:a.new, a.per_public:].reshape(-1, 3, a.size, a.size)
        rc = evaluate(embed(model, xc), a.new, a.enroll, a.probes)
        dt = time.time() - t
        print(f"| {d} | cosface-cnn, new ids | {r['auroc_mean']:.4f} | {r['auroc_pooled']:.4f} | {r['tar@1e-2']:.4f} | {r['eer']:.4f} | {dt:.1f} |")
        print(f"| {d} | cosface-cnn, training ids (held-out images) | {rc['auroc_mean']:.4f} | {rc['auroc_pooled']:.4f} | {rc['tar@1e-2']:.4f} | {rc['eer']:.4f} | |", flush=True)


if __name__ == "__main__":
    main()
