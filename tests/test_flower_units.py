"""The Flower adapter's parts without an engine: settings, the project file, the node's local
step (its device state), and the strategy's aggregation and base vectors (Flower needed for
the last ones only)."""
from __future__ import annotations

import json
import tomllib

import numpy as np
import pytest
import torch

from conftest_flower import TINY, TRAIN, build_federation
from fedfs_flower.node import local_step, weights_digest
from fedfs_flower.project import pyproject_text
from fedfs_flower.settings import NodeSettings, ServerSettings
from fedfs_sdk.nn.checkpoint import read_checkpoint
from fedfs_sdk.federation.device_state import DeviceState
from fedfs_sdk.errors import InputError
from server_agg.aggregate import fedavg


def test_settings_errors_name_the_key_and_the_fix(tmp_path):
    with pytest.raises(InputError, match="initial-model"):
        ServerSettings.from_run_config({})
    with pytest.raises(InputError, match="'train' is not valid JSON"):
        ServerSettings.from_run_config({"initial-model": "m", "train": "{lr: 1}"})
    with pytest.raises(InputError, match="'num-rounds' must be int"):
        ServerSettings.from_run_config({"initial-model": "m", "num-rounds": "3"})
    with pytest.raises(InputError, match="data-dir"):
        NodeSettings.from_configs({}, {}, "feduv")
    with pytest.raises(InputError, match="ξ"):
        NodeSettings.from_configs({}, {"data-dir": "d", "state-dir": "s"}, "fedfs")
    (tmp_path / "a").mkdir()
    with pytest.raises(InputError, match="1 image sub-folders"):
        NodeSettings.from_configs({"data-root": str(tmp_path), "state-root": "s"}, {"partition-id": 1}, "feduv")
    s = NodeSettings.from_configs({"data-root": str(tmp_path), "state-root": "/st"}, {"partition-id": 0}, "feduv")
    assert s.data_dir == tmp_path / "a" and str(s.state_dir) == "/st/node-0"


def test_project_file_is_a_flower_app_with_every_run_key():
    cfg = tomllib.loads(pyproject_text({"method": "feduv", "num-rounds": 5, "train": '{"lr": 0.1}'}))
    app = cfg["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "fedfs_flower.server_app:app", "clientapp": "fedfs_flower.client_app:app"}
    assert app["config"]["method"] == "feduv" and app["config"]["num-rounds"] == 5
    assert json.loads(app["config"]["train"]) == {"lr": 0.1}
    with pytest.raises(InputError, match="unknown run config keys"):
        pyproject_text({"rounds": 3})


def test_local_step_keeps_theta_and_codeword_on_the_node(tmp_path):
    paths = build_federation(tmp_path, 1)
    weights, config, _ = read_checkpoint(paths["model"])
    node = NodeSettings(paths["data"] / "person00", tmp_path / "node", paths["xi"], 1, False)
    kw = dict(method="fedfs+feduv", model_config_json=config.to_json(), train=TRAIN, global_weights=weights,
              node_id=7, run_id=1)
    r1 = local_step(node, base_vector=12345, server_round=1, **kw)
    assert r1.num_samples == 6 and set(r1.weights) == set(weights)     # w_c only: the global model's keys
    assert r1.digest == weights_digest(r1.weights)
    with DeviceState(node.state_dir, read_only=True) as st:
        assert st.info.base_vector == 12345
        theta1 = st.load_weights("personal")[0]
        v = st.load_codeword()
        assert v.shape == (TINY.code_length,) and st.r_bits() is not None
        assert st.info.rounds[-1]["sent_sha256"] == r1.digest
    local_step(node, base_vector=12345, server_round=2, **kw)
    with DeviceState(node.state_dir, read_only=True) as st:
        assert any(not torch.equal(theta1[k], t) for k, t in st.load_weights("personal")[0].items())  # θ_c advanced
        np.testing.assert_array_equal(st.load_codeword(), v)                                         # codeword did not
    with pytest.raises(InputError, match="codeword cannot change"):
        local_step(node, base_vector=999, server_round=3, **kw)
    with pytest.raises(InputError, match="base vector"):
        local_step(node, base_vector=None, server_round=3, **kw)


# ---- the strategy (needs Flower) ---------------------------------------------------------

def _reply(node: int, weights: dict[str, torch.Tensor], n):
    from flwr.app import ArrayRecord, Message, MessageType, Metadata, MetricRecord, RecordDict

    meta = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="x",
                    group_id="1", created_at=0.0, ttl=60.0, message_type=MessageType.TRAIN)
    return Message(RecordDict({"arrays": ArrayRecord.from_torch_state_dict(weights),
                               "metrics": MetricRecord({"num-examples": n})}), metadata=meta)


