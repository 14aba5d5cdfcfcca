"""Issue 30: a malicious server that also holds legitimately certified devices (Sybils).

The Sybils are real :class:`SecAggDevice` objects enrolled through the operator's CA; the
server (``tests/secagg_adversary.py``) reads their private state — every share they hold,
their keys — and signs with their identity keys whatever it likes. Each attack below was
checked against the code before issue 30 (main = dc7a663, this file and the harness copied
into a worktree of it): there the victim's update is recovered exactly, or the unsafe round
is accepted — the assertion named in each docstring fails. After issue 30 each is refused.

* replayed consistency signatures across re-runs of one round id;
* SecAgg+: a roster of the victim and k Sybils; the graph steered onto Sybils;
* a default device accepting ``fedfs-secagg/1`` (no identities) silently;
* a fresh device taking plain rounds from a remote host (trust on first use);
* DP floors only checked when the task asked for distributed noise; ``dp_clipped_delta``.

And the guarantee of docs/privacy.md ("Against an active server holding s certified
devices"): at ``s = s* = 2q(n) − n − 1`` the best split of views recovers nothing; at
``s = s* + 1`` it recovers the victim's update — the bound is tight (n = 10: s* = 3).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, fields

import numpy as np
import pytest

from secagg_adversary import Fleet, Plan, attempt, execute, recover
from fedfs_sdk.federation.secagg import (DevicePolicy, RefusedError, ReplayError, SecAggDevice, SecAggError,
                                         SecAggParams, SecAggServer)
from fedfs_sdk.federation.secagg import messages as M
from fedfs_sdk.federation.secagg.params import neighbours


@dataclass(frozen=True)
class _NoSybilFloor(DevicePolicy):
    """The default policy without the floor ``t > s* = 2q(n) − n − 1``: to test the other defences alone."""

    def check_sybil_floor(self, params, t, m, where):
        return None


def _relaxed(p: DevicePolicy) -> DevicePolicy:
    return _NoSybilFloor(**{f.name: getattr(p, f.name) for f in fields(p)})


def _round_log(path=None):
    """A device's round log (None before issue 30, where devices kept none)."""
    try:
        from fedfs_sdk.federation.secagg.round_log import RoundLog
    except ImportError:
        return None
    return RoundLog(path)


def _device(f: Fleet, u: int, log) -> SecAggDevice:
    kw = {"round_log": log} if log is not None and "round_log" in inspect.signature(SecAggDevice).parameters else {}
    return SecAggDevice(f.params, u, identity=f.identity[u], policy=f.policy, **kw)


# ---- 1. replayed consistency signatures ---------------------------------------------------------

def _run_to_consistency(f: Fleet, devs: dict[int, SecAggDevice], shown: dict[int, list[int]]) -> dict[int, bytes]:
    """Key exchange and masked input run honestly; each device is then shown its own survivor
    set and signs it. Returns the signatures."""
    srv = SecAggServer(f.params, ca=f.ca.public)
    for d in devs.values():
        srv.receive(d.advertise())
    roster = srv.close_advertise()
    for d in devs.values():
        srv.receive(d.share_keys(roster))
    inboxes = srv.close_share_keys()
    for u, d in devs.items():
        d.masked_input(inboxes[u], *f.updates[u])
    return {u: d.consistency({"type": M.CONSISTENCY_REQUEST, "round": f.params.round_id,
                              "survivors": shown[u]})["sig"] for u, d in devs.items()}


def test_replayed_consistency_signatures_across_reruns_are_refused(tmp_path):
    """The server runs round 7 twice with the same task. In the first run it shows devices 2…7
    the survivor set X = {1…7} and keeps their signatures; in the second it shows them another
    set and the victim X, with the signatures of run 1 (and its two Sybils'). Before issue 30
    the signed payload was (round, context, U3): the victim found 7 valid signatures over X and
    revealed its shares (``unmask`` returned). Now (a) a device refuses a round id it already
    took part in — its log survives a restart — and (b) without that log (a wiped state),
    run 1's signatures bind run 1's roster keys and do not count in run 2."""
    f = Fleet(10, "v2", seed=11)
    logs = {u: _round_log(tmp_path / f"dev{u}.json" if _round_log() is not None else None) for u in f.ids}
    x = [1, 2, 3, 4, 5, 6, 7]
    run1 = {u: _device(f, u, logs[u]) for u in f.ids}
    sig1 = _run_to_consistency(f, run1, {u: x if u in x else f.ids for u in f.ids})
    # (a) the second run of round 7: every device refuses it, also after a "restart" (log re-read)
    refusals = []
    for u in f.ids:
        try:
            _device(f, u, _round_log(tmp_path / f"dev{u}.json") if logs[u] is not None else None)
        except ReplayError as e:
            refusals.append(str(e))
    assert len(refusals) == 10, "devices took part in round 7 twice"
    assert "already took part in round 7" in refusals[0]
    # (b) devices without a log (state wiped): the replayed signatures do not verify in run 2
    run2 = {u: _device(f, u, None) for u in f.ids}
    y = [1, 2, 8, 9, 10, 3, 4]
    sig2 = _run_to_consistency(f, run2, {u: x if u == 1 else y if u in y else f.ids for u in f.ids})
    replayed = [{"device": u, "sig": sig1[u]} for u in range(2, 8)] + [{"device": 1, "sig": sig2[1]}]
    req = {"type": M.UNMASK_REQUEST, "round": 7, "survivors": x, "dropped": [8, 9, 10], "signatures": replayed}
    with pytest.raises(RefusedError, match="valid consistency signatures over this survivor set in this run"):
        run2[1].unmask(req)


