"""The models a device keeps built between rounds: ξ and its :class:`LocalTrainer`.

Every round a device used to rebuild ξ from its file and a fresh ``LocalTrainer`` (the global and
personalized FaceNets, each randomly initialized and then overwritten by the round's weights). For a
MobileFaceNet that construction — thousands of small Python-level module and ``kaiming_uniform_``
calls — cost more than the round's local training once the frozen trunk stopped running per step
(:mod:`.device_features`): in a 102-device rehearsal 40 % of the device threads' samples in a round
were ``load_checkpoint`` and 13 % ``LocalTrainer.__init__``, all of it holding the GIL.

Both are kept on the agent (the device's own object): ξ per (file, size, mtime) — ξ is frozen and
never written to by training — and the trainer per (model config, train config, ξ). Reuse gives the
same updates as a fresh trainer: :meth:`LocalTrainer.train` loads the global and personalized
weights strictly (every tensor) and builds its optimizer at every call.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

XI_ATTR = "_device_xi"
TRAINER_ATTR = "_device_trainer"


def device_xi(agent: Any, path: Path):
    """ξ (an eval-mode FaceNet) from ``path``, built once per file version and kept on ``agent``.
    Read-only: callers that change weights (``norm-adapt``) load their own copy."""
    from ..nn.checkpoint import load_checkpoint

    st = Path(path).stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    held = getattr(agent, XI_ATTR, None)
    if held is None or held[0] != key:
        held = (key, load_checkpoint(path)[0])
        setattr(agent, XI_ATTR, held)
    return held[1]


def device_trainer(agent: Any, config: Any, train_cfg: Any, xi: Any):
    """The agent's :class:`~fedfs_sdk.training.trainer.LocalTrainer` for this round's model config,
    train config and ξ (rebuilt when any of them changes)."""
    from ..training.trainer import LocalTrainer

    key = (config.to_json(), repr(train_cfg), id(xi))
    held = getattr(agent, TRAINER_ATTR, None)
    if held is None or held[0] != key or held[2] is not xi:
        held = (key, LocalTrainer(config, train_cfg, xi), xi)
        setattr(agent, TRAINER_ATTR, held)
    return held[1]


__all__ = ["device_xi", "device_trainer"]
