"""Secure aggregation on the real HTTP server (``fedfs serve --secure-aggregation``): a server
subprocess on 127.0.0.1, devices speaking the protocol with :class:`SecAggSession` (the code
the device agents use) and synthetic updates, so each round runs in seconds.

What is checked: what the server receives and stores holds no device's update in the clear;
the published model is the FedAvg of the survivors to the fixed-point bound of
docs/privacy.md; dropouts after masking up to n − t are recovered and one more fails the
round cleanly (and the next round opens); bad messages get a 4xx and change nothing; a
SIGKILLed server resumes the round from its saved state.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest_server import ADMIN, read_safetensors, start_server, wait_open, wait_round
from fedfs_sdk.federation.server_client import RetryPolicy, ServerClient
from fedfs_sdk.training.ort_device import encode_update
from fedfs_sdk.federation.secagg import DevicePolicy, FixedPoint, from_json, to_json
from fedfs_sdk.federation.secagg.http_device import SecAggSession, flatten_update
from server_agg.secagg_rounds import SecAggRound

pytestmark = pytest.mark.timeout(180)

N = 7
T = 5                      # the default ⌊2N/3⌋ + 1 (devices refuse less); tolerates N − T = 2 dropouts
SCALE = 2.0 ** -24         # docs/privacy.md: default secagg_scale_bits = 24
# |published − exact weighted mean| ≤ ½·2^-24 (fixed point) + |mean|·2^-24 (float32), stated in docs
ATOL, RTOL = 0.5 * SCALE * 1.01, SCALE * 1.01

SERVER_ARGS = ("--init-backbone", "tiny", "--code-length", "127", "--min-participants", str(N),
               "--secure-aggregation", "--secagg-threshold", str(T), "--secagg-phase-timeout", "3",
               "--round-timeout", "5", "--device-ttl", "0")


class Dev:
    """One registered device: token, HTTP client, and its update for the current round."""

    def __init__(self, url: str) -> None:
        reg = httpx.post(url + "/v1/devices").json()
        self.id, self.token = reg["device_id"], reg["token"]
        self.client = ServerClient(url, self.token, retry=RetryPolicy(attempts=20, base_delay_s=0.2, max_delay_s=1.0))
        self.session: SecAggSession | None = None
        self.body = b""
        self.w = np.zeros(0)
        self.n = 0
        self.y = b""

    def task(self) -> dict:
        return self.client.task()

    def start(self, rnd: int, ref: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        task = self.task()
        assert task["action"] == "train" and task["round_id"] == rnd and task["secagg"]["device"] >= 1, task
        self.session = SecAggSession(self.client, task, sleep=time.sleep, policy=DevicePolicy.honest_but_curious())
        self.n = int(rng.integers(1, 50))
        upd = {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in ref.items()}
        self.body = encode_update(upd, round_id=rnd, model_version=task["model_version"], num_samples=self.n)
        self.w, _ = flatten_update(self.body)

    def mask(self) -> dict:
        assert self.session is not None
        ack = self.session.masked_input(self.body)
        self.y = b""
        return ack


def model(srv, version: int) -> dict[str, np.ndarray]:
    with srv.admin() as c:
        return read_safetensors(c.get(f"/v1/models/{version}").content)[0]


def expected_mean(devs: list[Dev]) -> np.ndarray:
    clip = 256.0
    tot = sum(d.n for d in devs)
    return sum(np.clip(d.w, -clip, clip) * d.n for d in devs) / tot


def flat(weights: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(weights[k], dtype=np.float64).ravel() for k in sorted(weights)])


def started_devices(srv, seed: int) -> tuple[list[Dev], np.random.Generator]:
    """N registered devices, round 1 open, each holding its round-1 update (and the rng that drew them)."""
    devs = [Dev(srv.url) for _ in range(N)]
    wait_open(srv, 1)
    rng = np.random.default_rng(seed)
    ref = model(srv, 1)
    for d in devs:
        d.start(1, ref, rng)
    return devs, rng


def run_round(srv, devs: list[Dev], rnd: int, rng, drop_after_share: int = 0, drop_after_mask: int = 0,
              on_masked=None) -> dict:
    ref = model(srv, 1)
    for d in devs:
        d.start(rnd, ref, rng)
    for d in devs:
        d.session.advertise()
    for d in devs:
        d.session.share_keys()
    maskers = devs[drop_after_share:]
    acks = [d.mask() for d in maskers]
    for d, a in zip(maskers, acks):
        assert a["step"] == "masked-input"
    if on_masked is not None:
        on_masked(maskers)
    for d in maskers[drop_after_mask:]:
        d.session.unmask()
    return wait_round(srv, rnd)


def assert_fedavg(srv, info: dict, survivors: list[Dev]) -> None:
    assert info["state"] == "closed", info
    assert info["accepted"] == len(survivors) and info["total_samples"] == sum(d.n for d in survivors)
    got = flat(model(srv, info["result_version"]))
    exp = expected_mean(survivors)
    np.testing.assert_allclose(got, exp.astype(np.float32).astype(np.float64), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got, exp, rtol=RTOL, atol=ATOL)


def state_files(state: Path) -> list[Path]:
    return [p for p in state.rglob("*") if p.is_file()]


def test_server_sees_only_masked_vectors_and_publishes_fedavg(tmp_path):
    srv = start_server(tmp_path / "server", *SERVER_ARGS, "--rounds", "1")
    try:
        devs = [Dev(srv.url) for _ in range(N)]
        wait_open(srv, 1)
        rng = np.random.default_rng(0)
        fp = FixedPoint()
        seen: dict[str, object] = {}

        def inspect(maskers: list[Dev]) -> None:
            snap_path = tmp_path / "server" / "secagg" / "r000001.json"
            snap = from_json(snap_path.read_bytes())
            seen["snap"] = snap
            summed = SecAggRound.load(snap_path, 1).srv._sum     # the snapshot, its journal and the sum file
            words = sum(fp.encode(d.w, d.n)[0] for d in maskers)      # Σ enc(n·w) mod 2^64 (unmasked)
            assert summed.size == words.size
            # the last masked input closed the phase: a new snapshot, the journal of its messages gone
            assert sorted(p.name for p in snap_path.parent.iterdir()) == ["r000001.json", f"r000001.sum{N}"]
            # the stored running sum still carries the self masks: no coordinate matches the plain sum
            assert np.count_nonzero(summed == words) <= 2
            # nothing in the state holds a device's update: search every file for a 64-byte run of
            # each device's float32 weights and of its fixed-point words n·w·2^24
            blobs = [p.read_bytes() for p in state_files(tmp_path / "server")]
            for d in maskers:
                w32 = d.w.astype(np.float32).tobytes()
                enc = fp.encode(d.w, d.n)[0].astype("<u8").tobytes()
                for needle in (w32[4000:4064], enc[8000:8064], d.body[-64:]):
                    assert not any(needle in b for b in blobs)
            seen["files"] = sorted(str(p.relative_to(tmp_path / "server")) for p in state_files(tmp_path / "server"))

        info = run_round(srv, devs, 1, rng, on_masked=inspect)
        assert_fedavg(srv, info, devs)
        assert info["secure_aggregation"]["survivors"] == N and info["secure_aggregation"]["threshold"] == T
        # the protocol file is gone with the round; no update file was ever written
        assert not list((tmp_path / "server" / "secagg").iterdir())
        assert not any("updates/r" in f and f.endswith(".safetensors") for f in seen["files"])
    finally:
        srv.stop()


def test_masked_vectors_hide_each_update(tmp_path):
    """Each y_u the server receives, decoded as if it were an unmasked encoding, is nowhere near
    that device's n·w (read from the wire via the device's own masked message)."""
    srv = start_server(tmp_path / "server", *SERVER_ARGS, "--rounds", "1")
    try:
        devs, _ = started_devices(srv, seed=1)
        for d in devs:
            d.session.advertise()
        for d in devs:
            d.session.share_keys()
        fp = FixedPoint()
        for d in devs:                                  # capture y_u exactly as sent
            sent = {}
            orig = d.client.request

            def spy(method, path, content=None, _o=orig, _s=sent, **kw):
                if path.endswith("/masked-input"):
                    _s["y"] = content
                return _o(method, path, content=content, **kw)
            d.client.request = spy  # type: ignore[method-assign]
            ack = d.mask()
            y = np.frombuffer(sent["y"], dtype="<u8")
            assert ack["sha256"] == hashlib.sha256(sent["y"]).hexdigest()
            plain = fp.encode(d.w, d.n)[0]
            as_if_plain = y[:-1].view(np.int64).astype(np.float64) / (d.n / SCALE)
            assert int(y[-1]) != d.n
            assert np.mean(np.abs(as_if_plain - d.w) < 1.0) < 0.01     # uniform: |value| ~ 2^63 / (n·2^24)
            assert np.count_nonzero(y == plain) <= 2
        for d in devs:
            d.session.unmask()
        assert_fedavg(srv, wait_round(srv, 1), devs)
    finally:
        srv.stop()


def test_dropouts_up_to_n_minus_t_recovered_one_more_fails_cleanly(tmp_path):
    srv = start_server(tmp_path / "server", *SERVER_ARGS, "--rounds", "5")
    try:
        devs = [Dev(srv.url) for _ in range(N)]
        rng = np.random.default_rng(2)
        for rnd, drop in ((1, 0), (2, 1), (3, N - T)):            # after masking: inputs still count
            wait_open(srv, rnd)
            info = run_round(srv, devs, rnd, rng, drop_after_mask=drop)
            assert_fedavg(srv, info, devs)
            assert info["secure_aggregation"]["dropped"].get("unmask", 0) == drop
        wait_open(srv, 4)
        info = run_round(srv, devs, 4, rng, drop_after_mask=N - T + 1)   # one more: too few shares
        assert info["state"] == "failed" and info["result_version"] is None
        assert f"threshold is {T}" in info["reason"], info["reason"]
        with srv.admin() as c:
            assert c.get("/v1/models/latest").json()["version"] == 4     # v1 + rounds 1–3; round 4 published nothing
        # the next round opens and works: one drop before masking (not in the sum), one after
        wait_open(srv, 5)
        late = {}

        def after_masking(_):            # the masked phase ends at its deadline; devs[0] missed it
            assert "inbox" in devs[0].session.view()
            while devs[1].session.view()["phase"] != "unmask":
                time.sleep(0.1)
            late.update(devs[0].session.view())
        info = run_round(srv, devs, 5, rng, drop_after_share=1, drop_after_mask=1, on_masked=after_masking)
        assert late["phase"] == "unmask" and late["dropped"] is True and "unmask_request" not in late
        assert_fedavg(srv, info, devs[1:])
        assert info["secure_aggregation"]["dropped"].get("masked_input") == 1
    finally:
        srv.stop()


def test_secagg_plus_neighbours_over_http(tmp_path):
    """SecAgg+ (Bell et al. 2020): each of 8 devices masks with k = 4 of the 7 others (the
    devices' default minimum degree); threshold ⌊2·5/3⌋ + 1 = 4 of its 5 share holders, so one
    drop after masking is recovered."""
    n = 8
    args = [a for a in SERVER_ARGS]
    args[args.index("--secagg-threshold") + 1] = "4"
    args[args.index("--min-participants") + 1] = str(n)
    srv = start_server(tmp_path / "server", *args, "--secagg-neighbours", "4", "--rounds", "2")
    try:
        devs = [Dev(srv.url) for _ in range(n)]
        rng = np.random.default_rng(6)
        for rnd, drop in ((1, 0), (2, 1)):
            wait_open(srv, rnd)
            info = run_round(srv, devs, rnd, rng, drop_after_mask=drop)
            assert_fedavg(srv, info, devs)
            assert info["secure_aggregation"]["threshold"] == 4
        # the graph really was sparse: each device shared keys with 4 neighbours, not 7
        assert all(len(d.session.device._graph[d.session.index]) == 4 for d in devs)
    finally:
        srv.stop()


def _post(d: Dev, step: str, msg: dict | bytes, rnd: int = 1) -> httpx.Response:
    body = msg if isinstance(msg, bytes) else to_json(msg).encode()
    ctype = "application/octet-stream" if step == "masked-input" else "application/json"
    method = "PUT" if step == "masked-input" else "POST"
    return httpx.request(method, f"{d.client.base_url}/v1/rounds/{rnd}/secagg/{step}", content=body,
                         headers={"Authorization": f"Bearer {d.token}", "Content-Type": ctype})


def test_bad_messages_get_4xx_and_change_nothing(tmp_path):
    srv = start_server(tmp_path / "server", *SERVER_ARGS, "--rounds", "1", "--round-timeout", "20",
                       "--secagg-phase-timeout", "20")
    try:
        devs = [Dev(srv.url) for _ in range(N)]
        wait_open(srv, 1)
        outsider = Dev(srv.url)            # registered after the round opened: not sampled
        rng = np.random.default_rng(3)
        ref = model(srv, 1)
        for d in devs:
            d.start(1, ref, rng)
        a = devs[0]
        adv = a.session.device.advertise()
        assert _post(a, "masked-input", b"\0" * 16).status_code == 409            # wrong phase
        assert _post(a, "advertise", {**adv, "device": adv["device"] % N + 1}).status_code == 403   # not its index
        assert _post(outsider, "advertise", adv).json()["error"] == "not_selected"
        r = httpx.post(f"{srv.url}/v1/rounds/1/secagg/advertise", content=to_json(adv),
                       headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
        assert r.status_code == 401
        assert _post(a, "advertise", b"{not json").status_code == 422
        assert _post(a, "advertise", adv).status_code == 200
        assert _post(a, "advertise", adv).json()["error"] == "replay_or_wrong_step"     # replay → 409
        plain = httpx.put(f"{srv.url}/v1/rounds/1/update", content=a.body,
                          headers={"Authorization": f"Bearer {a.token}", "Content-Type": "application/octet-stream"})
        assert plain.status_code == 409 and plain.json()["error"] == "secure_round"
        for d in devs[1:]:
            d.session.advertise()
        msg = None
        for d in devs:
            roster = d.session._wait_for("roster", "share_keys")
            m = d.session.device.share_keys(roster)
            if d is a:
                msg = m
                bad = {**m, "ciphertexts": m["ciphertexts"][:-1] + [{"to": 99, "ct": m["ciphertexts"][-1]["ct"]}]}
                r = _post(a, "share-keys", bad)                    # a share for a device that never joined
                assert r.status_code == 403 and r.json()["error"] == "unknown_device", r.text
            assert _post(d, "share-keys", m).status_code == 200
        assert _post(a, "share-keys", msg).status_code == 409     # replayed share
        inbox = a.session._wait_for("inbox", "masked")
        good = a.session.device.masked_input(inbox, a.w, a.n)["y"]
        r = _post(a, "masked-input", good[:-8])                              # one word short
        assert r.status_code == 422 and r.json()["error"] == "bad_message", r.text
        assert _post(a, "masked-input", good + b"\0" * 8).status_code == 413  # one word long: cut off at the limit
        assert _post(a, "masked-input", good).status_code == 200
        assert _post(a, "masked-input", good).status_code == 409               # replay
        for d in devs[1:]:
            d.mask()
        req = a.session._wait_for("unmask_request", "unmask")
        um = a.session.device.unmask(req)
        forged = {**um, "s_shares": [{"of": 2, "share": um["b_shares"][0]["share"]}]}   # s-share of a survivor
        assert _post(a, "unmask", forged).status_code == 403
        assert _post(a, "unmask", um).status_code == 200
        assert _post(a, "unmask", um).status_code == 409
        for d in devs[1:]:
            d.session.unmask()
        assert_fedavg(srv, wait_round(srv, 1), devs)
        assert _post(a, "unmask", um).status_code == 410                       # round over
    finally:
        srv.stop()


def test_garbage_masked_vector_fails_the_round_never_a_wrong_sum(tmp_path):
    """Any 8·(dim + 1) bytes are a well-formed element of Z_2^64, so the server cannot refuse a
    garbled y_u on arrival; the unmasked sum then lies outside what valid inputs can sum to,
    and the round fails instead of publishing."""
    import os

    srv = start_server(tmp_path / "server", *SERVER_ARGS, "--rounds", "1")
    try:
        devs, _ = started_devices(srv, seed=7)
        for d in devs:
            d.session.advertise()
        for d in devs:
            d.session.share_keys()
        bad = devs[0]
        bad.session._wait_for("inbox", "masked")
        assert _post(bad, "masked-input", os.urandom(8 * (bad.w.size + 1))).status_code == 200
        for d in devs[1:]:
            d.mask()
        for d in devs[1:]:                          # 4 ≥ t answer: enough shares to unmask
            d.session.unmask()
        info = wait_round(srv, 1)
        assert info["state"] == "failed" and "corrupted" in info["reason"], info
        with srv.admin() as c:
            assert c.get("/v1/models/latest").json()["version"] == 1
    finally:
        srv.stop()


@pytest.mark.parametrize("kill_in", ["advertise", "share_keys", "masked", "unmask"])
def test_sigkill_in_each_phase_resumes_from_saved_state(tmp_path, kill_in):
    """SIGKILL after 3 of 5 devices answered a phase; the restarted server restores the saved
    state, the other devices go on, and the published sum is the FedAvg of all five."""
    state = tmp_path / "server"
    args = (*SERVER_ARGS, "--rounds", "1", "--round-timeout", "60", "--secagg-phase-timeout", "60")
    srv = start_server(state, *args)
    port = int(srv.url.rsplit(":", 1)[1])
    steps = [("advertise", lambda d: d.session.advertise()), ("share_keys", lambda d: d.session.share_keys()),
             ("masked", lambda d: d.mask()), ("unmask", lambda d: d.session.unmask())]
    try:
        devs, _ = started_devices(srv, seed=4)
        for phase, act in steps:
            for i, d in enumerate(devs):
                if phase == kill_in and i == 3:
                    srv.kill()
                    srv = start_server(state, *args, port=port)
                    sa = srv.status()["round"]["secure_aggregation"]
                    assert sa["phase"] == kill_in
                    assert sa[{"advertise": "advertised", "share_keys": "shared", "masked": "masked",
                               "unmask": "unmasked"}[kill_in]] == 3
                act(d)
        assert_fedavg(srv, wait_round(srv, 1), devs)
    finally:
        srv.stop()


def test_unreadable_saved_state_fails_the_round_cleanly(tmp_path):
    state = tmp_path / "server"
    args = (*SERVER_ARGS, "--rounds", "2", "--round-timeout", "60", "--secagg-phase-timeout", "60")
    srv = start_server(state, *args)
    port = int(srv.url.rsplit(":", 1)[1])
    try:
        devs, rng = started_devices(srv, seed=5)
        for d in devs:
            d.session.advertise()
        srv.kill()
        (state / "secagg" / "r000001.json").write_bytes(b'{"format": "fedfs-secagg-round/1", "round_id": 1}')
        srv = start_server(state, *args, port=port)
        with srv.admin() as c:
            info = c.get("/v1/rounds/1").json()
        assert info["state"] == "failed" and "state lost at restart" in info["reason"], info
        wait_open(srv, 2)                                   # the next round opens and works
        info = run_round(srv, devs, 2, rng)
        assert_fedavg(srv, info, devs)
    finally:
        srv.stop()


def test_secure_aggregation_refuses_max_update_norm_without_dp(tmp_path):
    """A norm bound without DP would need the server to see each update: refused at start."""
    from conftest_server import refused_serve

    r = refused_serve("--state", str(tmp_path / "s"), "--init-backbone", "tiny", "--code-length", "127",
                      "--secure-aggregation", "--max-update-norm", "1.0")
    assert r.returncode != 0 and "max_update_norm" in r.stderr
    assert not (tmp_path / "s").exists()