# ---- 2. SecAgg+: roster and graph ---------------------------------------------------------------

SYBILS4 = {26, 27, 28, 29}


def test_secaggplus_roster_of_the_victim_and_k_sybils_is_refused():
    """30 invited, k = 4: the server shows the victim a roster of itself and its 4 Sybils. Before
    issue 30 the device accepted it (roster ≥ t = 4, and k ≥ roster − 1 skipped the degree
    check): the Sybils held all its shares and the server rebuilt its update from them alone
    (``recover`` was true). Now the task itself is refused (t = 4 of 5 holders is not above the
    2·21 − 30 − 1 = 11 certified devices a server may hold within the guarantee), and without that floor the roster is (5 < 21)."""
    five = [1, *sorted(SYBILS4)]
    plan = Plan(rosters={u: five for u in five}, u3={u: set(five) for u in five}, sybils=set(SYBILS4))
    f = Fleet(30, "v2", neighbours=4)
    out = execute(f, plan)
    assert not recover(attempt(f, plan, out, 1), f, 1), "the victim's update was recovered"
    assert "SecAgg+ threshold 4 of 5 share holders is not above 11" in out.refused[1]
    f = Fleet(30, "v2", neighbours=4, seed=1)
    f.policy = _relaxed(f.policy)
    out = execute(f, plan)
    assert "roster has 5 devices, fewer than min_devices=21" in out.refused[1]
    assert attempt(f, plan, out, 1) is None


def test_secaggplus_graph_steered_onto_sybils_is_refused():
    """30 invited, k = 4, a full roster, and the server gives its 4 Sybils exactly the indices
    the graph makes the victim's neighbours — before issue 30 the graph was a public function of
    (round id, device ids), so the server could compute it (or grind round ids) beforehand. The
    round then completes normally and the Sybils' 4 shares rebuild the victim's self-mask: its
    update was recovered. Now the task is refused (the floor above); and without the floor the
    graph follows the run's fresh keys, so the predicted neighbours are not the victim's."""
    p = SecAggParams(round_id=7, dim=64, neighbours=4, participants=30, authenticated=True)
    predicted = set(neighbours(p, list(range(1, 31)))[1])      # what the server computes beforehand
    plan = Plan(rosters={u: list(range(1, 31)) for u in range(1, 31)}, u3={u: set(range(1, 31)) for u in range(1, 31)},
                sybils=predicted)
    f = Fleet(30, "v2", neighbours=4, seed=2)
    out = execute(f, plan)
    assert not recover(attempt(f, plan, out, 1), f, 1), "the victim's update was recovered"
    assert "not above 11" in out.refused[1]
    f = Fleet(30, "v2", neighbours=4, seed=3)
    f.policy = _relaxed(f.policy)
    out = execute(f, plan)
    assert set(f.devs[1]._graph[1]) != predicted            # chance 1/C(29,4) ≈ 4e-5
    assert attempt(f, plan, out, 1) is None


# ---- 3. secure by default -----------------------------------------------------------------------

def test_default_policy_refuses_the_unauthenticated_protocol():
    """``DevicePolicy()`` (what a new user gets without --secagg-ca) took part in fedfs-secagg/1
    rounds silently — where key substitution reads every update
    (test_secagg_attacks.py::test_key_substitution_recovers_every_update…). Now it refuses them
    unless the owner opts in, naming the threat model."""
    p = SecAggParams(round_id=3, dim=8)
    with pytest.raises(RefusedError, match="honest-but-curious server"):
        SecAggDevice(p, 1)
    with pytest.raises(RefusedError, match="--allow-unauthenticated-secagg"):
        SecAggDevice(p, 1, policy=DevicePolicy())
    SecAggDevice(p, 1, policy=DevicePolicy(allow_unauthenticated=True))


