"""A verifier evaluated as its top on ξ's trunk features (``scope="top"``): the simulator's split
of a verifier spec, and the top alone applied to trunk features the do-no-harm check draws or holds
(:mod:`.selection`)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from fedfs_sdk.errors import InputError
from fedfs_sdk.stats.in_domain import top_verifier

from .base import VerifierSpec


def split_spec(spec: VerifierSpec, xi: torch.nn.Module) -> VerifierSpec:
    """``spec`` evaluated as its top on ξ's cached trunk features (:mod:`device_sim.trunk_cache`)
    — a pure speed-up, valid when the spec's trunk *is* ξ's (ξ itself, norm-adapt, any
    ``scope="top"`` model). Specs of a backbone that cannot be split are returned as they are."""
    from fedfs_sdk.training.scope import check_splittable

    from ..trunk_cache import trunk_cache

    if spec.trunk is not None:
        return spec
    backbone = getattr(xi, "backbone", xi)
    try:
        check_splittable(backbone)
        top = _TOPS.get(id(spec.net))
        if top is None:
            top = _TOPS[id(spec.net)] = (spec.net, top_verifier(spec.net))
        return replace(spec, trunk=trunk_cache(backbone), top=top[1])
    except InputError:
        return spec


_TOPS: dict[int, tuple] = {}      # verifier skeleton id → (skeleton kept alive, its top)


@torch.no_grad()
def top_embed(spec: VerifierSpec, features: torch.Tensor, dev: torch.device, batch: int = 2048) -> np.ndarray:
    """A split verifier's ``embedding`` output on trunk ``features`` (its top only)."""
    from torch.func import functional_call

    if spec.top is None:
        raise InputError("check=in-domain scores drawn trunk features: it needs scope=top verifiers")
    names = set(spec.top.state_dict())
    w = {k: v.to(dev) for k, v in spec.weights.items() if k in names}
    top = spec.top.to(dev).eval()
    outs = [functional_call(top, w, (features[a:a + batch].to(dev),))[0].double().cpu()
            for a in range(0, features.shape[0], batch)]
    return torch.cat(outs).numpy()


def fingerprint(spec: VerifierSpec) -> tuple:
    """What a split spec's embedding output depends on: its top's layers and the tensors of its
    weights (by identity and version: ξ's own parameters are the same tensors in every method)."""
    if spec.top is None:        # never equal to another spec's (the check refuses unsplit specs anyway)
        return ("unsplit", object())
    names = sorted(spec.top.state_dict())
    return (repr(spec.top), tuple((k, spec.weights[k].data_ptr(), spec.weights[k]._version,
                                   tuple(spec.weights[k].shape)) for k in names if k in spec.weights))


__all__ = ["split_spec", "top_embed", "fingerprint"]
