"""JSON Schema of the ``PUT /v1/admin/config`` body, for the OpenAPI document.

Written out (not a pydantic model) so that the route can check the admin token before it
reads the body — FastAPI reads and parses a typed body *before* running the route's
dependencies. The bounds are the ones :class:`~server_agg.config.RoundPolicy` and
:func:`fedfs_sdk.federation.wire_format.split_train_json` enforce (every value the server accepts is
valid here; a fuzzer's schema-invalid values are refused with a 4xx).
"""
from __future__ import annotations

from typing import Any

from fedfs_sdk.training.objective import METHODS
from fedfs_sdk.federation.wire_format import MAX_ID, OBJECTIVE_MAX, TRAIN_FLOAT_MAX, TRAIN_INT_RANGES

from .config import MAX_NEG_CODEWORDS, MAX_NUM_SAMPLES, MAX_SECONDS


def _int(lo: int, hi: int = MAX_ID) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float = 0.0, hi: float | None = None, exclusive_lo: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "number", ("exclusiveMinimum" if exclusive_lo else "minimum"): lo}
    if hi is not None:
        out["maximum"] = hi
    return out


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


FEDFS_LOSS_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "description": "fields of fedfs_sdk.training.losses.fedfs.FedFSLossConfig (FedFS Eq. 2–9)",
    "properties": {
        "combine": {"enum": ["concat", "sum"]},
        "logits": {"enum": ["similarity", "literal"]},
        "logit_scale": _num(0.0, exclusive_lo=True),
        "top_k": _num(0.0, exclusive_lo=True),
        "gamma": {"type": "number"},
        "lam": _num(0.0, 1.0),
        "soft_score": {"enum": ["dot", "cosine"]},
    },
}

TRAIN_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "description": "training settings of the round task (fedfs_sdk.federation.wire_format.TRAIN_KEYS)",
    "properties": {
        **{k: _num(0.0, hi) for k, hi in TRAIN_FLOAT_MAX.items()},
        "head_lr": _nullable(_num(0.0, TRAIN_FLOAT_MAX["head_lr"])),   # null: the same as lr
        **{k: _int(lo, hi) for k, (lo, hi) in TRAIN_INT_RANGES.items()},
        "scope": {"enum": ["all", "top"]},
        "objective": _nullable({
            "type": "object", "additionalProperties": False,
            "properties": {"uv_weight": _num(0.0, OBJECTIVE_MAX), "lambda_neg": _num(0.0, OBJECTIVE_MAX),
                           "fedfs": _nullable(FEDFS_LOSS_SCHEMA)},
        }),
    },
}

POLICY_CHANGES_SCHEMA: dict[str, Any] = {
    "title": "PolicyChanges",
    "type": "object", "additionalProperties": False,
    "description": "the round-policy settings to change (server_agg.config.RoundPolicy); omitted ones keep their value",
    "properties": {
        "method": {"enum": list(METHODS)},
        "train": TRAIN_SCHEMA,
        "neg_codewords": _int(0, MAX_NEG_CODEWORDS),
        "participation": _num(0.0, 1.0, exclusive_lo=True),
        "min_participants": _int(1),
        "quorum": _num(0.0, 1.0, exclusive_lo=True),
        "min_updates": _int(1),
        "round_timeout_s": _num(0.0, MAX_SECONDS, exclusive_lo=True),
        "rounds": _int(0),
        "max_update_norm": _nullable(_num(0.0, exclusive_lo=True)),
        "max_num_samples": _int(1, MAX_NUM_SAMPLES),
        "seed": _int(0),
        "device_ttl_s": _nullable(_num(0.0, MAX_SECONDS)),
        # user-level DP-FedAvg (server_agg.dp)
        "dp_noise_multiplier": _nullable(_num(0.0, 1e6)),
        "dp_delta": _nullable(_num(0.0, 1.0, exclusive_lo=True)),
        "dp_epsilon_budget": _nullable(_num(0.0, exclusive_lo=True)),
        "dp_weight_cap": _int(1, MAX_NUM_SAMPLES),
        "dp_accountant": {"enum": ["rdp", "pld"]},
        # secure aggregation (server_agg.secagg_rounds)
        "secure_aggregation": {"type": "boolean"},
        "secagg_threshold": _nullable(_int(2, 1 << 31)),
        "secagg_neighbours": _nullable(_int(2, 1 << 31)),
        "secagg_clip": _num(0.0, 1e6, exclusive_lo=True),
        "secagg_scale_bits": _int(0, 52),
        "secagg_min_devices": _int(3, 1 << 31),
        "secagg_phase_timeout_s": _num(0.0, MAX_SECONDS, exclusive_lo=True),
        "stats_rounds": {"type": "boolean"},
        "stats_dp_noise_multiplier": _nullable(_num(0.0, 1e6)),
        "stats_dp_noise": {"enum": ["central", "distributed"]},
        "stats_dp_delta": _nullable(_num(0.0, 1.0, exclusive_lo=True)),
        "stats_bound": _nullable(_num(0.0, 1e6, exclusive_lo=True)),
        "secagg_ca": _nullable({"type": "object", "required": ["format", "public_key"],
                                "description": "the operator CA's public key (ca.pub of fedfs ca init): secure "
                                               "rounds run fedfs-secagg/2",
                                "properties": {"format": {"const": "fedfs-ca/1"}, "public_key": {"type": "string"},
                                               "key_id": {"type": "string"}}}),
    },
}

__all__ = ["POLICY_CHANGES_SCHEMA", "TRAIN_SCHEMA", "FEDFS_LOSS_SCHEMA"]
