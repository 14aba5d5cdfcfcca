"""ξ's trunk features, computed once per image for every ``scope="top"`` method of a run.

With ``scope="top"`` (:mod:`fedfs_sdk.training.scope`) the trunk is ξ's for ξ, the global and
every personalized model, so an image's trunk features never change during a simulation:
they are cached here, keyed by the image's bytes (the first 16 bytes of a SHA-1 digest of the float32 tensor —
identical images share an entry, different ones do not), and shared by every method that
runs on the same ξ (one cache per trunk module). A pure speed-up: the same tensors the trunk
would return (tested). Under ``vmap`` (the batched executor) images are not concrete tensors
and the trunk simply runs.

**Kept between runs** (issue 31, :meth:`TrunkCache.persist`): ``fedfs simulate`` keeps the run's
trunk features in ``$FEDFS_CACHE_DIR/trunk`` (``--cache-dir DIR`` → ``DIR/trunk``), one file
per trunk — keyed by the sha256 of ξ's weights, torch's version, the device type and
:data:`TRUNK_CODE_VERSION` — so a second run, seed or method list on the same photos runs ξ's
trunk on none of them (a folder's faces are found once the same way, :mod:`.face_cache`). The
file is rewritten whole (a temporary file renamed over it, merged with what another run wrote
meanwhile) and carries a checksum: a torn or edited file is ignored and rebuilt. The features
are the trunk's outputs for those photos, bit for bit (a warm run's table is the cold run's).
"""
from __future__ import annotations

import hashlib
import io
import os
import weakref
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from fedfs_sdk.fileio import atomic_write_bytes
from fedfs_sdk.training.scope import Trunk

from .memory import forward_batch

_CACHES: "weakref.WeakKeyDictionary[torch.nn.Module, TrunkCache]" = weakref.WeakKeyDictionary()
TRUNK_CODE_VERSION = "31.3"
"""Bump when what the trunk computes for the same weights changes (the persisted files' key)."""


def _is_concrete(x: torch.Tensor) -> bool:
    try:        # any functorch wrapper (vmap's BatchedTensor, grad's GradTrackingTensor around it …)
        from torch._C._functorch import is_functorch_wrapped_tensor

        return not is_functorch_wrapped_tensor(x)
    except ImportError:     # pragma: no cover — older torch: never cache
        return False


class TrunkCache:
    """Trunk features of images by content (LRU of at most ``max_entries`` images). Missing
    images run through the trunk ``batch_size`` at a time — fewer on CPU, where
    :func:`~device_sim.memory.forward_batch` caps the batch for speed."""

    def __init__(self, backbone: torch.nn.Module, max_entries: int = 200_000, batch_size: int = 64) -> None:
        self.trunk = Trunk(backbone).eval().requires_grad_(False)
        self.max_entries, self.batch_size = int(max_entries), int(batch_size)
        self._d: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0
        self.file: Path | None = None       # where persist() keeps the features between runs
        self.loaded = 0                     # entries read from it
        self._new: set[bytes] = set()       # entries computed since the last flush()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Trunk features of ``x`` ``[N, 3, S, S]`` (on ``x``'s device)."""
        if not _is_concrete(x):
            # inside vmap/grad: the trunk's weights need no gradient, no graph is built. Never move the
            # module here (Module.to under a functorch transform would leave wrapped tensors in it)
            return self.trunk(x)
        with torch.no_grad():
            return self._cached(x)

    def _cached(self, x: torch.Tensor) -> torch.Tensor:
        dev = next(self.trunk.parameters()).device      # where ξ lives (the method moved it)
        if x.shape[0] == 0:
            return self.trunk(x.to(dev)).to(x.device)
        cpu = x.detach().to("cpu", torch.float32).contiguous()
        # SHA-1, not BLAKE2: it was an eighth of a warm whole-folder run (each 150-px chip is 270 kB),
        # and OpenSSL's SHA-1 runs ~5× faster on x86 with SHA extensions. A key of the user's own
        # photos in a local cache, not a signature: no adversary chooses colliding chips.
        keys = [hashlib.sha1(cpu[i].numpy().data).digest()[:16] for i in range(cpu.shape[0])]
        missing = [i for i, k in enumerate(keys) if k not in self._d]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        # on CPU a smaller batch than a GPU's is faster per image (device_sim.memory.forward_batch)
        bs = forward_batch(self.trunk, int(x.shape[-1]), dev, self.batch_size) if missing else self.batch_size
        for a in range(0, len(missing), bs):
            part = missing[a:a + bs]
            feats = self.trunk(cpu[part].to(dev)).to("cpu")
            for i, f in zip(part, feats):
                self._d[keys[i]] = f.clone()
                self._new.add(keys[i])
        out = torch.stack([self._d[k] for k in keys])
        for k in keys:
            self._d.move_to_end(k)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)
        return out.to(x.device)


    # ---- between runs --------------------------------------------------------------------
    def persist(self, root: str | os.PathLike[str], device: str = "cpu") -> Path:
        """Keep this trunk's features under ``root`` between runs: read what an earlier run kept
        (:meth:`flush` writes). Returns the file."""
        h = hashlib.sha256()
        for name, t in sorted(self.trunk.state_dict().items()):
            t = t.detach().to("cpu").contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
        h.update(f"torch {torch.__version__}|{torch.device(device).type}|code {TRUNK_CODE_VERSION}".encode())
        self.file = Path(root) / f"{h.hexdigest()[:40]}.npz"
        keys, feats = _read(self.file)
        for k, f in zip(keys, feats):
            kb = k.tobytes()
            if kb not in self._d:
                self._d[kb] = torch.from_numpy(f.copy())
        self.loaded = len(keys)
        return self.file

    def flush(self) -> int:
        """Write the features computed since the last flush (merged with the file as it is now:
        another run may have added to it). Returns how many entries the file holds."""
        if self.file is None or not self._new:
            return 0
        keys, feats = _read(self.file)
        have = {k.tobytes() for k in keys}
        new = [k for k in self._new if k in self._d and k not in have]
        if new:
            keys = np.concatenate([keys.reshape(-1, 16), np.frombuffer(b"".join(new), np.uint8).reshape(-1, 16)])
            add = torch.stack([self._d[k] for k in new]).numpy().astype(np.float32)
            feats = np.concatenate([feats.reshape(-1, add.shape[1]) if feats.size else feats.reshape(0, add.shape[1]),
                                    add])
            _write(self.file, keys, feats)
        self._new.clear()
        return int(keys.shape[0])


