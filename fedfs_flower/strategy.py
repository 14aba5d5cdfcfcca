"""The server step of fedfs's methods as a Flower ``Strategy``.

:class:`FedFSStrategy` is Flower's message-based ``FedAvg`` with two changes:

* **Aggregation** — FedFS Eq. 1 / FedUV Alg. 1 ``w ← Σ_c |D_c| w_c / Σ_c |D_c|`` computed by
  fedfs's own :class:`server_agg.aggregate.StreamingFedAvg` (float64 running sums, one
  rounding to float32 at the end), so the global model is bit-for-bit what fedfs's
  aggregation server publishes for the same updates. Flower's ``aggregate_arrayrecords``
  sums in the arrays' own dtype, which differs in the last bits. A reply whose layout,
  ``|D_c|`` or values are invalid is dropped from the average (as fedfs's server refuses such
  an upload) instead of ending the run.
* **FedUV base vectors** — each node gets a unique random 32-bit ``b_u`` the first time it is
  sampled (``secrets.randbits``, as ``server_agg.rounds`` draws it at registration) and the
  same one in every later round; it travels in the node's own ``ConfigRecord``. The node
  draws ``r_u`` itself; the server never learns the codeword.

Every train message also carries the method, the model config and fedfs's training settings
(the JSON of a fedfs round task's ``train``), so one ClientApp serves any method.
"""
from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedfs_sdk.runtime.codes import BASE_BITS
from fedfs_sdk.errors import InputError
from fedfs_sdk.fileio import atomic_write_bytes
from fedfs_sdk.federation.wire import check_finite, encode_weights
from server_agg.aggregate import StreamingFedAvg, check_num_samples

from .node import weights_digest

log = logging.getLogger("fedfs_flower")

ARRAYS, CONFIG, METRICS = "arrays", "config", "metrics"
NUM_EXAMPLES = "num-examples"
"""The MetricRecord key holding ``|D_c|`` (Flower's FedAvg default ``weighted_by_key``)."""

Weights = dict[str, torch.Tensor]


def to_weights(record: ArrayRecord) -> Weights:
    """An ArrayRecord as a torch state dict (copies: Flower's buffers may be read-only)."""
    return {k: t.clone() for k, t in record.to_torch_state_dict().items()}


