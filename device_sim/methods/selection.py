"""Do no harm in the simulator: each client keeps the verifier it can show is better.

The same rule as a device (:mod:`fedfs_sdk.training.selection`): a client trains on all but a
few of its training photos (:class:`HoldoutView` — the federation sees only the rest), and after
training scores them and a public impostor set with ξ, the global model and its personalized
verifier; :func:`~fedfs_sdk.training.selection.choose` picks one. The public impostor set is
photos of ξ's public identities as ξ saw them (``--pretrain-data``'s look, the folder's public
identities without a capture shift): what ships with the model, never a client's photos.

Evaluation enrolls with all of a client's training photos, as a device does after choosing.
:meth:`SimSelection.counts` says how many clients chose which model (``results.json``:
``selection``; the table's "chose ξ / global / personalized" column).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from fedfs_sdk.errors import InputError
from fedfs_sdk.runtime.capture_match import match_capture
from fedfs_sdk.nn.model import DualVerifierNet, VerifierNet
from fedfs_sdk.training.scope import EmbeddingTop
from fedfs_sdk.training.selection import CHECK_IMPOSTORS, DEFAULT_HOLDOUT, check_candidate, choose, holdout_split, population_verdict

from .base import VerifierSpec

CANDIDATES = ("xi", "global", "personalized")


def top_verifier(net: torch.nn.Module) -> torch.nn.Module:
    """The verifier ``net`` after ξ's trunk: the same heads on :class:`EmbeddingTop` backbones
    (shared modules, so its parameter names are the top-only subset of ``net``'s)."""
    if isinstance(net, DualVerifierNet):
        return DualVerifierNet(EmbeddingTop(net.backbone), EmbeddingTop(net.global_backbone), net.uv_head)
    if isinstance(net, VerifierNet):
        return VerifierNet(EmbeddingTop(net.backbone), net.uv_head, project=net.project)
    raise InputError(f"scope='top' cannot split a {type(net).__name__} verifier")


def split_spec(spec: VerifierSpec, xi: torch.nn.Module) -> VerifierSpec:
    """``spec`` evaluated as its top on ξ's cached trunk features (:mod:`device_sim.trunk_cache`)
    — a pure speed-up, valid when the spec's trunk *is* ξ's (ξ itself, norm-adapt, any
    ``scope="top"`` model). Specs of a backbone that cannot be split are returned as they are."""
    from dataclasses import replace

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


class HoldoutView:
    """A :class:`~device_sim.population.Population` whose clients train without their hold-out.

    ``train_images(c)`` is client ``c``'s training photos less its hold-out
    (:func:`~fedfs_sdk.training.selection.holdout_split`, seeded by ``(seed, c)``);
    ``holdout_images(c)`` the rest; ``public_impostors`` the shipped impostor photos. Everything
    else is the population's.
    """

    def __init__(self, pop: Any, public_impostors: torch.Tensor, fraction: float = DEFAULT_HOLDOUT,
                 seed: int = 0) -> None:
        self.pop, self.fraction, self.seed = pop, float(fraction), int(seed)
        self.public_impostors = public_impostors
        self._parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "pop":
            raise AttributeError(name)
        return getattr(self.pop, name)

    def parts(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """``(train, holdout)`` image indices of ``client`` (dataset indices of its identity)."""
        if client not in self._parts:
            idx = self.pop.splits.clients[client].train
            tr, ho = holdout_split(len(idx), self.seed * 1_000_003 + client, self.fraction)
            self._parts[client] = (idx[tr], idx[ho])
        return self._parts[client]

    def _load(self, client: int, idx: np.ndarray, device) -> torch.Tensor:
        u = self.pop.splits.clients[client]
        x = self.pop.dataset.images(u.identity, idx)
        return x if device is None else x.to(device)

    def train_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor:
        return self._load(client, self.parts(client)[0], device)

    def holdout_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor:
        return self._load(client, self.parts(client)[1], device)

    def num_train(self, client: int) -> int:
        return int(self.parts(client)[0].size)


def _to_u8(x: torch.Tensor) -> np.ndarray:
    return torch.round(x * 127.5 + 127.5).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def _from_u8(u8: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(u8).permute(0, 3, 1, 2).float() - 127.5) / 127.5


class SimSelection:
    """One method's per-client choice among ξ, the global model and its personalized verifier."""

    def __init__(self, method: Any, audit: bool = False) -> None:
        self.method, self.audit = method, audit
        self.data: HoldoutView | None = None
        self.choices: dict[int, str] = {}
        self.details: dict[int, dict] = {}
        self.verdicts: dict = {}
        self._checks: dict[int, list | None] = {}
        self._unmatched: dict[int, list] = {}

    def bind(self, data: Any) -> None:
        if not isinstance(data, HoldoutView):
            raise InputError(f"{self.method.label}: select=on needs the clients' hold-out and a public impostor set "
                             "(run it through `fedfs simulate`, which provides them)")
        self.data = data

    def check(self, client: int, specs: Mapping[str, VerifierSpec]) -> list | None:
        """Client ``client``'s check of every candidate (hold-out vs its capture-matched public
        impostors); None when it has no hold-out (too few photos)."""
        from ..evaluate import embed

        if self.data is None:
            raise RuntimeError("SimSelection used before bind()")
        dev = torch.device(self.method.context.device)
        train_x = self.data.train_images(client)
        hold_x = self.data.holdout_images(client)
        if hold_x.shape[0] == 0:
            return None
        imp = self.data.public_impostors[:CHECK_IMPOSTORS]
        matched = _from_u8(match_capture(_to_u8(imp), _to_u8(train_x), seed=client))
        checks, raw = [], []
        for name in CANDIDATES:
            spec = specs[name]
            tr, ho, im, mi = (embed(spec, x, dev)["embedding"].numpy() for x in (train_x, hold_x, imp, matched))
            checks.append(check_candidate(name, tr, ho, mi, far=1e-3))
            raw.append(check_candidate(name, tr, ho, im, far=1e-3))
        self._unmatched[client] = [c.to_dict() for c in raw]
        return checks

    def prepare(self, clients, specs_of) -> None:
        """Every client's check, then the federation's verdict for each candidate
        (:func:`~fedfs_sdk.training.selection.population_verdict`)."""
        self._checks = {c: self.check(c, specs_of(c)) for c in clients}
        done = [v for v in self._checks.values() if v is not None]
        self.verdicts = {name: population_verdict(name, done) for name in CANDIDATES[1:]}

    def choose(self, client: int, specs: Mapping[str, VerifierSpec]) -> VerifierSpec:
        checks = self._checks[client] if client in self._checks else self.check(client, specs)
        if checks is None:              # too few photos to hold any out: nothing to show, keep ξ
            self.choices[client] = "xi"
            self.details[client] = {"chosen": "xi", "reason": "no hold-out photos (too few training photos)"}
            return specs["xi"]
        sel = choose(checks, self.verdicts)
        self.details[client] = {**sel.to_dict(), "checks_unmatched": self._unmatched.get(client)}
        if self.audit:      # select=audit: record what the rule would choose, verify with the personalized model
            self.choices[client] = "personalized"
            return specs["personalized"]
        self.choices[client] = sel.chosen
        return specs[sel.chosen]

    def counts(self, clients: list[int] | None = None) -> dict[str, int]:
        """How many of ``clients`` (default: every client chosen for) use each candidate."""
        keys = self.choices if clients is None else [c for c in clients if c in self.choices]
        out = {name: 0 for name in CANDIDATES}
        for c in keys:
            out[self.choices[c]] += 1
        return out


__all__ = ["HoldoutView", "SimSelection", "top_verifier", "split_spec", "CANDIDATES"]
