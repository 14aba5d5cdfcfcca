"""``fedfs pretrain``: pre-train the frozen model ξ on public identities (CosFace margin).

Example::

    fedfs pretrain --data synth --public 300 --out xi.safetensors
    fedfs pretrain --data /data/faces --image-size 112 --backbone mobilefacenet --out xi.safetensors
    fedfs pretrain --data /data/faces --pretrain-data /data/public_faces --out xi.safetensors

The split is the same one ``fedfs simulate`` draws from the same data arguments, so the
public identities never include a client or new user (``simulate`` checks): for a folder,
25 % of its identities are held out as public ones (:mod:`device_sim.folder_split`) and ξ
is evaluated on the clients' test images. With ``--pretrain-data`` every identity of that
source is public (as ``fedfs simulate --pretrain-data`` uses it) and ``--data`` only
supplies the new identities ξ is evaluated on. Training is cached by config + data
(``--cache-dir``); ``--force`` retrains.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from .cli_common import add_data_arguments, add_device_argument, add_pretrain_arguments, setup_device, skipped_lines
from .experiment_data import build_data, build_pretrain_data
from .experiment_resolve import experiment_from_args
from .metrics import verification_metrics
from .pretrain import embed_images
from .xi_source import run_pretrain


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="xi.safetensors", help="where to write the ξ checkpoint")
    p.add_argument("--force", action="store_true", help="retrain even if the cache has this config")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    add_device_argument(p)
    add_data_arguments(p)
    add_pretrain_arguments(p)


@torch.no_grad()
def new_identity_auroc(xi, ds, splits, max_images: int = 2000) -> dict[str, float] | None:
    """Pairwise verification of ξ on the client identities (never seen in pre-training):
    genuine = same-identity test pairs, impostor = different-identity pairs."""
    ids, idx, owner = splits.pairs("clients", "test")
    if ids.size < 2:
        return None
    ids, idx, owner = ids[:max_images], idx[:max_images], owner[:max_images]
    e = embed_images(xi, ds, ids, idx)        # memory-sized batches (one 2000-image forward took 6 GB)
    e = e / e.norm(dim=1, keepdim=True).clamp_min(1e-12)
    s = (e @ e.t()).numpy()
    iu = np.triu_indices(owner.size, 1)
    same = (owner[:, None] == owner[None, :])[iu]
    if not same.any() or same.all():
        return None
    m = verification_metrics(s[iu][same], s[iu][~same])
    return {"auroc": m["auroc"], "eer": m["eer"], "tar_at_far_1e-2": m["tar_at_far"][0.01]}


def run(args: argparse.Namespace) -> int:
    cfg = experiment_from_args(args, real_face_default=False)    # pre-training ξ is the point here
    setup_device(cfg.runtime)
    t0 = time.perf_counter()
    ds, splits = build_data(cfg)
    src_ds, src_splits = build_pretrain_data(cfg, ds, splits)
    for line in splits.meta.get("plan", []) + skipped_lines(splits.meta.get("skipped") or {}) + (
            skipped_lines(src_splits.meta.get("skipped") or {}, where=f"--pretrain-data {cfg.data.pretrain_data}")
            if src_splits is not splits else []):
        print(line)
    res = run_pretrain(cfg, src_ds, src_splits, out=args.out, force=args.force, quiet=args.quiet)
    st = res.stats
    print(f"ξ: {res.model.config.backbone} on {st.get('num_classes')} public identities, {st.get('num_images')} images, "
          f"{st.get('steps')} steps{' (from cache)' if res.cached else ''}: "
          f"final loss {st.get('final_loss', float('nan')):.3f}, train acc {st.get('final_train_acc', float('nan')):.3f}")
    ev = new_identity_auroc(res.model, ds, splits)
    if ev is not None:
        print(f"ξ on {splits.num_clients} new identities (pairwise, test images): AUROC {ev['auroc']:.4f}, "
              f"EER {ev['eer']:.4f}, TAR@FAR=1e-2 {ev['tar_at_far_1e-2']:.4f}")
    print(f"wrote {res.path} ({time.perf_counter() - t0:.0f} s)")
    return 0


__all__ = ["add_arguments", "run", "new_identity_auroc"]