def test_strategy_aggregates_like_fedfs_not_like_flowers_fedavg(tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed: pip install 'fedfs[flower]'")
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    from fedfs_flower.strategy import FedFSStrategy, to_weights

    g = torch.Generator().manual_seed(0)
    ref = {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g), "steps": torch.tensor(3)}
    updates = [({"w": ref["w"] + torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g),
                 "steps": torch.tensor(4 + i)}, n) for i, n in enumerate((3, 7, 11, 5, 2))]
    s = FedFSStrategy(method="fedfs+feduv", model_config_json=TINY.to_json(), record_dir=tmp_path / "rec")
    s.reference = ref
    bad = [_reply(90, {**ref, "w": torch.full((64, 33), float("nan"))}, 4),     # non-finite
           _reply(91, {**ref, "b": torch.zeros(8)}, 4),                          # wrong shape
           _reply(92, dict(ref), 0)]                                             # |D_c| = 0
    replies = [_reply(i + 1, w, n) for i, (w, n) in enumerate(updates)]
    arrays, metrics = s.aggregate_train(1, replies + bad)
    ours = to_weights(arrays)
    want = fedavg(updates, reference=ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], want[k]), k
    # hand-checkable: the integer buffer is the rounded weighted mean of 4..8
    assert int(ours["steps"]) == round(sum((4 + i) * n for i, n in enumerate((3, 7, 11, 5, 2))) / 28)
    assert (metrics["num-examples"], metrics["num-updates"], metrics["num-dropped"]) == (28, 5, 3)
    assert sorted(r["node"] for r in s.rejected) == [90, 91, 92]
    assert len(list((tmp_path / "rec").glob("round001_node*.safetensors"))) == 5
    # Flower's own FedAvg sums in float32 and turns the int buffer into a float: not fedfs's model
    theirs = to_weights(aggregate_arrayrecords([r.content for r in replies], "num-examples"))
    assert not torch.equal(theirs["w"], want["w"]) and theirs["steps"].dtype != torch.int64


def test_base_vectors_unique_stable_and_kept(tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed: pip install 'fedfs[flower]'")
    from fedfs_flower.strategy import FedFSStrategy

    f = tmp_path / "base_vectors.json"
    s = FedFSStrategy(method="feduv", model_config_json=TINY.to_json(), base_vectors_file=f)
    first = {n: s.base_vector(n) for n in range(200)}
    assert len(set(first.values())) == 200 and all(0 <= b < 2 ** 32 for b in first.values())
    assert all(s.base_vector(n) == b for n, b in first.items())
    again = FedFSStrategy(method="feduv", model_config_json=TINY.to_json(), base_vectors_file=f)
    assert again.base_vectors == first
    f.write_text(json.dumps({"1": 5, "2": 5}))
    with pytest.raises(InputError, match="same b_u"):
        FedFSStrategy(method="feduv", model_config_json=TINY.to_json(), base_vectors_file=f)


def test_missing_flower_is_one_line_naming_the_extra(monkeypatch):
    import sys

    from fedfs_flower import require_flwr

    monkeypatch.setitem(sys.modules, "flwr", None)      # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'fedfs\[flower\]'"):
        require_flwr()
