"""Where a run's frozen model ξ comes from: a built-in model, a ``--pretrained`` checkpoint
(checked against the split: never trained on a client), or pre-training here on the public
identities (CosFace / ArcFace margin loss, cached)."""
from __future__ import annotations

from typing import Any

import numpy as np

from fedfs_sdk.cli.progress import progress_bar
from fedfs_sdk.errors import CheckpointError, InputError
from fedfs_sdk.nn.builtin_models import builtin_name, load_builtin

from .datasets import IdentityDataset
from .experiment import ExperimentConfig
from .experiment_data import build_pretrain_data
from .experiment_resolve import DEFAULT_BACKBONE
from .pretrain import PretrainConfig, load_xi, pretrain_cached
from .splits import FaceSplits


def pretrain_config(cfg: ExperimentConfig) -> PretrainConfig:
    """ξ's pre-training settings (seeded by ``--split-seed``, like the split it trains on)."""
    x = cfg.xi
    margin = x.margin if x.margin is not None else (0.2 if x.margin_loss == "cosface" else 0.5)
    return PretrainConfig(backbone=x.backbone or DEFAULT_BACKBONE, width=x.width, embedding_dim=x.embedding_dim,
                          loss=x.margin_loss, scale=x.scale, margin=margin, epochs=x.pretrain_epochs,
                          optimizer=x.pretrain_optimizer, batch_size=x.pretrain_batch_size, lr=x.pretrain_lr,
                          seed=cfg.data.split_seed)


def run_pretrain(cfg: ExperimentConfig, ds: IdentityDataset, splits: FaceSplits, out: str | None = None,
                 force: bool = False, quiet: bool = False):
    """Pre-train ξ on the split's public identities (cached) with a progress bar."""
    ids, idx, labels = splits.pairs("public", "train")
    if ids.size == 0:
        raise InputError("no public identities to pre-train ξ on: set --public N (≥ 2), or --pretrain-data "
                         "synth|PATH, or --pretrained CKPT")
    with progress_bar("pre-training ξ", unit="step", disable=quiet) as bar:
        def cb(step: int, total: int, m: dict[str, float]) -> None:
            bar.total = total
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.2f}")
        res = pretrain_cached(ds, ids, idx, labels, pretrain_config(cfg), device=cfg.runtime.device,
                              cache_dir=cfg.xi.cache_dir, out=out, force=force, progress=cb)
    return res


def check_xi_disjoint(xi_meta: dict[str, Any], splits: FaceSplits, dataset: IdentityDataset) -> None:
    """Refuse a ξ pre-trained on identities that are clients or new users here.

    Compares identity *names* (``public_identity_names`` in ξ's metadata against the folder
    names / ``synthfaces-<seed>/<index>`` of this split's clients and new users), so a
    folder added or removed since pre-training — which shifts every position — neither
    hides an overlap nor invents one. A ξ written before names were recorded has only the
    positions (``public_identities``): those are compared as before, which is exact for
    SynthFaces and for an unchanged folder (re-running ``fedfs pretrain`` records names).
    A ξ with neither (not from ``fedfs pretrain``) is not checked.
    """
    users = np.r_[splits.identities("clients"), splits.identities("new_users")]
    names = xi_meta.get("public_identity_names")
    if names is not None:
        overlap = sorted(set(map(str, names)) & set(dataset.identity_names(users)))
        if overlap:
            raise CheckpointError(f"ξ was pre-trained on {len(overlap)} identities that are clients/new users in "
                                  f"this split (e.g. {overlap[:3]}); pre-train on this split's public identities")
        return
    public = xi_meta.get("public_identities")
    if public is None:
        return
    overlap_pos = np.intersect1d(np.asarray(public), users)
    if overlap_pos.size:
        raise CheckpointError(f"ξ was pre-trained on {overlap_pos.size} identities that are clients/new users in "
                              f"this split (dataset positions, e.g. {overlap_pos[:3].tolist()}; this ξ predates "
                              f"identity names); pre-train on this split's public identities")


def resolve_xi(cfg: ExperimentConfig, ds: IdentityDataset, splits: FaceSplits, quiet: bool = False):
    """ξ from ``--pretrained`` or pre-trained (cached) on the public identities of
    :func:`~device_sim.experiment_data.build_pretrain_data` (``--pretrain-data``, ``--pretrain-domain``)."""
    pretrained = cfg.xi.pretrained
    name = builtin_name(pretrained)
    if name is not None:
        xi, meta = load_builtin(name)
        return xi.requires_grad_(False), {"path": f"builtin:{name}", "builtin": name, "cached": True, "stats": {},
                                          "model_id": meta["model_id"], "source_sha256": meta["source_sha256"]}
    if pretrained:
        from fedfs_sdk.nn.checkpoint import read_checkpoint
        _, _, meta = read_checkpoint(pretrained)
        check_xi_disjoint(meta, splits, ds)
        xi = load_xi(pretrained)
        if xi.input_size != ds.image_size:
            raise InputError(f"ξ expects {xi.input_size}px inputs but --image-size is {ds.image_size}")
        return xi, {"path": str(pretrained), "cached": True, "stats": meta.get("stats", {})}
    src_ds, src_splits = build_pretrain_data(cfg, ds, splits)
    res = run_pretrain(cfg, src_ds, src_splits, quiet=quiet)
    info = {"path": str(res.path), "cached": res.cached, "stats": res.stats}
    if src_ds is not ds and src_splits.meta.get("skipped"):
        info["skipped"] = src_splits.meta["skipped"]      # what ξ's own folder left out
    return res.model, info


__all__ = ["pretrain_config", "run_pretrain", "check_xi_disjoint", "resolve_xi"]
