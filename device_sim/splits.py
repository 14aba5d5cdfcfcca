"""The papers' identity and image splits.

* **public** identities pre-train the frozen model ξ only (FedFS §4.1 uses MS-Celeb-1M, the
  public data that FedFR shares); they never join the federation;
* **clients**: one identity per client (FedFS: "each client has only one identity"), with
  that identity's images split into local training and held-out test images — 57/13 per
  client on DigiFace-1M, i.e. 80/20 (FedFS §4.1);
* **new users** never take part in training (FedUV §6.1 "users who did not participate in
  training"); their images are split the same way into warm-up/enrollment (``train``) and
  test images, for FedUV's third evaluation set (Fig. 4).

Identities are assigned to the three groups by one seeded permutation, so different seeds
give disjoint-by-construction but differently drawn populations and the same seed always
gives the same split.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Literal

import numpy as np

from fedfs_sdk.errors import InputError

from .datasets import IdentityDataset

__all__ = ["UserSplit", "FaceSplits", "make_splits"]

Group = Literal["public", "clients", "new_users"]
Part = Literal["train", "test", "warmup", "all"]


@dataclass(frozen=True)
class UserSplit:
    """One identity and the image indices it contributes to training and to testing."""

    identity: int
    train: np.ndarray       # int64 image indices (local training; enrollment of new users; pre-training)
    test: np.ndarray        # int64 held-out image indices
    warmup: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # ^ fresh images for FedUV's warm-up threshold (Alg. 2); empty → use ``train``

    @property
    def warmup_or_train(self) -> np.ndarray:
        """The images a warm-up should score: ``warmup`` if drawn, else ``train``."""
        return self.warmup if self.warmup.size else self.train

    def to_dict(self) -> dict:
        return {"identity": int(self.identity), "train": self.train.tolist(), "test": self.test.tolist(),
                "warmup": self.warmup.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "UserSplit":
        return cls(int(d["identity"]), np.asarray(d["train"], dtype=np.int64), np.asarray(d["test"], dtype=np.int64),
                   np.asarray(d.get("warmup", []), dtype=np.int64))


@dataclass(frozen=True)
class FaceSplits:
    """Public / client / new-user populations. Client ``c`` is ``clients[c]``."""

    public: list[UserSplit]
    clients: list[UserSplit]
    new_users: list[UserSplit]
    seed: int
    meta: dict = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def identities(self, group: Group) -> np.ndarray:
        return np.asarray([u.identity for u in getattr(self, group)], dtype=np.int64)

    def pairs(self, group: Group, part: Part = "train") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flattened ``(identities, indices, owner)`` of one group's images.

        ``owner[i]`` is the position of the user within the group (the client number for
        ``"clients"``), handy as a class label for pre-training or as the client of a probe.
        """
        ids, idx, own = [], [], []
        for k, u in enumerate(getattr(self, group)):
            sel = {"train": [u.train], "test": [u.test], "warmup": [u.warmup_or_train],
                   "all": [u.train, u.test, u.warmup]}[part]
            for s in sel:
                ids.append(np.full(s.size, u.identity, dtype=np.int64))
                idx.append(s)
                own.append(np.full(s.size, k, dtype=np.int64))
        if not ids:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        return np.concatenate(ids), np.concatenate(idx), np.concatenate(own)

    def check_disjoint(self) -> None:
        """Raise if an identity is in two groups or an image in both train and test."""
        groups = [set(self.identities(g).tolist()) for g in ("public", "clients", "new_users")]
        if groups[0] & groups[1] or groups[0] & groups[2] or groups[1] & groups[2]:
            raise InputError("an identity appears in more than one of public/clients/new_users")
        for u in self.clients + self.new_users:
            if (np.intersect1d(u.train, u.test).size or np.intersect1d(u.warmup, u.test).size
                    or np.intersect1d(u.warmup, u.train).size):
                raise InputError(f"identity {u.identity} has an image in two of train/test/warm-up")

    def to_json(self) -> str:
        return json.dumps({"seed": self.seed, "meta": self.meta,
                           "public": [u.to_dict() for u in self.public],
                           "clients": [u.to_dict() for u in self.clients],
                           "new_users": [u.to_dict() for u in self.new_users]})

    @classmethod
    def from_json(cls, text: str) -> "FaceSplits":
        d = json.loads(text)
        return cls(public=[UserSplit.from_dict(x) for x in d["public"]],
                   clients=[UserSplit.from_dict(x) for x in d["clients"]],
                   new_users=[UserSplit.from_dict(x) for x in d["new_users"]],
                   seed=int(d["seed"]), meta=d.get("meta", {}))


def _split_fraction(n: int, test_fraction: float) -> tuple[int, int]:
    n_test = min(n - 1, max(1, int(round(n * test_fraction))))
    return n - n_test, n_test


