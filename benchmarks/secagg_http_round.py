"""The cost of a secure-aggregation round over real HTTP: the previous protocol against the
authenticated one (identity signatures + the consistency check), interleaved.

    PYTHONPATH=. .venv/bin/python benchmarks/secagg_http_round.py                  # 5 and 20 devices, 3 rounds each
    PYTHONPATH=. .venv/bin/python benchmarks/secagg_http_round.py --devices 5 --rounds 1

Three ``fedfs serve --secure-aggregation`` subprocesses on 127.0.0.1, started side by side for
each device count: ``fedfs-secagg/1`` over HTTP (the previous protocol), ``fedfs-secagg/2``
over HTTP (``--secagg-ca``: certified identities, signed advertisements, consistency check)
and ``/2`` over HTTPS (``--tls-cert``; the devices pin the self-signed certificate). Round r
runs on each of the three in turn, so a change of the machine's load hits all three alike.
(Phase timeout 300 s: the servers' first rounds open while the others are still being set up,
and on a loaded machine a 30 s phase could close before the benchmark reaches it.)
K devices speak the protocol with :class:`SecAggSession` (the device agents' code) from this
process, one after another, with synthetic updates of the server's model layout (tiny,
42,592 parameters): the wall time is the sum of their work and the server's, not a
concurrency measurement.

Printed per configuration (median over the rounds): the round's wall time from the first
advertise to the published version; per device, the bytes sent and received and the CPU
time (``thread_time``, this process: protocol, crypto and HTTP client) of each phase; the
largest difference between the published model and the exact weighted mean. Then the
signature work alone, in-process: one device checking a roster of K certificates and
signatures, and a quorum of consistency signatures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest_server import read_safetensors, self_signed_cert, start_server  # noqa: E402
from fedfs_sdk.federation.secagg import (CertificateAuthority, DeviceIdentity, DevicePolicy,  # noqa: E402
                                         SecAggParams, auth)
from fedfs_sdk.federation.secagg.http_device import SecAggSession, flatten_update  # noqa: E402
from fedfs_sdk.federation.server_client import RetryPolicy, ServerClient  # noqa: E402
from fedfs_sdk.training.ort_device import encode_update  # noqa: E402

PHASES = ("advertise", "share_keys", "masked_input", "consistency", "unmask")
CONFIGS = ("v1 http", "v2 http", "v2 https")


class Setup:
    """One server and its K registered devices (with certified identities for /2)."""

    def __init__(self, name: str, k: int, rounds: int, root: Path, ca: CertificateAuthority) -> None:
        self.name = name
        args = ["--init-backbone", "tiny", "--code-length", "127", "--min-participants", str(k), "--device-ttl", "0",
                "--secure-aggregation", "--secagg-phase-timeout", "300", "--round-timeout", "600", "--rounds",
                str(rounds)]
        tls = self_signed_cert(root / f"{name.replace(' ', '-')}-tls") if "https" in name else None
        self.v2 = name.startswith("v2")
        if self.v2:
            (root / "ca.pub").write_text(json.dumps(ca.public.to_json()))
            args += ["--secagg-ca", str(root / "ca.pub")]
        self.srv = start_server(root / name.replace(" ", "-"), *args, tls=tls)
        self.policy = DevicePolicy(ca=ca.public) if self.v2 else DevicePolicy.honest_but_curious()
        self.devices = []
        for i in range(k):
            token = httpx.post(self.srv.url + "/v1/devices", verify=self.srv.verify).json()["token"]
            client = ServerClient(self.srv.url, token, tls_ca=tls[0] if tls else None,
                                  retry=RetryPolicy(attempts=20, base_delay_s=0.2, max_delay_s=1.0))
            ident = DeviceIdentity.generate()
            self.devices.append((client, ident.with_certificate(ca.issue(f"phone-{i}", ident.public_key))))

    def wait_open(self, rnd: int) -> None:
        while httpx.get(self.srv.url + "/health", verify=self.srv.verify).json()["round_id"] != rnd:
            time.sleep(0.05)

    def round(self, rnd: int, rng: np.random.Generator) -> dict:
        self.wait_open(rnd)
        with self.srv.admin() as c:
            ref = read_safetensors(c.get(f"/v1/models/{rnd}").content)[0]
        sessions, bodies = [], []
        for client, ident in self.devices:
            task = client.task()
            sessions.append(SecAggSession(client, task, identity=ident if self.v2 else None, policy=self.policy))
            upd = {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in ref.items()}
            bodies.append(encode_update(upd, round_id=rnd, model_version=rnd, num_samples=int(rng.integers(1, 50))))
        cpu = {p: 0.0 for p in PHASES}

        def step(phase: str, fn, *a) -> None:
            t = time.thread_time()
            fn(*a)
            cpu[phase] += time.thread_time() - t

        t0 = time.perf_counter()
        for s in sessions:
            step("advertise", s.advertise)
        for s in sessions:
            step("share_keys", s.share_keys)
        for s, b in zip(sessions, bodies):
            step("masked_input", s.masked_input, b)
        for s in sessions:
            step("consistency", s.consistency)
        for s in sessions:
            step("unmask", s.unmask)
        while True:
            with self.srv.admin() as c:
                info = c.get(f"/v1/rounds/{rnd}").json()
            if info["state"] != "open":
                break
            time.sleep(0.01)
        wall = time.perf_counter() - t0
        assert info["state"] == "closed", info
        with self.srv.admin() as c:
            pub = read_safetensors(c.get(f"/v1/models/{info['result_version']}").content)[0]
        got = np.concatenate([pub[k].astype(np.float64).ravel() for k in sorted(pub)])
        ups = [flatten_update(b) for b in bodies]
        exact = sum(w * n for w, n in ups) / sum(n for _, n in ups)
        k = len(sessions)
        return {"wall": wall, "sent": statistics.mean(s.bytes_sent for s in sessions),
                "recv": statistics.mean(s.bytes_received for s in sessions), "err": float(np.abs(got - exact).max()),
                **{f"cpu_{p}": 1000 * v / k for p, v in cpu.items()}, "dim": got.size}


def signature_costs(k: int, reps: int = 5) -> dict[str, float]:
    """ms of one device's signature work at K devices, in-process (median of ``reps``)."""
    ca = CertificateAuthority.generate()
    p = SecAggParams(round_id=1, dim=10, participants=k, authenticated=True)
    ctx = auth.context_digest(p)
    ids = [DeviceIdentity.generate() for _ in range(k)]
    ids = [i.with_certificate(ca.issue(f"d{j}", i.public_key)) for j, i in enumerate(ids)]
    entries = []
    for j, ident in enumerate(ids, start=1):
        c_pk, s_pk = bytes([j % 256]) * 32, bytes([(j + 1) % 256]) * 32
        entries.append({"device": j, "c_pk": c_pk, "s_pk": s_pk, "cert": ident.certificate.to_json(),
                        "sig": ident.sign(auth.advertisement_payload(1, j, ctx, c_pk, s_pk))})
    out: dict[str, list[float]] = {"sign advertisement": [], f"check roster of {k}": [], "sign U3": [],
                                   f"check {k} consistency signatures": []}
    u3 = set(range(1, k + 1))
    for _ in range(reps):
        t = time.perf_counter()
        ids[0].sign(auth.advertisement_payload(1, 1, ctx, entries[0]["c_pk"], entries[0]["s_pk"]))
        out["sign advertisement"].append(time.perf_counter() - t)
        t = time.perf_counter()
        keys = auth.check_roster_identities(entries, 1, ctx, ca.public, "bench")
        out[f"check roster of {k}"].append(time.perf_counter() - t)
        t = time.perf_counter()
        run = auth.run_digest(1, ctx, {e["device"]: (e["c_pk"], e["s_pk"]) for e in entries})
        sigs = [{"device": j, "sig": ident.sign(auth.consistency_payload(1, ctx, u3, run))}
                for j, ident in enumerate(ids, start=1)]
        out["sign U3"].append((time.perf_counter() - t) / k)
        t = time.perf_counter()
        auth.check_signatures(sigs, u3, keys, 1, ctx, k, "bench", run)
        out[f"check {k} consistency signatures"].append(time.perf_counter() - t)
    return {name: 1000 * statistics.median(v) for name, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, nargs="+", default=[5, 20])
    p.add_argument("--rounds", type=int, default=3, help="rounds per configuration (interleaved)")
    a = p.parse_args()
    ca = CertificateAuthority.generate()
    for k in a.devices:
        root = Path(tempfile.mkdtemp(prefix="secagg-bench-"))
        setups = [Setup(name, k, a.rounds, root, ca) for name in CONFIGS]
        rows: dict[str, list[dict]] = {s.name: [] for s in setups}
        try:
            for rnd in range(1, a.rounds + 1):
                for s in setups:                            # interleaved: v1, v2, v2+TLS, v1, …
                    rows[s.name].append(s.round(rnd, np.random.default_rng(rnd)))
        finally:
            for s in setups:
                s.srv.stop()
        dim = rows[CONFIGS[0]][0]["dim"]
        print(f"\n{k} devices, tiny model ({dim:,} parameters), threshold ⌊2·{k}/3⌋+1, {a.rounds} round(s) per "
              "configuration, interleaved; medians")
        print("| configuration | round wall s | sent B/device | received B/device | " +
              " | ".join(f"{ph} CPU ms/device" for ph in PHASES) + " | max err |")
        print("|---|" + "---|" * (5 + len(PHASES)))
        for name in CONFIGS:
            r = rows[name]
            med = {key: statistics.median(x[key] for x in r) for key in r[0]}
            print(f"| {name} | {med['wall']:.2f} | {med['sent']:,.0f} | {med['recv']:,.0f} | "
                  + " | ".join(f"{med['cpu_' + ph]:.1f}" for ph in PHASES) + f" | {max(x['err'] for x in r):.2g} |")
        walls = {n: [x["wall"] for x in rows[n]] for n in CONFIGS}
        print("round walls s: " + "; ".join(f"{n}: {', '.join(f'{w:.2f}' for w in walls[n])}" for n in CONFIGS))
        sig = signature_costs(k)
        print(f"signature work of one device at {k} devices (in-process, ms): "
              + ", ".join(f"{n} {v:.2f}" for n, v in sig.items()))


if __name__ == "__main__":
    main()
