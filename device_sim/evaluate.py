"""Evaluate a trained federation: every client verifies with its own verifier.

For each evaluated client ``c`` the method gives a :class:`VerifierSpec` (personalized
``q'`` template, global model + codeword, …). With it the client

* **enrolls** on its local training images (the images the device holds; FedUV Alg. 2
  warm-up): a cosine template (leave-one-out warm-up scores, as
  :func:`fedfs_sdk.runtime.enrollment.enroll`) or its codeword, and the warm-up threshold ``τ``
  at target TPR ``q``;
* scores its held-out **test** images (genuine), a pool of **other participants'** test
  images (impostors) and all **new users'** images (never-seen identities).

From these scores (``device_sim.metrics``, protocols in ``docs/evaluation.md``):

* verification per client — AUROC, EER, TAR@FAR — averaged over clients (FedFS Table 1);
* pairwise 1:1 verification (FedFR protocol) per client: cosine of the verifier's embeddings
  of every pair of the client's own test images (genuine) and of each own test image with
  each pool image of another client (impostor); AUROC averaged over clients. It reuses the
  embeddings computed for the scores above (no extra forward pass);
* 1:N identification, FedFR/FedFS Table 2 protocol as implemented in ``metrics``: the
  client's gallery entry, its test images as mated probes and as non-mated probes either
  the other clients' pool images (``identification_clients``, FedFR's choice) or the
  never-enrolled new users' images (``identification``); TPIR@FPIR averaged over clients;
* FedUV warm-up outcome at ``q``: achieved TPR on test images, FPR on other participants and
  FPR on new users' images;
* new users (FedUV Fig. 4, third set): each new user enrolls with the model the server
  ships (:meth:`FederatedMethod.new_user_verifier`, a fresh codeword for FedUV methods),
  warm-up on its train part, TPR on its test part, FPR on everyone else's images.

Embedding cost: a shared verifier (global model, ξ) embeds every image once; a personalized
one embeds the pool for each client — on CUDA, chunks of clients run under ``vmap``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch.func import functional_call, vmap

from fedfs_sdk.errors import InputError

from . import metrics as M
from .methods.base import ClientState, FederatedMethod, Params, VerifierSpec, Weights
from .memory import forward_batch
from .population import Population


PAIRWISE_FAR = 1e-3
"""The FAR of the pairwise TAR column (each client's own-test pairs vs own-test × pool pairs)."""


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation settings.

    Attributes:
        q: FedUV warm-up target TPR.
        fars: FAR / FPIR operating points.
        max_clients: evaluate at most this many clients (a seeded sample beyond it).
        impostor_pool: at most this many other participants' test images as impostors.
        batch_size: images per forward pass; None (default) picks what fits
            :data:`device_sim.memory.INFER_BUDGET_BYTES` for the model (512 for the small
            backbones, 83 for MobileFaceNet at 112 px, whose 512-image forward took ≈ 2.5 GB).
        client_chunk: clients per vmapped forward (CUDA / ``batched=True``).
        batched: vmap personalized verifiers over clients (default: on CUDA only).
        seed: seeds the samples above.
    """

    q: float = 0.9
    fars: tuple[float, ...] = M.DEFAULT_FARS
    max_clients: int = 1000
    impostor_pool: int = 2000
    batch_size: int | None = None
    client_chunk: int = 32
    batched: bool | None = None
    seed: int = 0


class _Scorer:
    """Scores of one enrollment: cosine template or FedUV codeword (FedUV Eq. 5)."""

    def __init__(self, spec: VerifierSpec, warm: Mapping[str, torch.Tensor],
                 fresh: Mapping[str, torch.Tensor] | None = None) -> None:
        """``warm``: the enrollment images' outputs (template, and the warm-up when ``fresh``
        is None); ``fresh``: separate warm-up images scored against the enrollment."""
        self.codeword = None if spec.codeword is None else torch.as_tensor(spec.codeword, dtype=torch.float64)
        if self.codeword is not None:
            self.warmup = self(fresh if fresh is not None else warm)
            return
        if getattr(spec, "reference", None) is not None:
            # a method-supplied template (the client's own class embedding: softmax, FedAwS…)
            self.template = _unit(torch.as_tensor(spec.reference).double())
            self.warmup = self(fresh if fresh is not None else warm)
            return
        e = _unit(warm["embedding"].double())
        total = e.sum(0)
        self.template = _unit(total)
        if fresh is not None:
            self.warmup = self(fresh)
        else:
            # leave-one-out warm-up scores: an image is never scored against a template holding it
            self.warmup = (e * _unit(total[None, :] - e)).sum(1).numpy()

    def __call__(self, feats: Mapping[str, torch.Tensor]) -> np.ndarray:
        if self.codeword is not None:
            uv = feats.get("uv")
            if uv is None:
                raise InputError("codeword verification needs a verifier with a FedUV head")
            return (uv.double() @ self.codeword / self.codeword.numel()).numpy()
        return (_unit(feats["embedding"].double()) @ self.template).numpy()


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _names(spec: VerifierSpec) -> tuple[str, ...]:
    return tuple(spec.net.output_names)


def _split(spec: VerifierSpec, x: torch.Tensor) -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    """``(net, weights, inputs)`` to run: the whole verifier on images, or — for a split spec
    (``spec.trunk``) — its top on ξ's cached trunk features."""
    if spec.trunk is None or spec.top is None:
        return spec.net, spec.weights, x
    names = set(spec.top.state_dict())
    return spec.top, {k: v for k, v in spec.weights.items() if k in names}, spec.trunk(x)


