"""benchmarks/deployment_rehearsal.py end to end, small: SynthFaces, 10 clients as real
DeviceAgents of a real ``fedfs serve`` (HTTPS, fedfs-secagg/2, the CA in its own folder), 2 rounds
at participation 1, the tiny backbone; the simulator on the same arguments in the same run.

What the design guarantees and is checked here:
* both sides score the same clients on the same photos: the same client ids and test-photo counts,
  and ξ as the server served it reproduces the simulator's ``pretrained`` row client by client;
* a device that kept ξ scores as ξ does in the simulator (its enrolled template is the simulator's
  template of the same photos; at most one genuine/impostor pair may swap on float noise);
* ``scope=top`` (the default) keeps every deployed verifier's trunk at ξ's, up to secure
  aggregation's fixed-point rounding;
* half the fleet are phones (``--phones 0.5``: ONNX Runtime from ``fedfs export``'s default artifacts of
  the server's model) that take part in the same rounds and enroll with their own ONNX verifier.
Enrollment runs 4 devices at a time (``--enroll-concurrency 4``): a device waiting for the
check-results round gives its place back, else the 4 in the gate wait on the 6 behind it and the
round sits to its phase deadline (it did, with 8 of 10).
Trained models are *not* expected to agree client by client (different sampling, hold-out and
seeds; no statistics round on devices yet): only that the comparison is computed.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest_server import ROOT, subprocess_env

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ARGS = ["--method", "pretrained", "fedfs+feduv", "--clients", "10", "--new-users", "0", "--public", "8",
        "--train-per-client", "10", "--test-per-client", "4", "--public-images", "8", "--width", "4",
        "--embedding-dim", "16", "--pretrain-epochs", "1", "--pretrain-batch-size", "16", "--rounds", "2",
        "--participation", "1", "--threads", "1", "--seed", "0", "--split-seed", "0"]


def test_rehearsal_deploys_every_client_and_compares_the_same_clients(tmp_path):
    out = tmp_path / "reh"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "deployment_rehearsal.py"), "--out", str(out),
                        "--quiet", "--enroll-concurrency", "4", "--phones", "0.5", *ARGS], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "rehearsal.json").read_text())

    # every client was a real device: registered, certified, took part in both rounds, enrolled
    assert rep["clients"] == list(range(10)) and rep["test_photos"] == [4] * 10 and rep["train_photos"] == [10] * 10
    fleet = sorted((out / "fleet").iterdir())
    assert len(fleet) == 10
    # the odd clients were phones: `fedfs export`'s default artifacts of the server's model, ONNX Runtime only
    assert rep["per_device"]["runtime"] == ["torch", "ort"] * 5
    assert (out / "phone-export" / "onnx" / "top.onnx").is_file()
    for c, d in enumerate(fleet):
        state = d / "state"
        verifier = "verifier.onnx" if c % 2 else "verifier.safetensors"
        assert (state / "enrollment.fedfs").is_file() and (state / verifier).is_file(), (c, verifier)
        meta_runtime = json.loads((state / "device.json").read_text())["rounds"][0]["runtime"]
        assert meta_runtime == ("ort" if c % 2 else "torch")
        assert (d / "identity.cert.json").is_file() and len(list((d / "photos").iterdir())) == 10
    assert rep["per_device"]["rounds"] == [2] * 10 and rep["per_device"]["lost_rounds"] == [0] * 10
    assert all(b > 0 for b in rep["per_device"]["sent_bytes"])
    # the CA lives apart from the server's state, which holds only its public key's effects
    assert not any(p.name == "ca.key" for p in (out / "server").rglob("*"))
    assert (out / "operator" / "ca.key").is_file()
    flags = rep["settings"]["server_flags"]
    assert "--secure-aggregation" in flags and "--tls-cert" in flags and "--secagg-ca" in flags

    rows = {row["name"]: row for row in rep["rows"]}
    sim_xi = rows["simulator: pretrained"]["values"]
    served = rows["deployment: ξ as served"]["values"]
    deployed = rows["deployment: fedfs+feduv"]
    for key in ("template_auroc", "pairwise_auroc", "template_tar", "pairwise_tar"):
        assert np.allclose(served[key], sim_xi[key], atol=1e-9, equal_nan=True), key
    # a device that kept ξ enrolled ξ on the client's photos: the simulator's ξ numbers for that client
    pair = 1.0 / (4 * 36)          # one swapped (genuine, impostor) pair of 4 test photos × 9·4 impostors
    for c, choice in enumerate(deployed["per_client_choice"]):
        assert choice in ("xi", "global", "personalized")
        if choice == "xi":
            assert abs(deployed["values"]["template_auroc"][c] - sim_xi["template_auroc"][c]) <= pair + 1e-12
    assert sum(deployed["choices"].values()) == 10
    assert all(dev <= 1e-6 for dev in rep["verifier_trunk_deviation"])

    comps = {(c["a"], c["b"]): c["delta"] for c in rep["comparisons"]}
    assert comps[("deployed ξ", "pretrained")]["template_auroc"]["mean"] == pytest.approx(0.0, abs=1e-9)
    d = comps[("deployed fedfs+feduv", "fedfs+feduv (c=127)")]
    assert all(d[k]["n"] == 10 and np.isfinite(d[k]["mean"]) for k in ("template_auroc", "pairwise_auroc"))
    assert "deployment − simulator" in (out / "rehearsal.md").read_text()
    phones = comps[("deployed fedfs+feduv (phones, ONNX Runtime)", "fedfs+feduv (c=127)")]
    assert all(phones[k]["n"] == 5 for k in ("template_auroc", "pairwise_auroc"))
    assert "ort devices (5)" in rep["cost"]
