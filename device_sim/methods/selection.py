"""Do no harm in the simulator: each client keeps the verifier it can show is better.

The same rule as a device (:mod:`fedfs_sdk.training.selection`): a client trains on all but a
few of its training photos (:class:`HoldoutView` — the federation sees only the rest), and after
training scores them and a public impostor set with ξ, the global model and its personalized
verifier; :func:`~fedfs_sdk.training.selection.choose` picks one. The public impostor set is
photos of ξ's public identities as ξ saw them (``--pretrain-data``'s look, the folder's public
identities without a capture shift): what ships with the model, never a client's photos.

**Which impostors** (``check=``): ``in-domain`` (the defaults' since issue 29) judges every
candidate against impostors in the federation's own capture conditions — draws from the Gaussian
of the other clients' trunk features that the statistics round sums
(:mod:`fedfs_sdk.stats.impostor_model`, :mod:`.client_stats`) — and adds ``norm-adapt`` ξ (ξ with
its normalization re-fitted to the round's embedding moments) as a candidate; ``public`` is the
shipped public impostor set, capture-matched (the behaviour of the issue-23 tables). The
federation's verdict on each candidate is the sum of every checked client's
:func:`~fedfs_sdk.stats.check_contribution` (:func:`~fedfs_sdk.stats.verdict_from_sum`) — what a
device receives from a statistics round — not a pooled computation.

Evaluation enrolls with all of a client's training photos, as a device does after choosing.
:meth:`SimSelection.counts` says how many clients chose which model (``results.json``:
``selection``; the table's "chose ξ / global / personalized" column).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import numpy as np
import torch

from fedfs_sdk.errors import InputError
from fedfs_sdk.runtime.capture_match import match_capture
from fedfs_sdk.stats import DRAWS, standard_draws, sum_contributions, threshold_at_far
from fedfs_sdk.stats.impostor_model import draws_from_factor
from fedfs_sdk.stats.in_domain import check_contributions, decide, in_domain_factor, top_verifier  # noqa: F401
from fedfs_sdk.training.selection import CHECK_IMPOSTORS, DEFAULT_HOLDOUT, check_candidate, holdout_split

from .base import VerifierSpec
from .split_top import fingerprint as _fingerprint, split_spec, top_embed as _top_embed

CANDIDATES = ("xi", "global", "personalized")
IN_DOMAIN_CANDIDATES = ("xi", "norm-adapt", "global", "personalized")
CHECKS = ("in-domain", "public")
DIAGNOSTIC_FARS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
"""FARs at which the simulator records predicted vs measured in-domain FAR (diagnostics only)."""


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
            tr, ho = self._positions(client)
            self._parts[client] = (idx[tr], idx[ho])
        return self._parts[client]

    def _positions(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """``(train, holdout)`` positions within ``client``'s training photos (seeded by ``(seed, c)``)."""
        return holdout_split(len(self.pop.splits.clients[client].train), self.seed * 1_000_003 + client,
                             self.fraction)

    def _load(self, client: int, idx: np.ndarray, device) -> torch.Tensor:
        u = self.pop.splits.clients[client]
        x = self.pop.dataset.images(u.identity, idx)
        return x if device is None else x.to(device)

    def train_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor:
        return self._load(client, self.parts(client)[0], device)

    def train_chunk(self, clients: np.ndarray | list[int], device: str | torch.device | None = None) -> list[torch.Tensor]:
        """The training photos of a chunk of clients *less their hold-out* (what the round loop and
        the statistics round read): without it the population's ``train_chunk`` answered, and the
        clients trained on the very photos their check then called held out."""
        cl = [int(c) for c in np.asarray(clients, dtype=np.int64).reshape(-1)]
        store = getattr(self.pop, "store", None)
        if store is None:
            return [self.train_images(c, device) for c in cl]
        u8, counts = store.images(cl, "train", positions=[self._positions(c)[0] for c in cl], device=device)
        return list(torch.split(u8, counts))

    def holdout_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor:
        return self._load(client, self.parts(client)[1], device)

    def num_train(self, client: int) -> int:
        return int(self.parts(client)[0].size)


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _to_u8(x: torch.Tensor) -> np.ndarray:
    return torch.round(x * 127.5 + 127.5).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def _from_u8(u8: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(u8).permute(0, 3, 1, 2).float() - 127.5) / 127.5