@torch.no_grad()
def embed(spec: VerifierSpec, x: torch.Tensor, device: torch.device,
          batch_size: int | None = None) -> dict[str, torch.Tensor]:
    """Run one verifier on images ``x``; returns CPU float32 ``{"embedding", ["uv"]}``."""
    net, weights, x = _split(spec, x)
    net = net.to(device).eval()
    batch_size = batch_size or _auto_batch(net, x, device)
    w = {k: v.to(device) for k, v in weights.items()}
    outs: dict[str, list[torch.Tensor]] = {n: [] for n in _names(spec)}
    for s in range(0, x.shape[0], batch_size):
        res = functional_call(net, w, (x[s:s + batch_size].to(device),))
        for n, t in zip(outs, res):
            outs[n].append(t.float().cpu())
    return {n: torch.cat(v) if v else torch.zeros(0) for n, v in outs.items()}


@torch.no_grad()
def embed_stacked(specs: Sequence[VerifierSpec], x: torch.Tensor, device: torch.device,
                  batch_size: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Run K verifiers of one architecture on the same images under ``vmap`` (one
    forward for all K per image batch). Returns one feature dict per verifier."""
    net, first, x = _split(specs[0], x)
    net = net.to(device).eval()
    batch_size = batch_size or _auto_batch(net, x, device)
    stacked = {k: torch.stack([s.weights[k].to(device) for s in specs]) for k in first}
    fn = vmap(lambda w, xb: functional_call(net, w, (xb,)), in_dims=(0, None))
    names = _names(specs[0])
    outs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for s in range(0, x.shape[0], batch_size):
        res = fn(stacked, x[s:s + batch_size].to(device))
        for n, t in zip(names, res):
            outs[n].append(t.float().cpu())
    cat = {n: torch.cat(v, dim=1) for n, v in outs.items()}
    return [{n: t[i] for n, t in cat.items()} for i in range(len(specs))]


def _auto_batch(net: torch.nn.Module, x: torch.Tensor, device: torch.device | str = "cpu") -> int:
    """Images per forward that fit :data:`device_sim.memory.INFER_BUDGET_BYTES`, and on CPU
    :data:`device_sim.memory.CPU_FORWARD_BYTES` (:func:`device_sim.memory.forward_batch`)."""
    if x.dim() != 4 or x.shape[1] != 3 or next(net.parameters(), None) is None:
        return 512          # not images (a split verifier's trunk features): small
    return forward_batch(net, int(x.shape[-1]), device)


def _select(feats: Mapping[str, torch.Tensor], idx: np.ndarray | slice) -> dict[str, torch.Tensor]:
    i = torch.as_tensor(idx) if isinstance(idx, np.ndarray) else idx
    return {k: v[i] for k, v in feats.items()}


@dataclass
class _Probes:
    """The shared probe images: a pool of participants' test images and new users' images."""

    pool: torch.Tensor
    pool_owner: np.ndarray        # client of each pool image
    new: torch.Tensor
    new_owner: np.ndarray         # new user of each image
    new_is_test: np.ndarray       # bool: image is in the new user's test part


def _probes(pop: Population, clients: np.ndarray, cfg: EvalConfig) -> _Probes:
    rng = np.random.default_rng([cfg.seed, 0xE7A1])
    ids, idx, owner = pop.test_pairs(clients)
    if ids.size > cfg.impostor_pool:          # sample before loading: 10,000 clients' test sets are large
        keep = np.sort(rng.choice(ids.size, cfg.impostor_pool, replace=False))
        ids, idx, owner = ids[keep], idx[keep], owner[keep]
    pool = pop.images(ids, idx, clients=owner)      # through the image store when the population has one
    nx, no, nt = [], [], []
    for j in range(pop.num_new_users):
        tr, te = pop.new_user_images(j, "train"), pop.new_user_images(j, "test")
        nx += [tr, te]
        no.append(np.full(tr.shape[0] + te.shape[0], j))
        nt.append(np.r_[np.zeros(tr.shape[0], bool), np.ones(te.shape[0], bool)])
    size = pop.image_size
    new = torch.cat(nx) if nx else torch.zeros(0, 3, size, size)
    return _Probes(pool, owner, new, np.concatenate(no) if no else np.zeros(0, np.int64),
                   np.concatenate(nt) if nt else np.zeros(0, bool))


def evaluate(method: FederatedMethod, global_weights: Weights, private: Callable[[int], Params | None],
             population: Population, config: EvalConfig = EvalConfig(), device: str = "cpu",
             client_state: Callable[[int], ClientState] | None = None,
             progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Evaluate ``method`` (already set up) with its final ``global_weights`` and per-client
    private weights (``private(c)``; None for a client that never trained).

    Returns a JSON-able dict:

    * ``clients``: ids of the evaluated clients, the order of every per-client list;
    * ``verification`` (template protocol): ``auroc``/``eer``/``tar_at_far`` aggregates,
      ``per_client_auroc``, ``pooled``, ``far_resolution``;
    * ``pairwise`` (FedFR 1:1 protocol): ``{"auroc": aggregate, "per_client_auroc": [..]}`` —
      cosine of the verifier's ``embedding`` output for every verifier mode;
    * ``identification_clients`` (FedFR 1:N, other clients' pool images as non-mated probes):
      ``{"tpir_at_fpir": {"0.1": aggregate, …}, "per_client": {"0.1": [..], …}}``;
    * ``identification`` (new users' images as non-mated probes; only with new users): same shape;
    * ``warmup`` (participants), ``new_users`` and the mean ROC (``roc``: fpr/tpr lists).
    """
    dev = torch.device(device)
    batched = config.batched if config.batched is not None else dev.type == "cuda"
    state_of = client_state or method.client_state_init
    n = population.num_clients
    rng = np.random.default_rng([config.seed, 0xC11E])
    clients = np.arange(n) if n <= config.max_clients else np.sort(rng.choice(n, config.max_clients, replace=False))
    method.prepare_evaluation(global_weights, private, [int(c) for c in clients])
    probes = _probes(population, clients, config)
    shared_cache: dict[str, dict[str, dict[str, torch.Tensor]]] = {}

    def shared_feats(spec: VerifierSpec) -> dict[str, dict[str, torch.Tensor]]:
        key = spec.shared_key or ""
        if key not in shared_cache:
            shared_cache[key] = {"pool": embed(spec, probes.pool, dev, config.batch_size),
                                 "new": embed(spec, probes.new, dev, config.batch_size)}
        return shared_cache[key]

    ver, ident, warm_p, warm_new_fpr = [], [], [], []
    ident_clients: list[dict[float, float]] = []
    pairwise: list[float] = []
    pairwise_tar: list[float] = []
    pairwise_eer: list[float] = []
    fars = tuple(float(f) for f in config.fars)
    has_new = probes.new.shape[0] > 0
    done = 0
    for a in range(0, clients.size, config.client_chunk):
        chunk = clients[a:a + config.client_chunk].tolist()
        specs = [method.verifier(state_of(c), global_weights, private(c)) for c in chunk]
        personal = [i for i, s in enumerate(specs) if s.shared_key is None]
        feats_personal: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        if personal and batched:
            ps = [specs[i] for i in personal]
            pools = embed_stacked(ps, probes.pool, dev, config.batch_size)
            news = embed_stacked(ps, probes.new, dev, config.batch_size) if has_new else [None] * len(ps)
            for i, pf, nf in zip(personal, pools, news):
                feats_personal[i] = {"pool": pf, "new": nf}
        for i, (c, spec) in enumerate(zip(chunk, specs)):
            if spec.shared_key is not None:
                f = shared_feats(spec)
            elif i in feats_personal:
                f = feats_personal[i]
            else:
                f = {"pool": embed(spec, probes.pool, dev, config.batch_size),
                     "new": embed(spec, probes.new, dev, config.batch_size) if has_new else None}
            own_train = embed(spec, population.train_images(c, dev), dev, config.batch_size)
            own_test = embed(spec, population.test_images(c, dev), dev, config.batch_size)
            fresh = population.warmup_images(c, dev)
            scorer = _Scorer(spec, own_train, None if fresh is None else embed(spec, fresh, dev, config.batch_size))
            genuine = scorer(own_test)
            others = probes.pool_owner != c
            pool_scores = scorer(f["pool"])         # one matmul; the client's own pool images are dropped below
            impostor = pool_scores[others]
            ver.append((genuine, impostor))
            try:   # FedFR 1:N: the other clients' images (= `impostor`) are the non-mated probes
                ident_clients.append(M.tpir_at_fpir(genuine, impostor, fars))
            except InputError:
                ident_clients.append({f_: float("nan") for f_ in fars})
            try:   # FedFR 1:1: cosine of the verifier's embedding output, every mode (codeword ones too)
                pg, pi = M.pairwise_scores(own_test["embedding"].numpy(), f["pool"]["embedding"].numpy()[others])
                pairwise.append(M.auroc(pg, pi) if pg.size else float("nan"))
                pairwise_tar.append(M.tar_at_far(pg, pi, PAIRWISE_FAR) if pg.size and pi.size else float("nan"))
                pairwise_eer.append(M.eer(pg, pi) if pg.size and pi.size else float("nan"))
            except InputError:
                pairwise.append(float("nan"))
                pairwise_tar.append(float("nan"))
                pairwise_eer.append(float("nan"))
            warm_p.append((scorer.warmup, genuine, impostor))
            if has_new:
                nonmated = scorer(f["new"])
                ident.append((genuine, nonmated))
                warm_new_fpr.append((scorer.warmup, genuine, nonmated))
            done += 1
            if progress is not None:
                progress(done, int(clients.size))

    result: dict[str, Any] = {"clients_evaluated": int(clients.size), "impostor_pool": int(probes.pool.shape[0]),
                              "new_user_images": int(probes.new.shape[0]), "q": config.q,
                              # the order of every per-client list below: pair two methods' lists by it
                              "clients": [int(c) for c in clients]}
    v = M.per_client_verification(ver, config.fars)
    pooled = v["pooled"] or {}
    result["verification"] = {"auroc": v["auroc"], "eer": v["eer"], "tar_at_far": _keys(v["tar_at_far"]),
                              "per_client_auroc": [p.get("auroc", float("nan")) for p in v["per_client"]],
                              "per_client_tar_at_far": _keys({f: [p.get("tar_at_far", {}).get(f, float("nan"))
                                                                  for p in v["per_client"]] for f in config.fars}),
                              # one global threshold over all clients' scores (FedFS does not say which it reports)
                              "pooled": {"auroc": pooled.get("auroc"), "eer": pooled.get("eer"),
                                         "tar_at_far": _keys(pooled.get("tar_at_far", {}))},
                              # the coarsest client's 1/n_impostor: smaller FAR targets mean FAR 0
                              "far_resolution": max((p["far_resolution"] for p in v["per_client"]
                                                     if "far_resolution" in p), default=float("nan"))}
    result["pairwise"] = {"auroc": M.aggregate(pairwise), "per_client_auroc": pairwise,
                          # each client's pairs: ~n·m impostor pairs resolve FAR 1e-3 where templates cannot
                          "tar_at_far": {f"{PAIRWISE_FAR:g}": M.aggregate(pairwise_tar)},
                          "per_client_tar_at_far": {f"{PAIRWISE_FAR:g}": pairwise_tar},
                          "per_client_eer": pairwise_eer}
    result["identification_clients"] = {
        "tpir_at_fpir": _keys({f: M.aggregate([d[f] for d in ident_clients]) for f in fars}),
        "per_client": _keys({f: [d[f] for d in ident_clients] for f in fars})}
    fpr, tpr = M.mean_roc(ver)
    result["roc"] = {"fpr": fpr.tolist(), "tpr": tpr.tolist()}
    wp = M.per_user_warmup(warm_p, config.q)
    result["warmup"] = {"tpr": wp["tpr"], "fpr_participants": wp["fpr"], "n_insufficient": wp["n_insufficient"]}
    if has_new:
        ni = M.per_client_identification(ident, fars)
        result["identification"] = {"tpir_at_fpir": _keys(ni["tpir_at_fpir"]), "per_client": _keys(ni["per_client"])}
        result["warmup"]["fpr_new_users"] = M.per_user_warmup(warm_new_fpr, config.q)["fpr"]
        result["new_users"] = _evaluate_new_users(method, global_weights, population, probes, config, dev)
    return result


def _keys(d: Mapping[float, Any]) -> dict[str, Any]:
    return {f"{k:g}": v for k, v in d.items()}


def _evaluate_new_users(method: FederatedMethod, global_weights: Weights, pop: Population, probes: _Probes,
                        cfg: EvalConfig, dev: torch.device) -> dict[str, Any]:
    """FedUV's third evaluation set: users who never trained enroll with the shipped model."""
    outs, chose = [], {}
    cache: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for j in range(pop.num_new_users):
        state = method.client_state_init(pop.num_clients + j)   # a fresh, never-trained identity/codeword
        enroll_x = probes.new[torch.from_numpy(np.flatnonzero((probes.new_owner == j) & ~probes.new_is_test))]
        spec, name = method.new_user_choice(state, global_weights, enroll_x)
        if name is not None:
            chose[name] = chose.get(name, 0) + 1
        key = spec.shared_key
        if key is not None and key in cache:
            f = cache[key]
        else:
            f = {"pool": embed(spec, probes.pool, dev, cfg.batch_size), "new": embed(spec, probes.new, dev, cfg.batch_size)}
            if key is not None:
                cache[key] = f
        mine = probes.new_owner == j
        scorer = _Scorer(spec, _select(f["new"], np.flatnonzero(mine & ~probes.new_is_test)))
        genuine = scorer(_select(f["new"], np.flatnonzero(mine & probes.new_is_test)))
        impostor = np.concatenate([scorer(f["pool"]), scorer(_select(f["new"], np.flatnonzero(~mine)))])
        outs.append((scorer.warmup, genuine, impostor))
    w = M.per_user_warmup(outs, cfg.q)
    v = M.per_client_verification([(g, i) for _, g, i in outs], cfg.fars)
    return {"users": pop.num_new_users, "tpr": w["tpr"], "fpr": w["fpr"], "n_insufficient": w["n_insufficient"],
            "auroc": v["auroc"], **({"chose": chose} if chose else {})}


__all__ = ["EvalConfig", "evaluate", "embed", "embed_stacked"]
