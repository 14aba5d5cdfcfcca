"""The secure-aggregation endpoints under schemathesis (an OpenAPI fuzzer): a real
``fedfs serve --secure-aggregation`` on 127.0.0.1 with an open secure round, every
``/v1/rounds/{round_id}/secagg…`` operation driven with a sampled device's token. No 5xx, no
response outside the document, and the round is still consistent afterwards (bad messages
change nothing: the fuzzed device may at most have advertised keys)."""
from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from conftest_server import new_device, start_server, subprocess_env
from test_server_schemathesis import st_command

pytest.importorskip("schemathesis", reason="schemathesis is in the test extra: pip install -e '.[test]'")
pytestmark = pytest.mark.timeout(300)

CONFIG = """
headers = { Authorization = "Bearer ${FEDFS_ST_DEVICE}" }

[generation]
max-examples = 60
database = "none"

[[operations]]
include-path-regex = "/secagg"
parameters = { round_id = 1 }
"""


def test_secagg_endpoints_fuzzed_without_5xx(tmp_path):
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127",
                       "--min-participants", "3", "--secure-aggregation", "--secagg-phase-timeout", "600",
                       "--round-timeout", "600")
    try:
        tokens = [new_device(srv.url)["token"] for _ in range(3)]
        with srv.admin() as a:
            assert a.post("/v1/admin/rounds").json()["round_id"] == 1
        config = tmp_path / "schemathesis.toml"
        config.write_text(CONFIG)
        env = {**subprocess_env(), "FEDFS_ST_DEVICE": tokens[0], "NO_COLOR": "1"}
        cmd = [*st_command(), "--config-file", str(config), "run", srv.url + "/openapi.json",
               "--include-path-regex", "/secagg",
               "--checks", "all", "--exclude-checks", "positive_data_acceptance",
               "--phases", "examples,coverage,fuzzing", "--seed", "20261124", "--workers", "1",
               "--no-color"]
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
        status = srv.status()["round"]
    finally:
        srv.stop()
    out = run.stdout + run.stderr
    print(out[-2500:])
    assert run.returncode == 0, out[-6000:]
    lines = [json.loads(line) for line in srv.log.read_text().splitlines() if line.startswith("{")]
    requests = [e for e in lines if e.get("msg") == "request" and "/secagg" in e["path"]]
    assert len(requests) > 50, f"only {len(requests)} secagg requests reached the server"
    assert not [e for e in requests if e["status"] >= 500]
    assert not [e for e in lines if e.get("level") == "error"]
    sa = status["secure_aggregation"]
    assert status["state"] == "open" and sa["phase"] == "advertise" and sa["advertised"] <= 1
