"""Run one secure-aggregation round over K simulated devices in-process, and measure it.

The same state machines a real deployment uses (:mod:`fedfs_sdk.federation.secagg`), driven
sequentially: every message goes device → server → device as a dict, is sized as it would
travel (JSON with base64 for keys and ciphertexts, the masked vector as a raw body), and each
call's CPU time is taken with ``time.thread_time`` — one device's work on one core, and the
server's work per step. Dropouts are given up front: ``drop[step]`` lists the devices that
send nothing from that step on (steps: ``advertise``, ``share_keys``, ``masked_input``,
``unmask``).

Updates are produced on demand by ``update_of(device) -> (w, n)`` so that a round over 1,000
devices of a 1M-parameter model never holds more than one update in memory; the exact
weighted mean of the survivors' clipped updates is accumulated alongside for checking.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import numpy as np

from fedfs_sdk.errors import InputError
from fedfs_sdk.federation.secagg import DevicePolicy, SecAggDevice, SecAggParams, SecAggResult, SecAggServer, from_json, to_json

STEPS = ("advertise", "share_keys", "masked_input", "unmask")
UpdateFn = Callable[[int], tuple[np.ndarray, int]]


def wire_bytes(msg: dict[str, Any]) -> int:
    """Bytes a message takes on the wire: JSON (bytes as base64), the masked vector raw."""
    if "y" in msg and isinstance(msg["y"], (bytes, bytearray)):
        return len(to_json({k: v for k, v in msg.items() if k != "y"})) + len(msg["y"])
    return len(to_json(msg))


@dataclass
class StepCost:
    device_cpu_s: list[float] = field(default_factory=list)   # one entry per device that ran it
    sent: list[int] = field(default_factory=list)             # bytes device → server
    received: list[int] = field(default_factory=list)         # bytes server → device
    server_cpu_s: float = 0.0


@dataclass
class SimReport:
    result: SecAggResult
    expected: np.ndarray            # exact weighted mean of the survivors' clipped updates
    max_abs_error: float
    n_clipped: int
    steps: dict[str, StepCost]
    server: SecAggServer


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0


def run_round(params: SecAggParams, device_ids: Collection[int], update_of: UpdateFn,
              drop: Mapping[str, Collection[int]] | None = None, keep_transcript: bool = False,
              via_json: bool = False, policy: DevicePolicy | None = None) -> SimReport:
    """One round; raises what the server raises (e.g. :class:`RoundFailedError`).
    ``policy``: the devices' (default: the default floors with the ``fedfs-secagg/1`` opt-in —
    this is the cost model of the unauthenticated protocol).
    ``via_json`` passes every message through :func:`to_json` / :func:`from_json`, as a
    transport would."""
    drop = {k: set(v) for k, v in (drop or {}).items()}
    bad = set(drop) - set(STEPS)
    if bad:
        raise InputError(f"unknown drop steps {sorted(bad)}; use {STEPS}")
    ids = sorted(device_ids)
    gone: set[int] = set()
    cost = {s: StepCost() for s in STEPS}
    srv = SecAggServer(params, keep_transcript=keep_transcript)
    pol = policy if policy is not None else DevicePolicy.honest_but_curious()
    devs = {u: SecAggDevice(params, u, policy=pol) for u in ids}

    def send(step: str, u: int, fn: Callable[..., dict], *args: Any) -> None:
        msg, dt = _timed(fn, *args)
        cost[step].device_cpu_s.append(dt)
        cost[step].sent.append(wire_bytes(msg))
        msg = wire(msg)
        _, st = _timed(srv.receive, msg)
        cost[step].server_cpu_s += st

    def wire(msg: Any) -> Any:
        return from_json(to_json(msg)) if via_json else msg

    def alive(step: str) -> list[int]:
        gone.update(drop.get(step, ()))
        return [u for u in ids if u not in gone]

    for u in alive("advertise"):
        send("advertise", u, devs[u].advertise)
    roster, st = _timed(srv.close_advertise)
    cost["advertise"].server_cpu_s += st
    roster_bytes, roster = wire_bytes(roster), wire(roster)
    for u in alive("share_keys"):
        cost["share_keys"].received.append(roster_bytes)
        send("share_keys", u, devs[u].share_keys, roster)
    inboxes, st = _timed(srv.close_share_keys)
    cost["share_keys"].server_cpu_s += st

    acc: np.ndarray | None = None
    n_total = 0
    n_clipped = 0
    fp = params.fixed_point
    for u in alive("masked_input"):
        if u not in inboxes:
            continue
        w, n = update_of(u)
        cost["masked_input"].received.append(wire_bytes(inboxes[u]))
        send("masked_input", u, devs[u].masked_input, wire(inboxes[u]), w, n)
        n_clipped += devs[u].n_clipped
        contrib = np.clip(np.asarray(w, dtype=np.float64), -fp.clip, fp.clip) * n
        acc = contrib if acc is None else acc + contrib
        n_total += n
    request, st = _timed(srv.close_masked)
    cost["masked_input"].server_cpu_s += st
    request_bytes, request = wire_bytes(request), wire(request)
    for u in alive("unmask"):
        if u in request["survivors"]:
            cost["unmask"].received.append(request_bytes)
            send("unmask", u, devs[u].unmask, request)
    result, st = _timed(srv.finalize)
    cost["unmask"].server_cpu_s += st
    assert acc is not None
    expected = acc / n_total
    err = float(np.max(np.abs(result.mean.astype(np.float64) - expected)))
    return SimReport(result=result, expected=expected, max_abs_error=err, n_clipped=n_clipped,
                     steps=cost, server=srv)


def gaussian_updates(dim: int, seed: int = 0, scale: float = 0.05, max_samples: int = 200) -> UpdateFn:
    """Deterministic per-device weights ~ N(0, scale²) and sample counts in [1, max_samples]."""
    def update_of(u: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng([seed, u])
        return rng.normal(0.0, scale, dim).astype(np.float32), int(rng.integers(1, max_samples + 1))
    return update_of
