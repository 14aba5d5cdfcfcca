"""A federation's population: a dataset plus its public / client / new-user split.

Adapts :class:`~device_sim.datasets.IdentityDataset` + :class:`~device_sim.splits.FaceSplits`
to what the round loop (:class:`~device_sim.federation.ClientData`) and the evaluation
need: client ``c``'s local training images, its held-out test images, and the new users'
images. Client ``c`` is ``splits.clients[c]``; new user ``j`` is ``splits.new_users[j]``.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from fedfs_sdk.errors import InputError

from .datasets import IdentityDataset
from .splits import FaceSplits


class Population:
    """Clients (one identity each) and new users of one dataset split."""

    def __init__(self, dataset: IdentityDataset, splits: FaceSplits) -> None:
        self.dataset, self.splits = dataset, splits
        self.num_clients = splits.num_clients
        self.num_new_users = len(splits.new_users)
        self.image_size = int(dataset.image_size)

    def _user(self, group: str, k: int):
        users = getattr(self.splits, group)
        if not 0 <= k < len(users):
            raise InputError(f"unknown {group[:-1].replace('_', ' ')} {k} (there are {len(users)})")
        return users[k]

    @staticmethod
    def _load(dataset: IdentityDataset, identity: int, idx: np.ndarray, device) -> torch.Tensor:
        x = dataset.images(identity, idx)
        return x if device is None else x.to(device)

    def train_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor:
        """Client ``client``'s local training images ``[n_c, 3, S, S]``."""
        u = self._user("clients", client)
        return self._load(self.dataset, u.identity, u.train, device)

    def test_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor:
        """Client ``client``'s held-out images (never trained on)."""
        u = self._user("clients", client)
        return self._load(self.dataset, u.identity, u.test, device)

    def warmup_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor | None:
        """Client ``client``'s fresh warm-up images (FedUV Alg. 2), or None when the split drew
        none (the warm-up then scores the training images)."""
        u = self._user("clients", client)
        return self._load(self.dataset, u.identity, u.warmup, device) if u.warmup.size else None

    def new_user_images(self, user: int, part: str = "all", device: str | torch.device | None = None) -> torch.Tensor:
        """New user ``user``'s images: ``train`` (warm-up), ``test`` or ``all``."""
        u = self._user("new_users", user)
        idx = {"train": u.train, "test": u.test, "all": np.concatenate([u.train, u.test])}[part]
        return self._load(self.dataset, u.identity, idx, device)

    def test_pairs(self, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(identities, image indices, client)`` of the test images of ``clients`` (no loading)."""
        ids, idx, own = [], [], []
        for c in np.asarray(clients).tolist():
            u = self._user("clients", c)
            ids.append(np.full(u.test.size, u.identity))
            idx.append(u.test)
            own.append(np.full(u.test.size, c))
        if not ids:
            z = np.zeros(0, np.int64)
            return z, z, z
        return np.concatenate(ids), np.concatenate(idx), np.concatenate(own)

    def images(self, identities: np.ndarray, indices: np.ndarray,
               device: str | torch.device | None = None) -> torch.Tensor:
        """Images of ``(identities[i], indices[i])`` pairs."""
        if len(identities) == 0:
            return torch.zeros(0, 3, self.image_size, self.image_size)
        x = self.dataset.batch(identities, indices)
        return x if device is None else x.to(device)

    def fingerprint(self) -> dict[str, str]:
        """sha256 digests of the dataset (its ``fingerprint()``)
        and of the split (every identity and image index of every group): a federation
        checkpoint records them so a resume on other data is refused."""
        return {"dataset": str(self.dataset.fingerprint()),
                "splits": hashlib.sha256(self.splits.to_json().encode()).hexdigest()}

    def num_train(self, client: int) -> int:
        return int(self._user("clients", client).train.size)


__all__ = ["Population"]
