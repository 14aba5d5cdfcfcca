"""Step 2 of ``benchmarks/deployment_rehearsal.py``: the operator, a real ``fedfs serve`` and one
:class:`~fedfs_sdk.federation.agent.DeviceAgent` per client (:mod:`rehearsal_fleet`), run until
every device enrolled (:func:`deploy`; ``--resume`` restarts a stopped run on its state), and
what it recorded in ``OUT/deployment.json`` (:func:`read_deployment`): the plan, the server's
flags, the timing and each device's rounds, bytes, CPU and phases.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))     # its siblings, as top-level modules

from rehearsal_fleet import (ROOT, Device, Operator, Server, ServerPlan, check_inputs, device_q,  # noqa: E402
                             phase_times, process_cpu_seconds, register, round_times, run_fleet, server_flags,
                             start_rounds, write_photos)
from rehearsal_sim import to_u8  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"[rehearsal {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def is_phone(client: int, share: float) -> bool:
    """Whether client ``client`` runs as a phone when a ``share`` of the fleet does (spread evenly:
    0.5 → every odd client)."""
    return int((client + 1) * share + 1e-9) > int(client * share + 1e-9)


def phone_export(url: str, state: Path, pem: Path, plan: ServerPlan, out: Path) -> Path:
    """What a phone app ships: ``fedfs export --formats onnx,ort-training`` of the server's first model
    with its ξ and round settings (default scope: the top trains on ξ's trunk features)."""
    import ssl

    import httpx

    sys.path.insert(0, str(ROOT))
    from export.pipeline import ExportOptions, run_export

    folder = out / "phone-export"
    if (folder / "manifest.json").is_file():            # --resume: the phones keep their app
        return folder
    token = (state / "admin_token").read_text().strip()
    r = httpx.get(url + "/v1/models/1", headers={"Authorization": f"Bearer {token}"},
                  verify=ssl.create_default_context(cafile=str(pem)), timeout=120)
    r.raise_for_status()
    (out / "server-v1.safetensors").write_bytes(r.content)
    run_export(out / "server-v1.safetensors", folder, ExportOptions(
        formats=("onnx", "ort-training"), xi=str(plan.xi), methods=(plan.method,), train=dict(plan.train)))
    return folder


def deploy(args: argparse.Namespace, out: Path, pop, plan: ServerPlan, q: float) -> dict[str, Any]:
    """The operator, ``fedfs serve`` and one DeviceAgent per client, until every device enrolled.
    Returns (and writes to ``OUT/deployment.json``) the plan, the server's flags, the timing and
    each device's rounds, bytes, CPU and phases."""
    timing: dict[str, Any] = {}
    state = out / "server"
    resume = args.resume and (out / "fleet").is_dir()
    if resume:              # the operator, server state and devices of an earlier run that stopped
        operator = Operator(out / "operator", existing=True)
        first = json.loads((out / "fleet" / "client_00000" / "state" / "device.json").read_text())["server"]
        url, port = first.rstrip("/"), int(first.rstrip("/").rsplit(":", 1)[1])
    else:
        operator = Operator(out / "operator")
        state.mkdir(parents=True, exist_ok=True)
        operator.revocation_list(state / "secagg_revocations.json")
        port = free_port()
        url = f"https://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    env.pop("FEDFS_ADMIN_TOKEN", None)          # the server writes its own into its state
    server = Server(server_flags(plan, operator, state, port, rounds=plan.rounds if resume else 0), state, env,
                    out / ("server-resumed.log" if resume else "server.log"))
    devices: list[Device] = []
    try:
        server.wait_healthy(url, operator.tls_cert)
        phones = phone_export(url, state, operator.tls_cert, plan, out) if args.phones > 0 else None
        t0 = time.perf_counter()
        for c in range(pop.num_clients):
            d = out / "fleet" / f"client_{c:05d}"
            photos = (sorted(str(f) for f in (d / "photos").iterdir()) if resume
                      else write_photos(d / "photos", to_u8(pop.train_images(c))))
            # fedfs+feduv's own default score, said explicitly: a device the server never sampled guesses
            # the method 'feduv' from the model's head and would need a codeword it never made (the agent's
            # fallback in device_enrollment; reported) — with the score named it enrolls ξ or the global model
            dev = Device(c, d, photos, d / "identity.cert.json", q=device_q(q, len(photos)),
                         score="head-template" if plan.method == "fedfs+feduv" else None,
                         artifacts=phones if phones is not None and is_phone(c, args.phones) else None)
            check_inputs(dev, operator, args.outliers)          # before it registers, as fedfs device does
            if not resume:
                register(dev, url, operator)
            devices.append(dev)
        timing["register_s"] = time.perf_counter() - t0
        if not resume:
            start_rounds(url, state, operator.tls_cert, plan.rounds)
        n_phones = sum(d.artifacts is not None for d in devices)
        log(f"{len(devices)} devices registered and certified ({n_phones} phones on ONNX Runtime); rounds open",
            args.quiet)
        done = {"n": 0}

        def on_event(dev: Device, name: str, fields: dict[str, Any]) -> None:
            if name == "enrolled":
                done["n"] += 1
                log(f"client {dev.client} enrolled ({fields.get('model_choice')}); {done['n']}/{len(devices)}",
                    args.quiet)
            elif name == "device_failed":
                log(f"client {dev.client} FAILED: {fields['error']}\n{fields['where']}", False)

        t0, fleet_cpu0, server_cpu0 = time.perf_counter(), process_cpu_seconds(), server.cpu_seconds()
        run_fleet(devices, url, operator, args.outliers, on_event)
        timing["fleet_wall_s"] = time.perf_counter() - t0
        timing["fleet_cpu_s"] = process_cpu_seconds() - fleet_cpu0
        timing["server_cpu_s"] = server.cpu_seconds() - server_cpu0
    finally:
        server.stop()
    timing["rounds_s"] = round_times(state)
    timing["resumed"] = bool(resume)
    failed = [(d.client, d.error) for d in devices if d.error]
    if failed:
        raise SystemExit(f"{len(failed)} device(s) failed, e.g. client {failed[0][0]}: {failed[0][1]} "
                         f"(server log {out / 'server.log'})")
    per_dev = {"sent_bytes": [d.sent for d in devices], "received_bytes": [d.received for d in devices],
               "cpu_s": [d.cpu_seconds for d in devices], "wall_s": [d.seconds for d in devices],
               "rounds": [len(d.report.rounds) for d in devices],
               "lost_rounds": [len(d.report.lost_rounds) for d in devices],
               "phases": [phase_times(d) for d in devices], "q": [d.q for d in devices],
               "runtime": ["ort" if d.artifacts is not None else "torch" for d in devices]}
    record = {"plan": {**plan.__dict__, "impostors": str(plan.impostors)},
              "server_flags": server_flags(plan, operator, state, port), "timing": timing, "per_device": per_dev}
    (out / "deployment.json").write_text(json.dumps(record, indent=1))
    return record


def read_deployment(out: Path) -> dict[str, Any]:
    """What :func:`deploy` recorded (``OUT/deployment.json``; an older run's ``rehearsal.json``)."""
    if (out / "deployment.json").is_file():
        return json.loads((out / "deployment.json").read_text())
    old = json.loads((out / "rehearsal.json").read_text())
    timing = {k: v for k, v in old["timing"].items() if k in ("register_s", "fleet_wall_s", "fleet_cpu_s", "server_cpu_s")}
    per_dev = {**old["per_device"], "phases": old["per_device"].get("phases") or
               [phase_times(Device(0, out, [], Path()))] * len(old["clients"])}
    return {"plan": old["settings"]["server"], "server_flags": old["settings"]["server_flags"], "timing": timing,
            "per_device": per_dev}


__all__ = ["deploy", "read_deployment", "free_port", "log"]
