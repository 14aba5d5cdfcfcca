"""``app``: fedfs's device step as a Flower ``ClientApp`` (``fedfs_flower.client_app:app``).

On each train message: read the global model ``w`` (ArrayRecord ``arrays``) and the round's
settings (ConfigRecord ``config``: method, model config, fedfs training settings, this node's
``b_u``), run :func:`fedfs_flower.node.local_step` on the node's images with its device-state
folder, and reply with ``w_c`` (ArrayRecord) and ``|D_c|`` (MetricRecord ``num-examples``)
plus the loss metrics. ``θ_c``, ``r_u`` and the codeword stay in the state folder.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Mapping

import numpy as np

from fedfs_flower import require_flwr

require_flwr()

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedfs_sdk.errors import InputError  # noqa: E402

from .node import local_step  # noqa: E402
from .settings import NodeSettings  # noqa: E402
from .strategy import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, to_weights  # noqa: E402

ImagesFn = Callable[[Context], np.ndarray]


def create_app(run_config: Mapping[str, Any] | None = None, images_fn: ImagesFn | None = None) -> ClientApp:
    """A ClientApp whose run config is ``run_config`` over Flower's (the deprecated in-process
    ``flwr.simulation.run_simulation`` passes no run config; ``flwr run`` passes the project's).
    ``images_fn(context)``: the node's preprocessed images, instead of its image folder
    (benchmarks/peer_flower.py gives Flower the fedfs simulator's in-memory clients)."""
    client = ClientApp()
    overrides = dict(run_config or {})

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        return train(msg, context, {**context.run_config, **overrides}, images_fn)

    return client


def train(msg: Message, context: Context, run_config: Mapping[str, Any], images_fn: ImagesFn | None = None) -> Message:
    """One local round of the method the server's message names."""
    content = msg.content
    if ARRAYS not in content.array_records or CONFIG not in content.config_records:
        raise InputError("the train message has no 'arrays' / 'config' record: is the ServerApp "
                         "fedfs_flower.server_app:app?")
    cfg = content.config_records[CONFIG]
    method = str(cfg["method"])
    settings = NodeSettings.from_configs(run_config, context.node_config, method, need_data=images_fn is None)
    try:
        train_settings = json.loads(str(cfg.get("train", "{}")))
    except json.JSONDecodeError as e:
        raise InputError(f"the server's training settings are not JSON: {e}") from None
    base = cfg.get("base-vector")
    step = local_step(settings, method=method, model_config_json=str(cfg["model-config"]), train=train_settings,
                      base_vector=int(base) if base is not None else None,
                      global_weights=to_weights(content.array_records[ARRAYS]),
                      server_round=int(cfg["server-round"]), node_id=int(context.node_id),
                      run_id=int(context.run_id), neg_codewords=int(cfg.get("neg-codewords", 0)),
                      images=images_fn(context) if images_fn is not None else None)
    metrics = {NUM_EXAMPLES: int(step.num_samples)}
    metrics.update({k: float(v) for k, v in step.metrics.items()})
    reply = RecordDict({ARRAYS: ArrayRecord.from_torch_state_dict(step.weights), METRICS: MetricRecord(metrics)})
    return Message(content=reply, reply_to=msg)


app = create_app()

__all__ = ["app", "create_app", "train"]