class SimSelection:
    """One method's per-client choice among ξ, the global model and its personalized verifier."""

    def __init__(self, method: Any, audit: bool = False, check: str = "public") -> None:
        if check not in CHECKS:
            raise InputError(f"check must be one of {CHECKS}, got {check!r}")
        self.method, self.audit, self.mode = method, audit, check
        self.candidates: tuple[str, ...] = CANDIDATES
        self.stats: Any = None          # the statistics round (.client_stats.FederationStats), in-domain only
        self.diagnostics: dict[int, dict] = {}
        self.data: HoldoutView | None = None
        self.choices: dict[int, str] = {}
        self.details: dict[int, dict] = {}
        self.new_user_details: dict[int, dict] = {}     # by the identity's index after the clients'
        self.verdicts: dict = {}
        self._checks: dict[int, list | None] = {}
        self._unmatched: dict[int, list] = {}
        self._call_memo: dict | None = None      # prepare()'s: the shared models' real-impostor embeddings

    def bind(self, data: Any, stats: Any = None, candidates: tuple[str, ...] | None = None) -> None:
        """``stats``: the statistics round's outcome (``check=in-domain`` needs its feature moments);
        ``candidates``: the names :meth:`check` judges (ξ first)."""
        if not isinstance(data, HoldoutView):
            raise InputError(f"{self.method.label}: select=on needs the clients' hold-out and a public impostor set "
                             "(run it through `fedfs simulate`, which provides them)")
        self.data = data
        if self.mode == "in-domain":
            from .client_stats import FEATURES

            if stats is None or FEATURES not in stats.total.sums:
                raise InputError(f"{self.method.label}: check=in-domain needs ξ's trunk feature moments "
                                 "(scope=top on a backbone with an embedding layer); use check=public")
            self.stats = stats
        if candidates is not None:
            self.candidates = tuple(candidates)

    def check(self, client: int, specs: Mapping[str, VerifierSpec]) -> list | None:
        """Client ``client``'s check of every candidate (hold-out vs its capture-matched public
        impostors); None when it has no hold-out (too few photos)."""
        if self.data is None:
            raise RuntimeError("SimSelection used before bind()")
        train_x = self.data.train_images(client)
        hold_x = self.data.holdout_images(client)
        if hold_x.shape[0] == 0:
            return None
        checks, diag = self._check_photos(client, specs, self.candidates, train_x, hold_x)
        if diag is not None:
            self.diagnostics[client] = diag
        return checks

    def choose_new_user(self, key: int, specs: Mapping[str, VerifierSpec], enroll_x: torch.Tensor) -> tuple[VerifierSpec, str]:
        """A user who never trained (FedUV's new users; a device the server never sampled), by the
        device's rule: it holds out some of its enrollment photos (seeded by ``key``, the identity's
        index after the clients'), checks the candidates it has — ξ, norm-adapt, the global model;
        no θ_c — and decides with the federation's published verdicts (it contributed no check of
        its own). Returns the chosen spec and its name; ``select=audit`` ships the global model."""
        if self.data is None:
            raise RuntimeError("SimSelection used before bind()")
        names = tuple(n for n in self.candidates if n in specs)
        tr, ho = holdout_split(int(enroll_x.shape[0]), self.data.seed * 1_000_003 + int(key), self.data.fraction)
        if ho.size == 0 or len(names) < 2:
            sel_name, detail = names[0], {"chosen": names[0], "reason": "no hold-out photos (too few photos)"}
        else:
            checks, diag = self._check_photos(key, specs, names, enroll_x[torch.from_numpy(tr)],
                                              enroll_x[torch.from_numpy(ho)])
            sel = decide(checks, self._check_sum, self.candidates) if self._check_sum_ready() else decide(checks)
            sel_name, detail = sel.chosen, {**sel.to_dict(), **({"in_domain_far": diag} if diag else {})}
        self.new_user_details[int(key)] = detail
        if self.audit:
            return specs["global"], "global"
        return specs[sel_name], sel_name

    def _check_photos(self, key: int, specs: Mapping[str, VerifierSpec], names: tuple[str, ...],
                      train_x: torch.Tensor, hold_x: torch.Tensor) -> tuple[list, dict | None]:
        """The candidates ``names`` checked on these photos (template from ``train_x``, genuine =
        ``hold_x``); with the in-domain diagnostics (None for ``check=public``)."""
        from ..evaluate import embed

        dev = torch.device(self.method.context.device)
        if self.mode == "in-domain":
            return self._check_in_domain(key, specs, names, train_x, hold_x, dev)
        imp = self.data.public_impostors[:CHECK_IMPOSTORS]
        matched = _from_u8(match_capture(_to_u8(imp), _to_u8(train_x), seed=key))
        checks, raw = [], []
        for name in names:
            spec = specs[name]
            tr, ho, im, mi = (embed(spec, x, dev)["embedding"].numpy() for x in (train_x, hold_x, imp, matched))
            checks.append(check_candidate(name, tr, ho, mi, far=1e-3))
            raw.append(check_candidate(name, tr, ho, im, far=1e-3))
        self._unmatched[key] = [c.to_dict() for c in raw]
        return checks, None

    def _check_in_domain(self, client: int, specs: Mapping[str, VerifierSpec], names: tuple[str, ...],
                         train_x: torch.Tensor, hold_x: torch.Tensor, dev: torch.device) -> tuple[list, dict]:
        """Each candidate: template from the training photos, genuine = the hold-out, impostors =
        :data:`~fedfs_sdk.stats.DRAWS` trunk features drawn from the *other* clients' summed
        moments (the round's sum minus this client's own contribution) through the candidate's top
        — the same draws for every candidate. The measured FAR on the other clients' real photos at
        each candidate's threshold is recorded as a diagnostic (never used to decide)."""
        from ..evaluate import embed
        from .client_stats import FEATURES

        assert self.stats is not None
        # Everything below that depends on the round and the client only — the draws, the other
        # clients' real features, and ξ's own check — is the same for every method of the run
        # that shares the round (client_stats.shared_round): kept in the round's memo
        memo, seed = self.stats.memo, int(self.method.context.seed)
        if ("factor", client) not in memo:      # the eigendecomposition, once per client and round
            own = self.stats.contribution(client)
            # the device's function (fedfs_sdk.stats.in_domain): the published sum minus its own contribution
            memo[("factor", client)] = in_domain_factor(self.stats.total.sums[FEATURES],
                                                        None if own is None else own[FEATURES])
        mu, factor = memo[("factor", client)]
        z = memo.get(("z", mu.size, seed))
        if z is None:
            z = memo[("z", mu.size, seed)] = standard_draws(mu.size, DRAWS, seed=seed)
        # the 8192 draws themselves (8 MB a client) are redrawn, not kept: z @ L is milliseconds
        drawn = torch.from_numpy(draws_from_factor(mu, factor, z))
        real = self._real_impostors()
        checks, diag = [], {}
        done: dict[tuple, str] = {}     # this call's candidates by what they compute (FedUV: global = personalized)
        for name in names:
            spec = specs[name]
            fp = _fingerprint(spec)
            # ξ's and norm-adapt's tensors live as long as the run (ξ's own, the round's memo): their
            # addresses in the key cannot be reused by another method's weights
            key = ("check", client, seed, fp) if spec.shared_key in ("xi", "norm-adapt") else None
            if key is not None and key in memo:
                ck, d = memo[key]
                checks.append(ck)
                if d is not None:
                    diag[name] = d
                continue
            if fp in done:              # the same verifier under another name: the same check
                same = done[fp]
                checks.append(replace(next(c for c in checks if c.name == same), name=name))
                if same in diag:
                    diag[name] = diag[same]
                continue
            done[fp] = name
            tr, ho = (embed(spec, x, dev)["embedding"].numpy() for x in (train_x, hold_x))
            im = _top_embed(spec, drawn, dev)
            ck = check_candidate(name, tr, ho, im, far=1e-3)
            checks.append(ck)
            if real is not None:
                t = _unit(_unit(tr).sum(0))
                emb = self._real_embedded(spec, fp, real[0], dev, memo if key is not None else
                                         self._call_memo if spec.shared_key is not None else None)
                pred, meas = _unit(im) @ t, emb[real[1] != client] @ t
                diag[name] = {f"{far:g}": {"tau": (tau := threshold_at_far(pred, far)),
                                           "measured_far": float((meas > tau).mean())} for far in DIAGNOSTIC_FARS}
                diag[name]["n_real"] = int(meas.size)
            if key is not None:
                memo[key] = (ck, diag.get(name))
        return checks, diag

    def _real_impostors(self) -> tuple[torch.Tensor, np.ndarray] | None:
        """Every contributing client's real trunk features and their owners (the simulator's ground
        truth for the diagnostic only; a client's impostors are the rows it does not own). Built
        once per round: the round's memo."""
        got = self.stats.memo.get("real")
        if got is None and self.stats.features:
            clients = list(self.stats.features)
            feats = [np.asarray(self.stats.features[c]) for c in clients]
            got = self.stats.memo["real"] = (
                torch.from_numpy(np.concatenate(feats).astype(np.float32)),
                np.repeat(np.asarray(clients), [f.shape[0] for f in feats]))
        return got

    def _real_embedded(self, spec: VerifierSpec, fp: tuple, real: torch.Tensor, dev: torch.device,
                       keep: dict | None) -> np.ndarray:
        """Unit embeddings of every real impostor feature under ``spec``'s top — computed once per
        verifier, not once per client (a model every client shares: ξ, norm-adapt ξ, the global
        model). ``keep``: where to keep them (the round's memo for ξ's and norm-adapt's, whose
        tensors live as long as the run; :meth:`prepare`'s own for the rest, whose addresses — in
        the key — may be reused once a method's weights are freed)."""
        key = ("real-embedded", fp)
        if keep is not None and key in keep:
            return keep[key]
        emb = _unit(_top_embed(spec, real, dev))
        if keep is not None:
            keep[key] = emb
        return emb

    def prepare(self, clients, specs_of) -> None:
        """Every client's check, then the federation's verdict for each candidate: the sum of every
        checked client's :func:`~fedfs_sdk.stats.check_contribution` (the statistics round's sum,
        :func:`~fedfs_sdk.stats.sum_contributions`), turned into verdicts
        (:func:`~fedfs_sdk.stats.verdict_from_sum`) — what every device receives."""
        self._call_memo = {}        # this call's methods' weights stay alive until it returns
        try:
            self._checks = {c: self.check(c, specs_of(c)) for c in clients}
        finally:
            self._call_memo = None
        done = [v for v in self._checks.values() if v is not None]
        others = self.candidates[1:]
        if done:
            summed = sum_contributions({"checks": check_contributions(v, self.candidates)} for v in done)
            self._check_sum = summed.sums["checks"]
            dp = getattr(self.stats, "dp", None)
            if dp is not None and dp.z > 0:      # the check round's central noise (fedfs_sdk.stats.privacy)
                from fedfs_sdk.stats.privacy import add_noise
                from fedfs_sdk.stats.transport import StatSpec

                spec = StatSpec("checks", "checks", self._check_sum.size, 1.0)
                rng = np.random.default_rng([int(dp.seed) & 0xFFFFFFFF, 0xC4EC])
                self._check_sum = add_noise({"checks": self._check_sum}, [spec], dp.max_photos, dp.z, rng)["checks"]
        else:
            self._check_sum = np.zeros(4 * len(others))
        from fedfs_sdk.stats import verdict_from_sum

        self.verdicts = verdict_from_sum(self._check_sum, others)

    def choose(self, client: int, specs: Mapping[str, VerifierSpec]) -> VerifierSpec:
        checks = self._checks[client] if client in self._checks else self.check(client, specs)
        if checks is None:              # too few photos to hold any out: nothing to show, keep ξ
            self.choices[client] = "xi"
            self.details[client] = {"chosen": "xi", "reason": "no hold-out photos (too few training photos)"}
            return specs["xi"]
        # the device's rule (fedfs_sdk.stats.in_domain.decide): its checks and the published check sum
        sel = decide(checks, getattr(self, "_check_sum", None), self.candidates) if self._check_sum_ready() \
            else decide(checks)
        self.details[client] = {**sel.to_dict(), "checks_unmatched": self._unmatched.get(client),
                                **({"in_domain_far": self.diagnostics[client]} if client in self.diagnostics else {})}
        if self.audit:      # select=audit: record what the rule would choose, verify with the personalized model
            self.choices[client] = "personalized"
            return specs["personalized"]
        self.choices[client] = sel.chosen
        return specs[sel.chosen]

    def _check_sum_ready(self) -> bool:
        return getattr(self, "_check_sum", None) is not None and len(self.candidates) > 1

    def counts(self, clients: list[int] | None = None) -> dict[str, int]:
        """How many of ``clients`` (default: every client chosen for) use each candidate."""
        keys = self.choices if clients is None else [c for c in clients if c in self.choices]
        out = {name: 0 for name in self.candidates}
        for c in keys:
            out[self.choices[c]] += 1
        return out


__all__ = ["HoldoutView", "SimSelection", "top_verifier", "split_spec", "CANDIDATES", "IN_DOMAIN_CANDIDATES", "CHECKS"]
