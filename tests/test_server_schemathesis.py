"""The OpenAPI document is the contract: schemathesis (an OpenAPI fuzzer) drives every
operation of a real server subprocess on 127.0.0.1 — device operations with a device token
in an open round, admin ones with the admin token — on a bounded budget, and finds no 5xx
(in its responses or in the server's log) and no response that breaks the document
(status codes, content types, headers, schemas, 405 ``Allow``, auth enforced).

``positive_data_acceptance`` is left out: it expects every schema-valid body to be
accepted, and a schema cannot say which binary bodies are valid safetensors checkpoints.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest_server import ADMIN, ROOT, new_device, start_server, subprocess_env

pytest.importorskip("schemathesis", reason="schemathesis is in the test extra: pip install -e '.[test]'")
pytestmark = pytest.mark.timeout(300)

MAX_EXAMPLES = 150
"""Per operation and phase: 1,447 cases, ~10 s of fuzzing (16 s with the server) on the 2-core machine."""
SECAGG_EXAMPLES = 10
"""The weight rounds' ``/secagg`` routes, fuzzing phase: here they are called with the admin token,
which is not a device token, so every request stops at authentication (401; 405 for a wrong
method) before its body is read — 150 generated bodies per route all checked the same 401.
Ten keep that check (and the coverage phase's cases stay in full); the routes' handlers are
fuzzed with a sampled device's token in an open secure round by test_secagg_schemathesis.py."""

CONFIG = """
headers = { Authorization = "Bearer ${FEDFS_ST_ADMIN}" }

[generation]
max-examples = %d
database = "none"

[[operations]]
include-path-regex = "^/v1/(task|rounds/\\\\{round_id\\\\}/update)$"
headers = { Authorization = "Bearer ${FEDFS_ST_DEVICE}" }

[[operations]]
include-name = "PUT /v1/rounds/{round_id}/update"
parameters = { round_id = 1 }

[[operations]]
include-path-regex = "^/v1/rounds/\\\\{round_id\\\\}/secagg"
generation = { max-examples = %d }
""" % (MAX_EXAMPLES, SECAGG_EXAMPLES)


def st_command() -> list[str]:
    exe = Path(sys.executable).with_name("st")
    return [str(exe)] if exe.exists() else [shutil.which("st") or "st"]


def test_schemathesis_finds_no_5xx_and_no_schema_violation(tmp_path):
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127",
                       "--min-participants", "1")
    try:
        token = new_device(srv.url)["token"]
        with srv.admin() as a:
            assert a.post("/v1/admin/rounds").json()["round_id"] == 1        # the device is sampled
        config = tmp_path / "schemathesis.toml"
        config.write_text(CONFIG)
        env = {**subprocess_env(), "FEDFS_ST_ADMIN": ADMIN, "FEDFS_ST_DEVICE": token, "NO_COLOR": "1"}
        cmd = [*st_command(), "--config-file", str(config), "run", srv.url + "/openapi.json",
               "--checks", "all", "--exclude-checks", "positive_data_acceptance",
               # the statistics rounds' secure-aggregation routes are the weight rounds' own (one
               # install_secagg_routes): test_secagg_schemathesis.py fuzzes both with a round open
               "--exclude-path-regex", "^/v1/stats-round/\\{round_id\\}/secagg",
               "--phases", "examples,coverage,fuzzing", "--seed", "20261124", "--workers", "1",
               "--no-color", "--report", "ndjson", "--report-dir", str(tmp_path / "report")]
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    finally:
        srv.stop()
    out = run.stdout + run.stderr
    print(out[-2500:])                      # the summary (pytest -s shows it)
    assert run.returncode == 0, out[-6000:]
    assert "generated" in out and " passed" in out, out[-3000:]
    log = srv.log.read_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    requests = [e for e in lines if e.get("msg") == "request"]
    assert len(requests) > 200, f"only {len(requests)} requests reached the server"
    assert {e["path"] for e in requests if e["method"] == "PUT"} >= {"/v1/rounds/1/update", "/v1/admin/config"}
    assert not [e for e in requests if e["status"] >= 500], "the server answered a 5xx"
    assert "Exception in ASGI application" not in log and not [e for e in lines if e.get("level") == "error"]
