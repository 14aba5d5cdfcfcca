"""The federation's tail in the automatic statistics rounds (issue 29): a device's ``xi.tail``
contribution (the published sum its ``enroll(far=…)`` reads: :func:`~.device_stats.published_far_stats`).

``enroll(far=…)`` in the federation's conditions (:mod:`fedfs_sdk.stats.evidence`) needs two published
sums: ξ's trunk-feature moments (``xi.features``, the first automatic round) and the tail histograms
(``xi.tail``, :mod:`fedfs_sdk.stats.tail`): for each public person of the set the server ships, how many
of the devices' photos score in each bin against that person's template under ξ, the template moved
into the federation's conditions with the published feature moments (every device computes the same
directions from public things). The server asks for ``xi.tail`` in its check-results round, once per ξ
(``server_agg/stats_auto.py``), so a device that enrolls with ``--far`` needs no hand-made statistics
file (``--far-stats`` still overrides).

Both runtimes compute it from ξ's trunk and top: the torch runtime from ξ's checkpoint, the ONNX runtime
from its export's ``trunk.onnx`` and ``onnx/top.onnx`` (:mod:`.ort_check`). Only the owner's training
photos (the hold-out excluded, the first ``max_photos``) are scored; the contribution is a sum's
addend under secure aggregation like every other statistic.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import InputError
from ..stats.evidence import tail_directions
from ..stats.tail import tail_histogram

Fn = Callable[[np.ndarray], np.ndarray]


def xi_graphs(agent: Any, xi_file: Path, xi_sha: str) -> tuple[Fn, Fn, int]:
    """``(trunk, top, input size)`` of ξ on this device's runtime: preprocessed images → trunk features,
    trunk features → ξ's embeddings."""
    from .device_runtime import TorchRuntime

    if isinstance(agent.runtime, TorchRuntime):
        from ..nn.model import VerifierNet
        from ..stats.evidence import torch_top, torch_trunk
        from .device_models import device_xi

        xi = VerifierNet(device_xi(agent, xi_file).backbone).eval()     # the agent's kept ξ (read-only)
        top = torch_top(xi)
        return torch_trunk(xi), lambda f: top(f)["embedding"], int(xi.input_size)
    if not hasattr(agent.runtime, "trunk_features"):
        raise InputError(f"the {agent.runtime.name} runtime cannot run ξ's trunk and top")
    from .ort_check import _no_trunk, xi_top, xi_trunk_artifact

    rt = agent.runtime
    art = xi_trunk_artifact(rt, xi_sha)
    if art is None:
        raise _no_trunk(rt.root, xi_sha)
    return (lambda x: rt.trunk_features(art, x)), xi_top(rt, xi_file), int(art.input_size)


def impostors_of(agent: Any, sha: str):
    """The public impostor set ``sha`` (the one the server ships: downloaded once, hash-checked, kept in
    the state; or the device's ``--impostors`` when it is that set)."""
    from ..fileio import atomic_write_bytes
    from ..runtime.impostors import load_impostors
    from .wire_format import sha256_hex

    given = agent.config.impostors
    if given is not None and sha256_hex(Path(given).read_bytes()) == sha:
        return load_impostors(given)
    path = agent.state.file("impostors.npz")
    if not (path.is_file() and sha256_hex(path.read_bytes()) == sha):
        atomic_write_bytes(path, agent.client.download_impostors(sha))
        path.chmod(0o600)
    return load_impostors(path)


def public_features(agent: Any, impostors: Any, size: int, trunk: Fn, xi_sha: str) -> np.ndarray:
    """ξ's trunk features of the public set: the torch runtime's from the process's shared store
    (:mod:`.public_trunk`, the entry its enrollment reads too), the ONNX runtime's from ``trunk`` (its
    runtime keeps them for the enrollment)."""
    from .device_runtime import TorchRuntime

    batch = impostors.batch(size)
    if not isinstance(agent.runtime, TorchRuntime):
        return trunk(batch)
    from .device_models import device_xi
    from .public_trunk import PUBLIC_TRUNK

    chunks = PUBLIC_TRUNK.features(xi_sha, device_xi(agent, agent.xi_file(xi_sha)), f"{impostors.digest()}@{size}",
                                   lambda: batch)
    return np.concatenate([c.double().numpy() for c in chunks])


def tail_contribution(agent: Any, task: Any, length: int, features_sum: np.ndarray) -> np.ndarray:
    """This device's ``xi.tail`` for ``task``: its training photos' ξ-embedding scores against the
    public people's templates moved into the federation's conditions (``features_sum``: the published
    ``xi.features`` of this ξ), binned (``length`` = directions × bins, checked). :class:`InputError`
    when something it needs is missing (the device then sits the round out)."""
    extra = task.extra or {}
    xi_sha, imp_sha = extra.get("xi_sha256"), extra.get("impostors_sha256")
    if not xi_sha or not imp_sha:
        raise InputError("the round asks for xi.tail but names no ξ or public impostor set (xi_sha256, impostors_sha256)")
    impostors = impostors_of(agent, imp_sha)
    if impostors.identity is None:
        raise InputError("the round's public impostor set names no people: it has no tail directions")
    trunk, top, size = xi_graphs(agent, Path(agent.xi_file(xi_sha)), xi_sha)
    dirs = tail_directions(public_features(agent, impostors, size, trunk, xi_sha), impostors.identity, top,
                           np.asarray(features_sum))
    own = agent.all_images_array(size)[agent.holdout_split()[0]]
    hist = tail_histogram(top(trunk(own)), dirs, task.max_photos)
    if hist.size != length:
        raise InputError(f"xi.tail: the round expects {length} numbers, this device's public set gives "
                         f"{hist.size} ({dirs.shape[0]} directions)")
    return hist


__all__ = ["xi_graphs", "impostors_of", "public_features", "tail_contribution"]