def test_fresh_device_requires_secure_rounds_from_a_remote_server(tmp_path):
    """No trust on first use: a fresh device (no state) talking to a server on another machine
    required secure aggregation only once the server had offered it — an on-path attacker who
    stripped the first offers got plain updates. Now it is required from the start (and over
    plain http:// refused before the token travels); loopback keeps the old rule; the owner
    may still accept plain rounds explicitly. Nothing here touches the network."""
    from fedfs_sdk.errors import InputError
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.server_client import ServerClient

    def agent(url: str, **kw):
        return DeviceAgent(ServerClient(url), DeviceState(tmp_path / url.split("//")[1].replace(":", "_")),
                           [tmp_path / "face.jpg"], DeviceConfig(**kw))

    assert agent("https://fl.example.org").secure_required() is True
    remote = agent("http://192.0.2.10:8080")
    assert remote.secure_required() is True
    with pytest.raises(InputError, match="plain http:// to another machine"):
        remote._check_transport()
    assert agent("http://127.0.0.1:8080").secure_required() is False
    assert agent("http://192.0.2.11:8080", require_secure_aggregation=False).secure_required() is False


def _hbc(**kw) -> DevicePolicy:
    """The default floors with fedfs-secagg/1 allowed (before issue 30 the default allowed it)."""
    names = {f.name for f in fields(DevicePolicy)}
    return DevicePolicy(**kw, **({"allow_unauthenticated": True} if "allow_unauthenticated" in names else {}))


# ---- 4. DP floors ------------------------------------------------------------------------------

FIELDS = {"dim": 4, "threshold": None, "neighbours": None, "clip": 0.5, "scale_bits": 24, "max_devices": 4,
          "max_samples": 1, "min_devices": 3, "layout_sha256": "0" * 64, "device": 1}


@pytest.mark.parametrize("case", ["no_dp", "central_sigma_0", "central_below", "clipped_delta"])
def test_dp_floor_holds_whatever_the_task_says(case):
    """A device with ``--dp-min-noise 1`` checked σ only when the task asked for distributed
    noise: a round without DP, or with central σ = 0 or 0.5, was accepted; the older input
    ``dp_clipped_delta`` (its weight word reveals Σ min(n, ŵ)) was accepted by any device. Now
    each is refused before any key is sent."""
    from fedfs_sdk.federation.secagg.http_device import DP_INPUT, DP_INPUT_V1, SecAggRoundLost, SecAggSession

    dp = {"clip": 0.5, "noise_multiplier": 1.0, "denominator": 4.0, "weight_cap": 10}
    floor = _hbc(min_noise_multiplier=1.0)
    task = {"round_id": 1, "secagg": {**FIELDS, "input": DP_INPUT}, "dp": dp}
    if case == "no_dp":
        task = {"round_id": 1, "secagg": dict(FIELDS)}
    elif case == "central_sigma_0":
        task["dp"] = {**dp, "noise_multiplier": 0.0}
    elif case == "central_below":
        task["dp"] = {**dp, "noise_multiplier": 0.5}
    else:
        task["secagg"]["input"] = DP_INPUT_V1
        floor = _hbc()
    with pytest.raises(SecAggRoundLost, match="without differential privacy|below this device's minimum|"
                                              "older input 'dp_clipped_delta'"):
        SecAggSession(None, task, policy=floor)
    SecAggSession(None, {"round_id": 1, "secagg": {**FIELDS, "input": DP_INPUT}, "dp": dp}, policy=floor)


# ---- 5. the guarantee at its bound ---------------------------------------------------------------

def _split(n: int, sybils: set[int], a: set[int], b: set[int]) -> Plan:
    """The best split of views against victim 1: it and group ``a`` are told ``b`` dropped (they
    reveal b_1 with the Sybils), group ``b`` is told 1 and ``a`` dropped (it reveals s_sk_1)."""
    everyone = list(range(1, n + 1))
    ua, ub = {1} | a | sybils, b | sybils
    u3 = {u: (ub if u in b else ua) for u in everyone}
    return Plan(rosters={u: everyone for u in everyone}, u3=u3, sybils=set(sybils))