class FedFSStrategy(FedAvg):
    """Weighted FedAvg with fedfs's float64 aggregation and FedUV base-vector assignment.

    Args:
        method: ``fedfs``, ``feduv`` or ``fedfs+feduv`` (sent to the nodes).
        model_config_json: the global model's :class:`fedfs_sdk.nn.model.ModelConfig` JSON.
        train: fedfs's training settings (a round task's ``train`` object).
        fraction_train, min_nodes: sampling, as Flower's FedAvg (``min_nodes`` also waits
            for that many connected nodes).
        record_dir: if set, every accepted update is written there
            (``round<r>_node<id>.safetensors`` with ``num_samples`` and its digest) — an
            audit trail, and how the tests recompute the average.
        base_vectors_file: if set, the ``node id → b_u`` table is loaded from and saved to
            this JSON file, so a restarted ServerApp gives known nodes the same ``b_u``.
        on_aggregate: called with ``(server_round, global_weights, accepted)`` after each
            round (the ServerApp publishes the model there).
    """

    def __init__(self, *, method: str, model_config_json: str, train: Mapping[str, Any] | None = None,
                 fraction_train: float = 1.0, min_nodes: int = 2, record_dir: Path | None = None,
                 base_vectors_file: Path | None = None, neg_codewords: int = 0,
                 on_aggregate: Callable[[int, Weights, list[dict[str, Any]]], None] | None = None) -> None:
        super().__init__(fraction_train=fraction_train, fraction_evaluate=0.0, min_train_nodes=min_nodes,
                         min_evaluate_nodes=min_nodes, min_available_nodes=min_nodes, weighted_by_key=NUM_EXAMPLES,
                         arrayrecord_key=ARRAYS, configrecord_key=CONFIG)
        self.method = method
        self.model_config_json = model_config_json
        self.train_json = json.dumps(dict(train or {}), sort_keys=True)
        self.neg_codewords = int(neg_codewords)
        self.record_dir = record_dir
        self.base_vectors_file = base_vectors_file
        self.on_aggregate = on_aggregate
        self.base_vectors: dict[int, int] = self._load_base_vectors()
        self.reference: Weights | None = None
        self.rejected: list[dict[str, Any]] = []

    # ---- FedUV base vectors --------------------------------------------------------------

    def _load_base_vectors(self) -> dict[int, int]:
        p = self.base_vectors_file
        if p is None or not p.is_file():
            return {}
        try:
            table = {int(k): int(v) for k, v in json.loads(p.read_text()).items()}
        except (ValueError, TypeError, AttributeError) as e:
            raise InputError(f"{p} is not a base-vector table (JSON object node id → b_u): {e}") from None
        if len(set(table.values())) != len(table):
            raise InputError(f"{p} gives the same b_u to two nodes: FedUV's codewords would collide")
        return table

    def base_vector(self, node_id: int) -> int:
        """This node's ``b_u``: issued once, unique among the nodes seen, never reissued."""
        node_id = int(node_id)
        if node_id not in self.base_vectors:
            used = set(self.base_vectors.values())
            for _ in range(64):
                b = secrets.randbits(BASE_BITS)
                if b not in used:
                    break
            else:   # 2^32 values: only reachable with billions of nodes
                raise InputError("could not allocate a unique base vector")
            self.base_vectors[node_id] = b
            if self.base_vectors_file is not None:
                atomic_write_bytes(self.base_vectors_file, json.dumps(
                    {str(k): v for k, v in sorted(self.base_vectors.items())}, indent=1).encode())
        return self.base_vectors[node_id]

    # ---- training rounds -----------------------------------------------------------------

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Flower's sampling, then one message per node with that node's ``b_u``."""
        sampled = list(super().configure_train(server_round, arrays, config, grid))
        self.reference = to_weights(arrays)
        messages = []
        for m in sampled:
            node = int(m.metadata.dst_node_id)
            cfg = ConfigRecord(dict(config))
            cfg.update({"server-round": int(server_round), "method": self.method,
                        "model-config": self.model_config_json, "train": self.train_json,
                        "neg-codewords": self.neg_codewords, "base-vector": self.base_vector(node)})
            messages.append(Message(content=RecordDict({ARRAYS: arrays, CONFIG: cfg}),
                                    message_type=MessageType.TRAIN, dst_node_id=node))
        return messages

    def _accept(self, msg: Message) -> tuple[Weights, int]:
        content = msg.content
        if ARRAYS not in content.array_records or METRICS not in content.metric_records:
            raise InputError(f"reply holds no {ARRAYS!r} ArrayRecord / {METRICS!r} MetricRecord")
        metrics = content.metric_records[METRICS]
        if NUM_EXAMPLES not in metrics:
            raise InputError(f"reply's metrics have no {NUM_EXAMPLES!r} (|D_c|)")
        n = check_num_samples(metrics[NUM_EXAMPLES])
        w = to_weights(content.array_records[ARRAYS])
        check_finite(w, "update")
        return w, n

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FedFS Eq. 1 over the valid replies with :class:`StreamingFedAvg` (float64)."""
        valid, _errors = self._check_and_log_replies(replies, is_train=True, validate=False)
        acc = StreamingFedAvg(self.reference)
        accepted: list[dict[str, Any]] = []
        contents = []
        for msg in valid:
            node = int(msg.metadata.src_node_id)
            try:
                w, n = self._accept(msg)
                acc.add(w, n)            # checks keys and shapes against the global model first
            except InputError as e:
                self.rejected.append({"round": server_round, "node": node, "reason": str(e)})
                log.warning("round %d: update of node %d dropped: %s", server_round, node, e)
                continue
            entry = {"node": node, "num_samples": n, "digest": weights_digest(w)}
            accepted.append(entry)
            contents.append(msg.content)
            if self.record_dir is not None:
                self.record_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.record_dir / f"round{server_round:03d}_node{node}.safetensors",
                                   encode_weights(w, {"num_samples": str(n), "node_id": str(node),
                                                      "server_round": str(server_round), "digest": entry["digest"]}))
        if acc.count == 0:
            return None, None
        global_w = acc.result()
        ordered = {k: global_w[k] for k in (self.reference or global_w)}
        if self.on_aggregate is not None:
            self.on_aggregate(server_round, ordered, accepted)
        metrics = self.train_metrics_aggr_fn(contents, self.weighted_by_key)   # |D_c|-weighted loss means
        metrics.update({NUM_EXAMPLES: acc.total_samples, "num-updates": acc.count,
                        "num-dropped": len(valid) - acc.count})
        return ArrayRecord.from_torch_state_dict(ordered), metrics


__all__ = ["FedFSStrategy", "to_weights", "ARRAYS", "CONFIG", "METRICS", "NUM_EXAMPLES"]
