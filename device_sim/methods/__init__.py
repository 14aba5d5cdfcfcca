"""Federated methods of the simulator and a registry that parses CLI specs.

A spec is ``name`` or ``name:key=value,key=value``, e.g. ``fedfs``,
``feduv:c=511``, ``feduv:c=255,neg=early,neg_rounds=5``, ``fedfs+feduv:c=127``.
A new method plugs in with :func:`register` — the round loop does not change.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from fedfs_sdk.errors import InputError

from .base import (ClientState, FederatedMethod, Params, RoundPlan, SimContext, VerifierSpec, Weights,
                   backbone_weights, verifier_net)
from .sdk_methods import FedFSMethod, FedFSUVMethod, FedUVMethod, PretrainedOnly, SDKMethod

REGISTRY: dict[str, Callable[..., FederatedMethod]] = {
    "pretrained": PretrainedOnly,
    "fedfs": FedFSMethod,
    "feduv": FedUVMethod,
    "fedfs+feduv": FedFSUVMethod,
}

ALIASES = {"c": "code_length"}


def register(name: str, factory: Callable[..., FederatedMethod]) -> None:
    """Make ``name`` available to :func:`parse_method` and the CLI."""
    if name in REGISTRY:
        raise InputError(f"method {name!r} is already registered")
    REGISTRY[name] = factory


# ---- the papers' baselines (device_sim.methods.baselines, docs/baselines.md) ---------------
from .baselines import BASELINES  # noqa: E402  (after register(), which it uses)

for _name, _factory in BASELINES.items():
    register(_name, _factory)

# ---- honest personalization references (device_sim.methods.reference, docs/personalization.md)
from .reference import REFERENCE_METHODS  # noqa: E402

for _name, _factory in REFERENCE_METHODS.items():
    register(_name, _factory)


def _value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_method(spec: str) -> FederatedMethod:
    """Build a method from ``name[:key=value,...]`` (see module docstring)."""
    name, _, opts = spec.strip().partition(":")
    factory = REGISTRY.get(name)
    if factory is None:
        raise InputError(f"unknown method {name!r}; choose one of {sorted(REGISTRY)}")
    kwargs: dict[str, Any] = {}
    accepts_preset = "preset" in inspect.signature(factory).parameters
    if opts:
        for item in opts.split(","):
            key, eq, val = item.partition("=")
            if not eq and key.strip() and accepts_preset:     # a bare word names a preset: fedfs:paper
                kwargs["preset"] = key.strip()
                continue
            if not eq or not key:
                raise InputError(f"method option {item!r} in {spec!r} is not key=value")
            kwargs[ALIASES.get(key.strip(), key.strip())] = _value(val.strip())
    accepted = [p for p in inspect.signature(factory).parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise InputError(f"method {name!r} has no option(s) {unknown}; accepted: {accepted or 'none'}")
    return factory(**kwargs)


__all__ = ["REGISTRY", "register", "parse_method", "FederatedMethod", "SDKMethod", "PretrainedOnly",
           "FedFSMethod", "FedUVMethod", "FedFSUVMethod", "ClientState", "RoundPlan", "SimContext",
           "VerifierSpec", "Params", "Weights", "backbone_weights", "verifier_net"]
