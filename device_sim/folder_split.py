"""Folder-friendly split sizes: how a folder of real photos is divided when the user gives
only ``--data DIR``.

SynthFaces is an unbounded universe, so its defaults (300 public identities, 100 clients, 20
new users, 20 + 10 images each) are counts. A folder has what it has — 40 people × 10 photos
is typical — so its defaults are *shares* of the folder (FedFS §4.1's per-identity 80/20
split, one client per identity):

* **public** (ξ is pre-trained on them, FedFS §4.1): 25 % of the identities (at least 2: a
  margin loss needs two classes) when ξ comes from this folder; 0 when ``--pretrain-data``
  names another source (``--scenario synth-to-folder`` / ``folder-to-folder``). The share
  does not depend on ``--pretrained``, so a ξ written by ``fedfs pretrain --data DIR`` was
  trained on exactly the public identities ``fedfs simulate --data DIR`` holds out;
* **new users** (FedUV's never-trained set): 10 % of the identities (0 below 10);
* **clients**: every remaining identity with enough images (≥ 2 for 80/20);
* images: 80/20 train/test per identity unless ``--train-per-client`` fixes counts.

An explicit flag always wins; when explicit flags cannot be met the error is one line that
names the flag to change. Identities the split leaves out are named with the reason
(:func:`unused_identities`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedfs_sdk.runtime.enrollment import min_warmup_images
from fedfs_sdk.errors import InputError

from .datasets import SkippedIdentity
from .experiment import DataConfig
from .splits import FaceSplits

PUBLIC_SHARE = 0.25
NEW_USER_SHARE = 0.10


@dataclass
class FolderPlan:
    """Group sizes and per-user image counts for :func:`device_sim.splits.make_splits`."""

    public: int
    clients: int
    new_users: int
    train: int | None          # None: 80/20 of each identity
    test: int | None
    per_user: int              # images a client / new user needs
    notes: list[str] = field(default_factory=list)


def _given(v: int | None) -> bool:
    return v is not None


def plan_folder_split(counts: np.ndarray, data: DataConfig, pretrain_here: bool) -> FolderPlan:
    """The split sizes for a folder with ``counts[i]`` usable images per identity.

    ``data``: the run's resolved data settings. ``pretrain_here``: ξ is pre-trained on this
    folder's public identities (no other ``--pretrain-data``). Raises :class:`InputError` — one
    line naming the flag — when the given flags cannot be met."""
    n = int(counts.size)
    warm = int(data.warmup_per_client or 0)
    fixed = _given(data.train_per_client) and data.train_per_client > 0
    if fixed:
        train = int(data.train_per_client)
        test = int(data.test_per_client) if _given(data.test_per_client) and data.test_per_client > 0 \
            else max(1, round(train / 4))
        per_user = train + test + warm
    else:
        if warm:
            raise InputError("--warmup-per-client needs fixed image counts: also pass --train-per-client N "
                             "(and --test-per-client M)")
        train = test = None
        per_user = 2
    eligible = int((counts >= per_user).sum())
    median = int(np.median(counts)) if n else 0
    if fixed and eligible < 2:
        raise InputError(f"--train-per-client {train} --test-per-client {test}"
                         + (f" --warmup-per-client {warm}" if warm else "")
                         + f" need {per_user} images per identity; {eligible} of the folder's {n} identities have "
                           f"that many (median {median}): pass --train-per-client 0 (80/20 split of each identity)")
    if _given(data.public):
        public = int(data.public)
    else:
        public = max(2, round(PUBLIC_SHARE * n)) if pretrain_here else 0
    new = int(data.new_users) if _given(data.new_users) else (round(NEW_USER_SHARE * n) if n >= 10 else 0)
    for flag, v in (("--public", public), ("--new-users", new)):
        if v < 0:
            raise InputError(f"{flag} must be ≥ 0, got {v}")
    room = min(eligible - new, n - public - new)
    why = (f"the folder has {n} usable identities ({eligible} with ≥ {per_user} images)"
           f" and {public} are public, {new} new users")
    if _given(data.clients) and data.clients > 0:
        clients = int(data.clients)
        if clients > room:
            raise InputError(f"--clients {clients} does not fit: {why}, which leaves {max(room, 0)}; lower --clients "
                             f"(or pass --clients 0: every identity that fits)")
    else:
        if _given(data.clients) and data.clients < 0:
            raise InputError(f"--clients must be ≥ 0 (0: every identity that fits), got {data.clients}")
        clients = room
    if clients < 2:
        given = [f for f, v in (("--public", data.public), ("--new-users", data.new_users)) if _given(v)]
        fix = f"lower {' / '.join(given)}" if given else "add identity folders (each person a sub-folder)"
        raise InputError(f"too few clients ({max(clients, 0)}; a client's impostors are the other clients, so ≥ 2 "
                         f"are needed): {why}; {fix}")
    notes = [f"split of the folder: {public} public identities (ξ), {clients} clients, {new} new users; "
             + (f"{train} train + {test} test images per client" if fixed else "80/20 train/test images per identity")
             + (f" + {warm} warm-up" if warm else "")]
    if not pretrain_here and not _given(data.public):
        notes.append("no public identities held out: ξ is pre-trained elsewhere (--pretrain-data, or a built-in ξ)")
    return FolderPlan(public, clients, new, train, test, per_user, notes)


def unused_identities(names: list[str], counts: np.ndarray, splits: FaceSplits,
                      per_user: int) -> list[SkippedIdentity]:
    """Identities of the folder that are in none of the groups, each with the reason."""
    used = set(splits.identities("public").tolist()) | set(splits.identities("clients").tolist()) \
        | set(splits.identities("new_users").tolist())
    out = []
    for i, name in enumerate(names):
        if i in used:
            continue
        c = int(counts[i])
        if c < per_user:
            why = f"{c} image(s): a client or new user needs ≥ {per_user}" + (
                " (one to train, one to test)" if per_user == 2 else "") + (
                f"; all {len(splits.public)} public places were taken" if splits.public
                else "; there are no public places (ξ is not pre-trained on this folder)")
        else:
            why = "not needed: --clients / --public / --new-users are all taken"
        out.append(SkippedIdentity(name, why))
    return out


def auto_warmup_q(splits: FaceSplits, default: float = 0.9) -> tuple[float, str | None]:
    """The warm-up target TPR ``q`` the clients' warm-up images allow (FedUV Alg. 2 needs
    ``⌈1/(1−q)⌉`` of them): ``default`` if the median client has that many, else the largest
    ``q = 1 − 1/m`` for the median count ``m`` (not below 0.5). Returns ``(q, note)``."""
    sizes = [u.warmup_or_train.size for u in splits.clients + splits.new_users]
    if not sizes:
        return default, None
    m = int(np.median(sizes))
    need = min_warmup_images(default)
    if m >= need:
        return default, None
    q = 1.0 - 1.0 / m if m >= 2 else default
    if m >= 2 and min_warmup_images(q) > m:     # 1 − 1/m rounded up in floating point
        q = float(np.nextafter(q, 0.0))
    if q < 0.5:
        return default, (f"warm-up q = {default}: the clients have {m} warm-up images (median), fewer than the "
                         f"{need} it needs, so the warm-up columns are empty; give each identity more images")
    return q, (f"warm-up q = {q:.4g}: the largest target TPR the clients' {m} warm-up images (median) allow "
               f"(q = {default} needs ⌈1/(1−q)⌉ = {need}); set --q to choose")


__all__ = ["FolderPlan", "plan_folder_split", "unused_identities", "auto_warmup_q", "PUBLIC_SHARE", "NEW_USER_SHARE"]