def _checksum(keys: np.ndarray, feats: np.ndarray) -> np.ndarray:
    h = hashlib.sha256(np.ascontiguousarray(keys).tobytes())
    h.update(f"{feats.shape}".encode())
    h.update(np.ascontiguousarray(feats).tobytes())
    return np.frombuffer(h.digest(), np.uint8)


def _read(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(keys [N, 16] uint8, features [N, F] float32)`` of a persisted file; empty when it is
    missing, unreadable or fails its checksum (then it is rebuilt by the next flush)."""
    empty = (np.zeros((0, 16), np.uint8), np.zeros((0, 0), np.float32))
    try:
        with np.load(path, allow_pickle=False) as z:
            keys, feats, check = z["keys"], z["features"], z["sha256"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return empty
    ok = (keys.ndim == 2 and keys.shape[1] == 16 and keys.dtype == np.uint8 and feats.ndim == 2
          and feats.dtype == np.float32 and feats.shape[0] == keys.shape[0]
          and np.array_equal(check, _checksum(keys, feats)))
    return (keys, feats) if ok else empty


def _write(path: Path, keys: np.ndarray, feats: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, keys=keys, features=feats, sha256=_checksum(keys, feats))
    atomic_write_bytes(path, buf.getvalue(), durable=False)        # a lost or torn file is rebuilt


_BY_TRUNK: "weakref.WeakKeyDictionary[torch.nn.Module, TrunkCache]" = weakref.WeakKeyDictionary()


def trunk_cache(backbone: torch.nn.Module) -> TrunkCache:
    """The cache of ``backbone``'s trunk (ξ's), shared by every method holding that module."""
    cache = _CACHES.get(backbone)
    if cache is None:
        cache = _CACHES[backbone] = TrunkCache(backbone)
        _BY_TRUNK[cache.trunk] = cache
    return cache


def cache_of(module: torch.nn.Module | None) -> TrunkCache | None:
    """The :class:`TrunkCache` whose ``trunk`` is ``module`` (a method's
    :meth:`~device_sim.methods.base.FederatedMethod.frozen_stem`), or None: the federation's
    stem outputs then come from — and go into — the run's one cache of that trunk, so evaluation
    and the do-no-harm checks do not run the trunk again on the training images (issue 31)."""
    return _BY_TRUNK.get(module) if module is not None else None


def default_trunk_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``DIR/trunk`` for ``--cache-dir DIR``, else ``$FEDFS_CACHE_DIR/trunk`` (``~/.cache/fedfs/trunk``)."""
    if cache_dir:
        return Path(cache_dir) / "trunk"
    return Path(os.environ.get("FEDFS_CACHE_DIR", Path.home() / ".cache" / "fedfs")) / "trunk"


def persistent_trunk_cache(xi: torch.nn.Module, cache_dir: str | os.PathLike[str] | None = None,
                           device: str = "cpu") -> TrunkCache | None:
    """The run's cache of ξ's trunk (``xi`` a FaceNet), kept between runs under
    :func:`default_trunk_cache_dir`; None when ξ's backbone does not split into trunk + top."""
    from fedfs_sdk.errors import InputError

    try:
        cache = trunk_cache(getattr(xi, "backbone", xi))
    except InputError:
        return None
    if cache.file is None:
        cache.persist(default_trunk_cache_dir(cache_dir), device)
    return cache


__all__ = ["TrunkCache", "trunk_cache", "cache_of", "persistent_trunk_cache", "default_trunk_cache_dir",
           "TRUNK_CODE_VERSION"]
