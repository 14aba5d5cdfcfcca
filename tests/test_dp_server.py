"""User-level DP-FedAvg on the real HTTP server (a ``fedfs serve`` subprocess on 127.0.0.1):
every published version carries its (ε, δ), the published update is the clipped sum plus
Gaussian noise of the stated scale, and the budget refuses the round that would overspend
it — also after a restart — and tells devices the federation is done."""
from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest
import torch
from scipy import stats

from conftest_server import new_device, read_safetensors, start_server
from fedfs_sdk.federation.wire import decode_weights, encode_update
from server_agg.dp import epsilon

pytestmark = pytest.mark.timeout(300)

SIGMA, CLIP, DELTA = 1.0, 0.5, 1e-5


def _upload(url: str, token: str, round_id: int, version: int, weights: dict[str, torch.Tensor], n: int) -> dict:
    body = encode_update(weights, round_id=round_id, model_version=version, num_samples=n)
    r = httpx.put(f"{url}/v1/rounds/{round_id}/update", content=body, timeout=60,
                  headers={"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    return r.json()


def test_dp_rounds_publish_epsilon_and_the_budget_stops_the_federation(tmp_path):
    eps = [epsilon([(1.0, SIGMA, t)], DELTA) for t in (1, 2, 3)]
    budget = (eps[1] + eps[2]) / 2                  # two rounds fit, the third does not
    state = tmp_path / "server"
    args = ("--init-backbone", "tiny", "--code-length", "127", "--min-participants", "2", "--participation", "1.0",
            "--quorum", "1.0", "--min-updates", "1", "--max-update-norm", str(CLIP),
            "--dp-noise-multiplier", str(SIGMA), "--dp-delta", str(DELTA), "--dp-epsilon-budget", str(budget))
    srv = start_server(state, *args)
    try:
        tokens = [new_device(srv.url)["token"] for _ in range(2)]
        with srv.admin() as a:
            st = a.get("/v1/rounds/current").json()
            assert st["dp"]["epsilon"] == 0.0 and st["dp"]["budget_exhausted"] is False
            for rnd in (1, 2):
                opened = a.post("/v1/admin/rounds")
                assert opened.status_code == 201, opened.text
                assert opened.json()["sampled"] == 2             # Poisson at q = 1: everyone
                task = httpx.get(srv.url + "/v1/task", headers={"Authorization": f"Bearer {tokens[0]}"}).json()
                assert task["action"] == "train" and task["dp"]["clip"] == CLIP
                assert task["dp"]["denominator"] == pytest.approx(2.0)   # q·N
                w, _ = decode_weights(a.get(f"/v1/models/{rnd}").content)
                floating = [k for k, v in w.items() if v.is_floating_point()]
                d = sum(w[k].numel() for k in floating)
                # device 0 sends Δ = 1 on every coordinate (‖Δ‖ = √d ≫ C: the server clips it to C);
                # device 1 sends Δ = 0.
                big = {k: (v + 1.0 if v.is_floating_point() else v) for k, v in w.items()}
                rec = _upload(srv.url, tokens[0], rnd, rnd, big, 10)
                assert rec["clipped"] and rec["update_norm"] == pytest.approx(math.sqrt(d), rel=1e-6)
                _upload(srv.url, tokens[1], rnd, rnd, {k: v.clone() for k, v in w.items()}, 10)
                info = a.get(f"/v1/rounds/{rnd}").json()
                assert info["state"] == "closed" and info["result_version"] == rnd + 1
                # the version carries (ε, δ) — in the model file's metadata and in /v1/models/latest
                data = a.get(f"/v1/models/{rnd + 1}").content
                published, meta = read_safetensors(data)
                dp = json.loads(meta["meta"])["dp"]
                assert dp["epsilon"] == pytest.approx(eps[rnd - 1], rel=1e-9) and dp["delta"] == DELTA
                assert dp["rounds_charged"] == rnd and dp["noise_multiplier"] == SIGMA and dp["clip"] == CLIP
                latest = a.get("/v1/models/latest").json()
                assert latest["version"] == rnd + 1 and latest["dp"]["epsilon"] == pytest.approx(eps[rnd - 1])
                # published − w = (C·Δ̂ + 0) / 2 + N(0, (σC/2)²): the residual's std is σC/2 (chi-square bound)
                signal = CLIP / math.sqrt(d) / 2.0
                resid = np.concatenate([(published[k].astype(np.float64) - w[k].double().numpy()).ravel() - signal
                                        for k in floating])
                lo, hi = stats.chi2.ppf([0.0005, 0.9995], d - 1)
                std = SIGMA * CLIP / 2.0
                # float32 storage adds ≤ 1 ulp (~6e-8 · |w|): far below the bound's width for d ≈ 10⁵
                assert lo <= (d - 1) * resid.var(ddof=1) / std ** 2 <= hi, (resid.std(), std)
                assert abs(resid.mean()) <= 4 * std / math.sqrt(d)
            # the third round would take ε above the budget: refused, nothing opened
            refused = a.post("/v1/admin/rounds")
            assert refused.status_code == 409 and refused.json()["error"] == "dp_budget_exhausted", refused.text
            assert "budget" in refused.json()["reason"]
            st = a.get("/v1/rounds/current").json()
            assert st["round"] is None and st["model_version"] == 3
            assert st["dp"]["budget_exhausted"] is True and st["dp"]["epsilon"] == pytest.approx(eps[1])
            done = httpx.get(srv.url + "/v1/task", headers={"Authorization": f"Bearer {tokens[1]}"}).json()
            assert done["action"] == "done" and done["reason"] == "dp_budget_exhausted"
    finally:
        srv.stop()
    # the ledger is durable: a restarted server (even with a larger --rounds) still refuses
    srv = start_server(state, *args, "--rounds", "10")
    try:
        with srv.admin() as a:
            assert a.post("/v1/admin/rounds").status_code == 409
            assert a.get("/v1/rounds/current").json()["round"] is None
            assert a.get("/v1/models/latest").json()["dp"]["rounds_charged"] == 2
    finally:
        srv.stop()


def test_dp_settings_are_checked_at_start(tmp_path, capsys):
    """DP without a clip norm (or without δ) is refused with a message naming the flag.

    ``fedfs serve`` runs in this process (the CLI's own ``main``): two subprocesses spent ~10 s
    each importing what this test module already imported. The port given is held by this test,
    so a server that did not refuse fails at its bind with another message instead of serving."""
    import socket

    from fedfs_sdk.cli.main import main as fedfs

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        for extra, needle in ((("--dp-noise-multiplier", "1.0", "--dp-delta", "1e-5"), "max_update_norm"),
                              (("--dp-noise-multiplier", "1.0", "--max-update-norm", "1"), "dp_delta")):
            code = fedfs(["serve", "--state", str(tmp_path / "s"), "--host", "127.0.0.1", "--port", port,
                          "--init-backbone", "tiny", "--code-length", "127", *extra])
            out = capsys.readouterr()
            assert code != 0 and needle in (out.out + out.err), out.err[-2000:]