def test_guarantee_at_the_bound_s_star():
    """n = 10, q = 7: the server holds s = s* = 2q − n − 1 = 3 certified devices. Whatever split of the 7
    honest devices it tries, one of the two survivor sets lacks q signatures (|a| + 1 + 3 ≥ 7
    and |b| + 3 ≥ 7 need 7 honest besides the victim's group): nothing is revealed for it and
    the victim's update stays hidden."""
    sybils = {8, 9, 10}
    for a, b in (({2, 3}, {4, 5, 6, 7}), ({2, 3, 4}, {5, 6, 7})):
        f = Fleet(10, "v2", seed=len(a))
        plan = _split(10, sybils, a, b)
        out = execute(f, plan)
        assert attempt(f, plan, out, 1) is None
        short = b if len(b) + 3 < 7 else {1} | a
        assert all(u in out.refused for u in short), out.refused      # too few survivors or signatures


def test_guarantee_just_past_the_bound_recovers_the_victim():
    """n = 10, s = 4 = s* + 1: a = {2, 3}, b = {4, 5, 6}. Each survivor set has exactly 7
    signatures (its honest members and the 4 Sybils), the victim's group reveals b_1, group b
    reveals s_sk_1: the update is recovered — docs/privacy.md states the bound as tight."""
    sybils = {7, 8, 9, 10}
    f = Fleet(10, "v2", seed=5)
    plan = _split(10, sybils, {2, 3}, {4, 5, 6})
    out = execute(f, plan)
    assert not set(out.refused) - sybils, out.refused
    assert recover(attempt(f, plan, out, 1), f, 1)


def test_no_device_state_is_needed_for_a_one_shot_device():
    """The round log is the device's: a SecAggDevice without one still runs a round (the
    simulator and one-shot tools), and a log refuses only its own scope's round ids."""
    log = _round_log()
    if log is None:
        pytest.skip("no round log before issue 30")
    log.record(7, "ca-a", "t")
    assert log.seen(7, "ca-a") and not log.seen(7, "ca-b") and not log.seen(8, "ca-a")
    with pytest.raises(SecAggError, match="already took part in round 7"):
        log.record(7, "ca-a", "t")


def test_serve_refuses_a_plain_http_bind_off_loopback(tmp_path):
    """``fedfs serve --host 0.0.0.0`` without TLS listened in plain HTTP without a word. Now it
    stops before binding (nothing listens), naming --tls-cert/--tls-key and the opt-out;
    loopback, TLS or --insecure-plain-http pass the check."""
    from conftest_server import refused_serve
    from fedfs_sdk.errors import InputError
    from server_agg.cli import check_plain_bind

    for host in ("0.0.0.0", "192.0.2.1", "::", "fl.example.org"):
        with pytest.raises(InputError, match="--insecure-plain-http"):
            check_plain_bind(host, tls=False, insecure_plain_http=False)
    for host in ("127.0.0.1", "localhost", "::1"):
        check_plain_bind(host, tls=False, insecure_plain_http=False)
    check_plain_bind("0.0.0.0", tls=True, insecure_plain_http=False)
    check_plain_bind("0.0.0.0", tls=False, insecure_plain_http=True)
    # in this process on a held port (a bind would fail, not serve); the last --host wins
    r = refused_serve("--host", "0.0.0.0", "--state", str(tmp_path / "s"), "--init-backbone", "tiny")
    assert r.returncode != 0 and "without TLS" in r.stderr, r.stderr[-1500:]
    assert not (tmp_path / "s").exists()


def test_dp_floor_holds_in_plain_rounds_too(tmp_path):
    """A device with ``--dp-min-noise 1`` took a plain round without DP (its update in the clear,
    no noise on the sum) — the floor applied to secure rounds only. Now the agent refuses it
    before training; a plain round with σ ≥ the floor passes the check."""
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.secagg.http_device import SecAggRoundLost
    from fedfs_sdk.federation.server_client import ServerClient

    agent = DeviceAgent(ServerClient("http://127.0.0.1:9"), DeviceState(tmp_path / "d"), [tmp_path / "f.jpg"],
                        DeviceConfig(secagg=_hbc(min_noise_multiplier=1.0)))
    assert hasattr(agent, "_check_dp_floor"), "no DP floor for plain rounds"
    with pytest.raises(SecAggRoundLost, match="without differential privacy"):
        agent._check_dp_floor({"round_id": 1})
    dp = {"clip": 0.5, "noise_multiplier": 0.5, "denominator": 4.0, "weight_cap": 10}
    with pytest.raises(SecAggRoundLost, match="below this device's minimum"):
        agent._check_dp_floor({"round_id": 1, "dp": dp})
    agent._check_dp_floor({"round_id": 1, "dp": {**dp, "noise_multiplier": 1.2}})