def make_splits(source: int | IdentityDataset, num_public: int, num_clients: int, num_new: int = 0,
                train_per_client: int | None = 57, test_per_client: int | None = 13, seed: int = 0,
                public_images: int | None = None, test_fraction: float = 0.2,
                warmup_per_user: int = 0) -> FaceSplits:
    """Draw the public / client / new-user split.

    Args:
        source: the number of identities of an unbounded synthetic universe (every identity
            has as many images as asked for), or an :class:`IdentityDataset`.
        num_public, num_clients, num_new: group sizes (one identity per client / new user).
        train_per_client, test_per_client: fixed per-user image counts (FedFS DigiFace-1M:
            57/13). ``None`` for either → split each user's images ``1 − test_fraction`` /
            ``test_fraction`` (80/20, FedFS §4.1) — the mode for real folders, whose
            identities have different image counts.
        seed: seeds the identity permutation and the per-identity image shuffle.
        public_images: images per public identity for pre-training (``None``: all of a
            dataset's; ``train + test`` counts for a synthetic universe).
        test_fraction: the held-out share in fraction mode.
        warmup_per_user: fresh images per client / new user for FedUV's warm-up (fixed mode
            only: indices after train and test, so a synthetic identity just renders more;
            a dataset identity must have ``train + test + warmup`` images). 0 → warm-ups
            fall back to the training images (optimistic for participants, whose model
            has seen them).

    With fixed counts, only identities that have at least ``train + test`` images can be
    clients or new users; others may still be public. In fraction mode a user needs ≥ 2
    images. Image indices are shuffled per identity (seeded) before splitting, because real
    folders are often sorted by capture session; synthetic images are i.i.d. so the
    shuffle changes nothing statistically.
    """
    for name, v in (("num_public", num_public), ("num_clients", num_clients), ("num_new", num_new)):
        if not isinstance(v, (int, np.integer)) or v < 0:
            raise InputError(f"{name} must be a non-negative int, got {v!r}")
    if num_clients < 1:
        raise InputError("num_clients must be ≥ 1")
    fixed = train_per_client is not None and test_per_client is not None
    if warmup_per_user < 0 or (warmup_per_user and not fixed):
        raise InputError("warmup_per_user must be ≥ 0 and needs fixed train/test counts")
    if fixed and (train_per_client < 1 or test_per_client < 1):
        raise InputError(f"train_per_client and test_per_client must be ≥ 1, got {train_per_client}/{test_per_client}")
    if not 0.0 < test_fraction < 1.0:
        raise InputError(f"test_fraction must be in (0, 1), got {test_fraction}")

    if isinstance(source, (int, np.integer)):
        if not fixed:
            raise InputError("an 80/20 (fraction) split needs a dataset with image counts; for a synthetic "
                             "universe give train_per_client and test_per_client")
        total = int(source)
        counts = None
    else:
        total = int(source.num_identities)
        counts = np.asarray([source.count(i) for i in range(total)], dtype=np.int64)
    need = num_public + num_clients + num_new
    if total < need:
        raise InputError(f"need {need} identities ({num_public} public + {num_clients} clients + "
                         f"{num_new} new users) but the source has {total}")

    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    perm = rng.permutation(total)
    per_user = (train_per_client + test_per_client + warmup_per_user) if fixed else 2
    if counts is None:
        eligible = np.ones(total, dtype=bool)
    else:
        eligible = counts >= per_user
    user_pool = perm[eligible[perm]]
    n_users = num_clients + num_new
    if user_pool.size < n_users:
        what = (f"{train_per_client}+{test_per_client}" + (f"+{warmup_per_user}" if warmup_per_user else "")
                if fixed else "2")
        raise InputError(f"need {n_users} identities with ≥ {what} images for clients and new users, "
                         f"the source has {user_pool.size}")
    users = user_pool[:n_users]
    taken = np.zeros(total, dtype=bool)
    taken[users] = True
    rest = perm[~taken[perm]]
    # identities too small to be users fill the public places first (stable: the seeded order
    # is kept within each kind; a synthetic universe has none, so nothing changes there)
    public_ids = rest[np.argsort(eligible[rest], kind="stable")][:num_public]
    if public_ids.size < num_public:
        raise InputError(f"only {public_ids.size} identities left for {num_public} public identities")

    def user(identity: int) -> UserSplit:
        n = int(counts[identity]) if counts is not None else per_user
        order = np.random.default_rng(np.random.SeedSequence([seed, 0x1DE, int(identity)])).permutation(n) \
            if counts is not None else np.arange(n)
        if fixed:
            n_tr, n_te = train_per_client, test_per_client
        else:
            n_tr, n_te = _split_fraction(n, test_fraction)
        n_wu = warmup_per_user if fixed else 0
        return UserSplit(int(identity), np.sort(order[:n_tr]).astype(np.int64),
                         np.sort(order[n_tr:n_tr + n_te]).astype(np.int64),
                         np.sort(order[n_tr + n_te:n_tr + n_te + n_wu]).astype(np.int64))

    def public(identity: int) -> UserSplit:
        if counts is not None:
            n = int(counts[identity]) if public_images is None else min(public_images, int(counts[identity]))
        else:
            n = public_images if public_images is not None else train_per_client + test_per_client  # type: ignore[operator]
        return UserSplit(int(identity), np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64))

    splits = FaceSplits(public=[public(int(i)) for i in public_ids],
                        clients=[user(int(i)) for i in users[:num_clients]],
                        new_users=[user(int(i)) for i in users[num_clients:]],
                        seed=int(seed),
                        meta={"mode": "fixed" if fixed else "fraction", "warmup_per_user": warmup_per_user,
                              "train_per_client": train_per_client, "test_per_client": test_per_client,
                              "test_fraction": test_fraction, "source_identities": total})
    splits.check_disjoint()
    return splits


def iter_chunks(n: int, size: int) -> Iterable[slice]:
    """Slices covering ``range(n)`` in chunks of ``size`` (for batched evaluation)."""
    for a in range(0, n, size):
        yield slice(a, min(a + size, n))
