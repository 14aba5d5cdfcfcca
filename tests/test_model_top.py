"""A round's model as its top alone (``GET /v1/models/{v}/top``, :mod:`fedfs_sdk.federation.model_top`):
a real ``fedfs serve --xi`` publishes, beside each version whose trunk is ξ's, the body of its top
entries; ξ's trunk put under it gives the version's tensors bit for bit, in a third of the tiny model's
bytes. A body of another version, a ξ of another trunk and a body holding trunk entries are refused;
a server without ξ has no such body (404). (Devices use it in tests/test_stats_devices.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest_server import read_safetensors, start_server
from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.model_top import TOP_FORMAT, compose_model
from fedfs_sdk.nn.checkpoint import save_checkpoint
from fedfs_sdk.nn.model import FaceNet, ModelConfig
from fedfs_sdk.training.top_keys import is_top_key

pytestmark = [pytest.mark.timeout(240)]


def test_the_top_and_xis_trunk_are_the_version(tmp_path) -> None:
    torch.manual_seed(0)
    xi = FaceNet(ModelConfig("tiny"))
    save_checkpoint(tmp_path / "xi.safetensors", xi, ModelConfig("tiny"))
    srv = start_server(tmp_path / "server", "--xi", str(tmp_path / "xi.safetensors"))
    try:
        with srv.admin() as a:
            full = a.get("/v1/models/1")
            top = a.get("/v1/models/1/top")
        assert full.status_code == top.status_code == 200
        weights, _ = read_safetensors(full.content)
        body, meta = read_safetensors(top.content)
        assert meta["format"] == TOP_FORMAT and set(body) == {k for k in weights if is_top_key(k)}
        assert len(top.content) * 2 < len(full.content)       # the tiny model: a third (MobileFaceNet: 1/11)
        composed = compose_model(top.content, tmp_path / "xi.safetensors", full.headers["X-FedFS-SHA256"])
        got, got_meta = read_safetensors(composed)
        assert set(got) == set(weights) and all(np.array_equal(got[k], weights[k]) for k in weights)
        assert got_meta == read_safetensors(full.content)[1]             # the version's checkpoint metadata

        with pytest.raises(InputError, match="another model version"):
            compose_model(top.content, tmp_path / "xi.safetensors", "0" * 64)
        other = FaceNet(ModelConfig("tiny"))                              # another trunk
        save_checkpoint(tmp_path / "other.safetensors", other, ModelConfig("tiny"))
        with pytest.raises(InputError, match="ξ's trunk is not this version's trunk"):
            compose_model(top.content, tmp_path / "other.safetensors", full.headers["X-FedFS-SHA256"])
        from safetensors.numpy import save

        key = next(k for k in weights if not is_top_key(k))
        forged = save({**body, key: weights[key]}, metadata=meta)
        with pytest.raises(InputError, match="entries outside the top"):
            compose_model(forged, tmp_path / "xi.safetensors", full.headers["X-FedFS-SHA256"])
    finally:
        srv.stop()


def test_no_top_body_without_xi(tmp_path) -> None:
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--method", "feduv")
    try:
        with srv.admin() as a:
            r = a.get("/v1/models/1/top")
        assert r.status_code == 404 and r.json()["error"] == "no_top_body", r.text
    finally:
        srv.stop()
