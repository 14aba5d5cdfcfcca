"""A federation's population: a dataset plus its public / client / new-user split.

Adapts :class:`~device_sim.datasets.IdentityDataset` + :class:`~device_sim.splits.FaceSplits`
to what the round loop (:class:`~device_sim.federation.ClientData`) and the evaluation
need: client ``c``'s local training images, its held-out test images, and the new users'
images. Client ``c`` is ``splits.clients[c]``; new user ``j`` is ``splits.new_users[j]``.

With an image store (:meth:`Population.use_image_store`, ``--data-cache``) every client image
is produced once on the training device and read from the store afterwards — by the round
loop (:meth:`train_chunk`, uint8 per chunk) and by the evaluation (train / test / warm-up
images, the impostor pool) alike. Without one, images come from the dataset on demand.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from fedfs_sdk.errors import InputError

from .datasets import IdentityDataset
from .image_cache import normalize
from .image_store import PARTS, CachePlan, ClientImageStore
from .splits import FaceSplits


class Population:
    """Clients (one identity each) and new users of one dataset split."""

    def __init__(self, dataset: IdentityDataset, splits: FaceSplits) -> None:
        self.dataset, self.splits = dataset, splits
        self.num_clients = splits.num_clients
        self.num_new_users = len(splits.new_users)
        self.image_size = int(dataset.image_size)
        self.store: ClientImageStore | None = None

    def use_image_store(self, plan: CachePlan) -> ClientImageStore:
        """Serve the clients' images from a :class:`ClientImageStore` kept as ``plan`` says
        (from :func:`~device_sim.image_store.plan_data_cache`)."""
        self.store = ClientImageStore(self.dataset, self.splits.clients, plan)
        return self.store

    def image_store_bytes(self) -> int:
        """Bytes of every client's train, test and warm-up images as uint8 (a full store)."""
        n = sum(u.train.size + u.test.size + u.warmup.size for u in self.splits.clients)
        return int(n) * 3 * self.image_size ** 2

    def _user(self, group: str, k: int):
        users = getattr(self.splits, group)
        if not 0 <= k < len(users):
            raise InputError(f"unknown {group[:-1].replace('_', ' ')} {k} (there are {len(users)})")
        return users[k]

    @staticmethod
    def _load(dataset: IdentityDataset, identity: int, idx: np.ndarray, device) -> torch.Tensor:
        x = dataset.images(identity, idx)
        return x if device is None else x.to(device)

    def _client_part(self, client: int, part: str, device: str | torch.device | None) -> torch.Tensor:
        u = self._user("clients", client)
        if self.store is None:
            return self._load(self.dataset, u.identity, getattr(u, part), device)
        u8, _ = self.store.images([client], part, device=device if device is not None else "cpu")
        return normalize(u8)

    def train_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor:
        """Client ``client``'s local training images ``[n_c, 3, S, S]`` (float32, normalized)."""
        return self._client_part(client, "train", device)

    def train_chunk(self, clients: np.ndarray | list[int], device: str | torch.device | None = None) -> list[torch.Tensor]:
        """The training images of a chunk of clients, as uint8 ``[n_c, 3, S, S]`` per client
        on ``device`` — views of one tensor gathered (or produced) at once. The round loop
        normalizes them where they train (:func:`device_sim.image_cache.normalize`)."""
        cl = np.asarray(clients, dtype=np.int64).reshape(-1)
        users = [self._user("clients", int(c)) for c in cl]
        if self.store is not None:
            u8, counts = self.store.images(cl, "train", device=device)
        else:
            counts = [int(u.train.size) for u in users]
            ids = np.repeat([u.identity for u in users], counts).astype(np.int64)
            idx = np.concatenate([u.train for u in users]) if users else np.zeros(0, np.int64)
            fn = getattr(self.dataset, "batch_uint8", None)
            u8 = fn(ids, idx) if fn is not None else \
                torch.round(self.dataset.batch(ids, idx) * 127.5 + 127.5).to(torch.uint8)
            u8 = u8 if device is None else u8.to(device)
        return list(torch.split(u8, counts))

    def reference_train_images(self, client: int) -> torch.Tensor:
        """Client ``client``'s training images straight from the dataset on its own device
        (CPU for SynthFaces), whatever the store: what a checkpoint's data fingerprint hashes,
        so a run rendered on CUDA (±1 level in rare pixels) resumes on the CPU and back."""
        u = self._user("clients", client)
        return self._load(self.dataset, u.identity, u.train, None)

    def test_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor:
        """Client ``client``'s held-out images (never trained on)."""
        return self._client_part(client, "test", device)

    def warmup_images(self, client: int, device: str | torch.device | None = None) -> torch.Tensor | None:
        """Client ``client``'s fresh warm-up images (FedUV Alg. 2), or None when the split drew
        none (the warm-up then scores the training images)."""
        u = self._user("clients", client)
        return self._client_part(client, "warmup", device) if u.warmup.size else None

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

    def images(self, identities: np.ndarray, indices: np.ndarray, device: str | torch.device | None = None,
               clients: np.ndarray | None = None) -> torch.Tensor:
        """Images of ``(identities[i], indices[i])`` pairs. With ``clients`` (the client each
        pair belongs to, as :meth:`test_pairs` gives) and a store, read through the store."""
        if len(identities) == 0:
            return torch.zeros(0, 3, self.image_size, self.image_size, device=device)
        if self.store is None or clients is None:
            x = self.dataset.batch(identities, indices)
            return x if device is None else x.to(device)
        dev = device if device is not None else "cpu"
        where = [self._locate(int(c), int(i)) for c, i in zip(np.asarray(clients), np.asarray(indices))]
        out = torch.empty((len(where), 3, self.image_size, self.image_size), device=dev)
        for part in PARTS:
            sel = [k for k, (p, _) in enumerate(where) if p == part]
            if sel:
                u8, _ = self.store.images([int(clients[k]) for k in sel], part,
                                          positions=[np.array([where[k][1]]) for k in sel], device=dev)
                out[torch.as_tensor(sel, device=out.device)] = normalize(u8)
        return out

    def _locate(self, client: int, index: int) -> tuple[str, int]:
        """(part, position) of dataset image ``index`` among client ``client``'s images."""
        u = self._user("clients", client)
        for part in PARTS:
            hit = np.flatnonzero(getattr(u, part) == index)
            if hit.size:
                return part, int(hit[0])
        raise InputError(f"image {index} is not one of client {client}'s images")

    def fingerprint(self) -> dict[str, str]:
        """sha256 digests of the dataset (its ``fingerprint()``)
        and of the split (every identity and image index of every group): a federation
        checkpoint records them so a resume on other data is refused."""
        return {"dataset": str(self.dataset.fingerprint()),
                "splits": hashlib.sha256(self.splits.to_json().encode()).hexdigest()}

    def num_train(self, client: int) -> int:
        return int(self._user("clients", client).train.size)


__all__ = ["Population"]
