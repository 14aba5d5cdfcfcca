"""User-level DP-FedAvg together with secure aggregation on the real HTTP server (a ``fedfs
serve --secure-aggregation --dp-noise-multiplier …`` subprocess on 127.0.0.1, devices speaking
the protocol with :class:`SecAggSession`, synthetic updates so each round takes seconds).

Checked: the server's state and the masked vectors it receives hold no device's (clipped)
update in the clear; the published model is ``w + (Σ w_k·clip_C(Δ_k) + N(0, σ²C²)) / (q·N)``
— the sum recomputed here from each device's update, the noise checked by a chi-square test
on its variance and by the mean of each device's block (a wrong weight or denominator moves
a block mean by ≥ 7 of its standard errors); ε at δ is published with each version as in
the plain DP path, and the budget stops the federation."""
from __future__ import annotations

import hashlib
import json
import math
import time

import httpx
import numpy as np
import pytest
from scipy import stats

from conftest_server import read_safetensors, start_server, wait_open, wait_round
from fedfs_sdk.training.ort_device import encode_update
from fedfs_sdk.federation.secagg import DevicePolicy, FixedPoint
from fedfs_sdk.federation.secagg.http_device import DP_INPUT, SecAggRoundLost, SecAggSession
from fedfs_sdk.federation.server_client import RetryPolicy, ServerClient
from server_agg.dp import epsilon
from server_agg.secagg_rounds import SecAggRound

pytestmark = pytest.mark.timeout(240)

N = 4                       # q = 1: every device is in every round; default threshold ⌊2·4/3⌋ + 1 = 3
SIGMA, CLIP, DELTA, CAP = 0.1, 0.5, 1e-5, 10
SAMPLES = (3, 10, 40, 7)    # weights min(n/ŵ, 1) = 0.3, 1, 1, 0.7
BLOCK = 2000                # device i moves the i-th block of 2000 floating coordinates
DENOM = 1.0 * N             # q·N


def _flat(weights: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(weights[k], dtype=np.float64).ravel() for k in sorted(weights)])


def _floating(weights: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.full(weights[k].size, np.issubdtype(weights[k].dtype, np.floating))
                           for k in sorted(weights)])


def _unflat(vec: np.ndarray, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for k in sorted(like):
        n = like[k].size
        out[k] = vec[at:at + n].reshape(like[k].shape).astype(like[k].dtype)
        at += n
    return out


def _model(srv, version: int) -> tuple[bytes, dict[str, np.ndarray], dict[str, str]]:
    with srv.admin() as c:
        data = c.get(f"/v1/models/{version}").content
    w, meta = read_safetensors(data)
    return data, w, meta


class Dev:
    def __init__(self, url: str, i: int) -> None:
        reg = httpx.post(url + "/v1/devices").json()
        self.i, self.token = i, reg["token"]
        self.client = ServerClient(url, self.token, retry=RetryPolicy(attempts=20, base_delay_s=0.2, max_delay_s=1.0))
        self.session: SecAggSession | None = None

    def prepare(self, rnd: int, ref_bytes: bytes, ref: dict[str, np.ndarray], rng: np.random.Generator,
                samples: tuple[int, ...] = SAMPLES) -> None:
        """The round's update ``w + Δ`` (float32 body) and, independently of the SDK, the
        clipped, weighted Δ this device should mask."""
        task = self.client.task()
        assert task["action"] == "train" and task["round_id"] == rnd, task
        assert task["secagg"]["input"] == DP_INPUT and task["dp"]["clip"] == CLIP
        assert task["secagg"]["max_samples"] == 1        # the weight word: w_k·Δ travels with weight 1
        assert task["secagg"]["clip"] == CLIP or "dp_noise" in task["secagg"]       # range C (central noise)
        self.session = SecAggSession(self.client, task, sleep=time.sleep, policy=DevicePolicy.honest_but_curious())
        flat, fl = _flat(ref), _floating(ref)
        idx = np.flatnonzero(fl)[self.i * BLOCK:(self.i + 1) * BLOCK]
        delta = np.zeros_like(flat)
        # devices 0–2: ‖Δ‖ ≫ C (clipped on the device); device 3: ‖Δ‖ ≈ 0.045 < C (sent as is)
        delta[idx] = rng.normal(1.0, 0.3, BLOCK) if self.i < 3 else rng.normal(0, 1e-3, BLOCK)
        self.n = samples[self.i]
        new = _unflat(flat + delta, ref)
        self.body = encode_update(new, round_id=rnd, model_version=task["model_version"], num_samples=self.n)
        self.ref_bytes = ref_bytes
        self.trained = _flat(new)
        sent = _flat(new) - flat                          # what the float32 body really carries
        sent[~fl] = 0.0
        norm = float(np.sqrt(np.sum(sent ** 2)))
        self.clipped = sent * min(1.0, CLIP / norm)
        self.weight = min(self.n / CAP, 1.0)
        self.idx = idx
        self.y = b""

    def mask(self) -> dict:
        orig = self.client.request

        def spy(method, path, content=None, **kw):
            if path.endswith("/masked-input"):
                self.y = content
            return orig(method, path, content=content, **kw)

        self.client.request = spy  # type: ignore[method-assign]
        try:
            return self.session.masked_input(self.body, reference=self.ref_bytes)
        finally:
            self.client.request = orig  # type: ignore[method-assign]


def _state_blobs(root) -> list[bytes]:
    return [p.read_bytes() for p in root.rglob("*") if p.is_file()]


def _args(sigma: float) -> tuple[str, ...]:
    return ("--init-backbone", "tiny", "--code-length", "127", "--min-participants", str(N),
            "--participation", "1.0", "--secure-aggregation", "--secagg-phase-timeout", "5",
            "--round-timeout", "60", "--device-ttl", "0", "--rounds", "5",
            "--max-update-norm", str(CLIP), "--dp-noise-multiplier", str(sigma), "--dp-delta", str(DELTA),
            "--dp-weight-cap", str(CAP))


def _server(state, sigma: float, *extra: str):
    return start_server(state, *_args(sigma), *extra)


def _secure_round(srv, state, devs: list[Dev], rnd: int, rng) -> tuple[dict, dict, dict, dict]:
    """Run round ``rnd`` with every device and check (1): the masked vectors received and every
    file of the server's state hold no device's update. Returns ``(w, published, meta, info)``."""
    wait_open(srv, rnd, timeout=60.0)
    ref_bytes, ref, _ = _model(srv, rnd)
    for d in devs:
        d.prepare(rnd, ref_bytes, ref, rng)
    for d in devs:
        d.session.advertise()
    for d in devs:
        d.session.share_keys()
    acks = [d.mask() for d in devs]
    assert [a["num_samples"] for a in acks] == [1] * N          # w_k·Δ with weight word 1: Σn' is never formed
    fp = FixedPoint(clip=CLIP, scale_bits=24, max_devices=N, max_samples=1)
    snap_path = state / "secagg" / f"r{rnd:06d}.json"
    summed = SecAggRound.load(snap_path, rnd).srv._sum      # the snapshot, its journal and the sum file
    plain = [fp.encode(d.weight * d.clipped, 1)[0] for d in devs]
    assert np.count_nonzero(summed == sum(plain)) <= 2          # self masks still on the stored sum
    blobs = _state_blobs(state)
    for d, enc in zip(devs, plain):
        y = np.frombuffer(d.y, dtype="<u8")
        assert y.size == enc.size and hashlib.sha256(d.y).hexdigest() == acks[d.i]["sha256"]
        assert np.count_nonzero(y == enc) <= 2                  # the wire carries y_u, not enc(w_k·Δ)
        at = 8 * int(d.idx[0])
        for needle in (enc.astype("<u8").tobytes()[at:at + 64], d.clipped[d.idx[:8]].tobytes(),
                       d.clipped[d.idx[:16]].astype(np.float32).tobytes(),
                       d.trained[d.idx[:16]].astype(np.float32).tobytes()):   # its w + Δ
            assert not any(needle in b for b in blobs)
    for d in devs:
        d.session.unmask()
    info = wait_round(srv, rnd, timeout=60.0)
    assert info["state"] == "closed" and info["result_version"] == rnd + 1, info
    assert info["secure_aggregation"]["survivors"] == N
    assert not list((state / "secagg").glob(f"r{rnd:06d}.*"))  # the protocol state goes with the round
    _, pub, meta = _model(srv, rnd + 1)
    m = json.loads(meta["meta"])
    # the sample counts are not covered by ε: not published (and under secure aggregation never known)
    assert m["num_updates"] == N and m["total_samples"] is None and info["total_samples"] is None
    return ref, pub, m, info


def _exact_update(ref: dict, devs: list[Dev]) -> np.ndarray:
    """``Σ w_k·clip_C(Δ_k) / (q·N)``, recomputed here from each device's update."""
    return sum(d.weight * d.clipped for d in devs) / DENOM


def test_secure_dp_without_noise_publishes_exactly_the_clipped_weighted_sum(tmp_path):
    """σ = 0 isolates the estimator: published − w = Σ w_k·clip(Δ_k) / (q·N) to the fixed-point
    and float32 error (≤ 2^-24 per coordinate each, docs/privacy.md), and ε is published as ∞."""
    srv = _server(tmp_path / "server", 0.0)
    try:
        devs = [Dev(srv.url, i) for i in range(N)]
        ref, pub, meta, _ = _secure_round(srv, tmp_path / "server", devs, 1, np.random.default_rng(3))
        fl = _floating(ref)
        got = (_flat(pub) - _flat(ref))[fl]
        exp = _exact_update(ref, devs)[fl]
        tol = 2.0 ** -24 * (1.0 + np.abs(_flat(ref)[fl])) * 2      # fixed point + float32 mean + float32 storage
        assert np.all(np.abs(got - exp) <= tol), float(np.max(np.abs(got - exp)))
        assert np.abs(exp).max() > 1e3 * tol.max()                  # the signal is far above the tolerance
        assert np.all((_flat(pub) == _flat(ref))[~fl])             # integer buffers are not averaged
        assert meta["dp"]["epsilon"] == "inf" and meta["dp"]["noise_multiplier"] == 0.0
    finally:
        srv.stop()


def test_secure_dp_rounds_publish_noisy_clipped_sum_with_epsilon_and_budget(tmp_path):
    eps = [epsilon([(1.0, SIGMA, t)], DELTA) for t in (1, 2, 3)]
    budget = (eps[1] + eps[2]) / 2                  # two rounds fit, the third does not
    state = tmp_path / "server"
    srv = _server(state, SIGMA, "--dp-epsilon-budget", str(budget))
    try:
        devs = [Dev(srv.url, i) for i in range(N)]
        rng = np.random.default_rng(7)
        for rnd in (1, 2):
            ref, pub, m, _ = _secure_round(srv, state, devs, rnd, rng)
            # (2) published = w + (Σ w_k·clip(Δ_k) + N(0, σ²C²)) / (q·N): the residual is the noise
            fl = _floating(ref)
            full = _flat(pub) - _flat(ref) - _exact_update(ref, devs)
            resid = full[fl]
            std = SIGMA * CLIP / DENOM
            dim = resid.size
            lo, hi = stats.chi2.ppf([0.0005, 0.9995], dim - 1)
            assert lo <= (dim - 1) * resid.var(ddof=1) / std ** 2 <= hi, (resid.std(), std)
            assert abs(resid.mean()) <= 4.5 * std / math.sqrt(dim)
            for d in devs:     # each device's block: noise only (w_k or q·N wrong → ≥ 6 s.e. off)
                assert abs(full[d.idx].mean()) <= 4.5 * std / math.sqrt(BLOCK), (d.i, full[d.idx].mean(), std)

            # (3) ε at δ published with the version, as in the plain DP path
            dp = m["dp"]
            assert dp["epsilon"] == pytest.approx(eps[rnd - 1], rel=1e-9) and dp["delta"] == DELTA
            assert dp["rounds_charged"] == rnd and dp["noise_multiplier"] == SIGMA and dp["clip"] == CLIP
            assert dp["denominator"] == pytest.approx(DENOM) and dp["weight_cap"] == CAP
            with srv.admin() as c:
                latest = c.get("/v1/models/latest").json()
            assert latest["version"] == rnd + 1 and latest["dp"]["epsilon"] == pytest.approx(eps[rnd - 1])

        # the budget: a third round would overspend it — refused, and devices are told it is done
        time.sleep(0.5)                                  # a few ticks: the automatic run must not open one
        with srv.admin() as c:
            st = c.get("/v1/rounds/current").json()
            assert st["dp"]["budget_exhausted"] is True and st["dp"]["epsilon"] == pytest.approx(eps[1])
            r = c.post("/v1/admin/rounds")
            assert r.status_code == 409 and "dp_budget_exhausted" in r.text, r.text
        assert httpx.get(srv.url + "/health").json()["round_id"] in (None, 2)
        task = devs[0].client.task()
        assert task["action"] == "done" and task["reason"] == "dp_budget_exhausted"
    finally:
        srv.stop()


def test_device_refuses_a_dp_round_that_would_mask_weights():
    """A task with DP parameters whose secure input is not the clipped Δ (or the reverse) is
    refused before any key is advertised: masking unclipped weights would void the DP bound."""
    fields = {"dim": 4, "threshold": None, "neighbours": None, "clip": 0.5, "scale_bits": 24, "max_devices": 4,
              "max_samples": 10, "min_devices": 3, "layout_sha256": "0" * 64, "device": 1}
    dp = {"clip": 0.5, "noise_multiplier": 1.0, "denominator": 4.0, "weight_cap": 10}
    with pytest.raises(SecAggRoundLost, match="dp_weighted_delta"):
        SecAggSession(None, {"round_id": 1, "secagg": fields, "dp": dp})
    with pytest.raises(SecAggRoundLost, match="without DP"):
        SecAggSession(None, {"round_id": 1, "secagg": {**fields, "input": DP_INPUT}})
    s = SecAggSession(None, {"round_id": 1, "secagg": {**fields, "input": DP_INPUT}, "dp": dp},
                      policy=DevicePolicy.honest_but_curious())
    assert s.dp.clip == 0.5 and s.dp.weight_cap == 10


def test_policy_accepts_dp_with_secure_aggregation_and_still_refuses_a_server_side_clip():
    from fedfs_sdk.errors import InputError
    from server_agg.config import RoundPolicy

    p = RoundPolicy(secure_aggregation=True, max_update_norm=0.5, dp_noise_multiplier=1.0, dp_delta=1e-5,
                    dp_weight_cap=10)
    assert p.dp and p.secure_aggregation
    with pytest.raises(InputError, match="max_update_norm"):
        RoundPolicy(secure_aggregation=True, max_update_norm=0.5)
    with pytest.raises(InputError, match="needs DP .* and secure_aggregation"):
        RoundPolicy(max_update_norm=0.5, dp_noise_multiplier=1.0, dp_delta=1e-5, dp_noise="distributed")
    with pytest.raises(InputError, match="dp_noise must be"):
        RoundPolicy(dp_noise="local")
    d = RoundPolicy(secure_aggregation=True, max_update_norm=0.5, dp_noise_multiplier=1.0, dp_delta=1e-5,
                    dp_noise="distributed")
    assert d.dp_noise == "distributed"
    with pytest.raises(InputError, match="bits"):        # C × 2^s must fit float64 (and the ring)
        RoundPolicy(secure_aggregation=True, max_update_norm=1e6, dp_noise_multiplier=1.0, dp_delta=1e-5,
                    dp_weight_cap=1 << 20, secagg_scale_bits=40)


@pytest.mark.slow
def test_torch_device_agents_run_a_secure_dp_round(tmp_path):
    """Three real :class:`DeviceAgent` processes (torch runtime, real local training) in a
    secure DP round at σ = 0: the published change is ``Σ w_k·clip_C(w_c − w)/(q·N)`` of
    the updates their runtime produced, with ``w_k = min(n/ŵ, 1)``; no plain update left a
    device (the audit copies of every request body are searched). The task trains
    ``scope="top"``: only the top's clipped change is masked and sent, and the trunk is
    published as it was (noise or rounding never reach it)."""
    from fedfs_sdk.training.top_keys import is_top_key
    from test_secagg_devices import COUNTS, TRAIN, run_devices

    cap, clip = 6, 0.05                                   # n = 5, 7, 9 → w_k = 5/6, 1, 1
    srv = start_server(tmp_path / "server", "--init-backbone", "tiny", "--code-length", "127", "--method", "feduv",
                       "--rounds", "1", "--min-participants", "3", "--secure-aggregation",
                       "--secagg-phase-timeout", "60", "--train", json.dumps({**TRAIN, "scope": "top"}),
                       "--max-update-norm", str(clip), "--dp-noise-multiplier", "0", "--dp-delta", str(DELTA), "--dp-weight-cap", str(cap))
    try:
        ref_bytes, ref, _ = _model(srv, 1)
        run_devices(tmp_path, srv.url, rounds=1)
        with srv.admin() as c:
            info = c.get("/v1/rounds/1").json()
        assert info["state"] == "closed" and info["secure_aggregation"]["survivors"] == 3, info
        assert info["total_samples"] is None                  # a DP round publishes no sample count
        fl = _floating(ref)
        exact = np.zeros(fl.size)
        norms = []
        for d, n in enumerate(COUNTS):
            body = (tmp_path / f"rec{d}" / "r1.safetensors").read_bytes()
            w, _ = read_safetensors(body)
            delta = (_flat(w) - _flat(ref)) * fl
            norms.append(float(np.linalg.norm(delta)))
            exact += min(n / cap, 1.0) * delta * min(1.0, clip / norms[-1])
        exact /= 3.0                                          # q·N = 1·3
        _, pub, meta = _model(srv, 2)
        got = _flat(pub) - _flat(ref)
        tol = 2.0 ** -24 * (1.0 + np.abs(_flat(ref))) * 2
        assert np.all(np.abs(got - exact)[fl] <= tol[fl]), float(np.max(np.abs(got - exact)[fl]))
        assert np.linalg.norm(got) <= clip * (5 / 6 + 2) / 3 * (1 + 1e-6)
        assert max(norms) <= clip * (1 + 1e-6)                # the runtime already clipped before encoding
        assert min(norms) >= clip * 0.999, norms               # … and clipping was active (updates ≫ C)
        assert json.loads(meta["meta"])["dp"]["epsilon"] == "inf"
        trunk = [k for k in ref if not is_top_key(k)]
        assert trunk and all(np.array_equal(pub[k], ref[k]) for k in trunk)
        n_top = sum(np.asarray(ref[k]).size for k in ref if is_top_key(k))
        for d in range(3):                                    # no plain update in any request body
            index = [json.loads(x) for x in (tmp_path / f"audit{d}" / "index.jsonl").read_text().splitlines()]
            assert not any(e["path"].endswith("/update") for e in index)
            masked = [e for e in index if e["path"].endswith("/secagg/masked-input")]
            assert [len((tmp_path / f"audit{d}" / e["file"]).read_bytes()) for e in masked] == [8 * (n_top + 1)]
            sent = [(tmp_path / f"audit{d}" / e["file"]).read_bytes() for e in index if e["file"]]
            w32 = np.concatenate([np.asarray(v, np.float32).ravel() for _, v in
                                  sorted(read_safetensors((tmp_path / f"rec{d}" / "r1.safetensors").read_bytes())[0].items())])
            assert not any(w32[1000:1016].tobytes() in s for s in sent)
    finally:
        srv.stop()


def test_secure_dp_round_survives_sigkill_and_a_dropout_after_masking(tmp_path):
    """The server is SIGKILLed after two of four masked inputs and restarted on its state; the
    last device drops after masking (its input is in the sum, t = 3 shares rebuild its self
    mask). The published change is still the clipped weighted sum of all four plus noise of
    std σC/(q·N), and the round is charged once."""
    state = tmp_path / "server"
    srv = _server(state, SIGMA)
    port = int(srv.url.rsplit(":", 1)[1])
    try:
        devs = [Dev(srv.url, i) for i in range(N)]
        wait_open(srv, 1, timeout=60.0)
        ref_bytes, ref, _ = _model(srv, 1)
        rng = np.random.default_rng(11)
        for d in devs:
            d.prepare(1, ref_bytes, ref, rng)
        for d in devs:
            d.session.advertise()
        for d in devs:
            d.session.share_keys()
        devs[0].mask()
        devs[1].mask()
        srv.kill()
        srv = start_server(state, *_args(SIGMA), port=port)
        devs[2].mask()
        devs[3].mask()
        for d in devs[:3]:                                   # devs[3] drops after masking
            d.session.unmask()
        info = wait_round(srv, 1, timeout=60.0)
        assert info["state"] == "closed", info
        assert info["secure_aggregation"]["dropped"].get("unmask") == 1
        _, pub, meta = _model(srv, 2)
        fl = _floating(ref)
        resid = (_flat(pub) - _flat(ref) - _exact_update(ref, devs))[fl]
        std = SIGMA * CLIP / DENOM
        lo, hi = stats.chi2.ppf([0.0005, 0.9995], resid.size - 1)
        assert lo <= (resid.size - 1) * resid.var(ddof=1) / std ** 2 <= hi, (resid.std(), std)
        for d in devs:
            assert abs((_flat(pub) - _flat(ref) - _exact_update(ref, devs))[d.idx].mean()) <= 4.5 * std / math.sqrt(BLOCK)
        dp = json.loads(meta["meta"])["dp"]
        assert dp["rounds_charged"] == 1 and dp["epsilon"] == pytest.approx(epsilon([(1.0, SIGMA, 1)], DELTA))
    finally:
        srv.stop()


def test_distributed_noise_each_device_adds_its_share_and_too_few_inputs_fail_before_unmasking(tmp_path):
    """``--dp-noise distributed`` with 5 sampled devices: m = ⌊2·5/3⌋ + 1 = 4, each device adds
    N(0, σ²C²/4) inside its masked input and the server adds nothing, so with all 5 in the sum
    the residual's std is √(5/4)·σC/(q·N). Next round only 3 devices advertise (their Shamir
    threshold is then 3, so plain SecAgg would finish): fewer than m = 4 inputs, the round
    fails before any mask is removed."""
    n5, samples = 5, SAMPLES + (10,)
    args = [a for a in _args(SIGMA)]
    args[args.index("--min-participants") + 1] = str(n5)
    state = tmp_path / "server"
    srv = start_server(state, *args, "--dp-noise", "distributed")
    try:
        devs = [Dev(srv.url, i) for i in range(n5)]
        rng = np.random.default_rng(5)
        wait_open(srv, 1, timeout=60.0)
        ref_bytes, ref, _ = _model(srv, 1)
        for d in devs:
            d.prepare(1, ref_bytes, ref, rng, samples)
        task = devs[0].session.params.fixed_point
        m = 4
        assert devs[0].session.noise_min_inputs == m
        assert task.clip == pytest.approx(CLIP + 8 * SIGMA * CLIP / math.sqrt(m))   # range holds the noise
        for step in ("advertise", "share_keys"):
            for d in devs:
                getattr(d.session, step)()
        for d in devs:
            d.mask()
        for d in devs:
            d.session.unmask()
        info = wait_round(srv, 1, timeout=60.0)
        assert info["state"] == "closed", info
        _, pub, meta = _model(srv, 2)
        fl = _floating(ref)
        exact = sum(d.weight * d.clipped for d in devs) / n5
        full = _flat(pub) - _flat(ref) - exact
        std = math.sqrt(n5 / m) * SIGMA * CLIP / n5
        lo, hi = stats.chi2.ppf([0.0005, 0.9995], int(fl.sum()) - 1)
        assert lo <= (fl.sum() - 1) * full[fl].var(ddof=1) / std ** 2 <= hi, (full[fl].std(), std)
        for d in devs:
            assert abs(full[d.idx].mean()) <= 4.5 * std / math.sqrt(BLOCK), (d.i, full[d.idx].mean(), std)
        dp = json.loads(meta["meta"])["dp"]
        assert dp["noise"] == "distributed" and dp["noise_min_inputs"] == m
        assert dp["epsilon"] == pytest.approx(epsilon([(1.0, SIGMA, 1)], DELTA))   # accounted at σ (the minimum)

        wait_open(srv, 2, timeout=60.0)
        ref_bytes, ref, _ = _model(srv, 2)
        for d in devs:
            d.prepare(2, ref_bytes, ref, rng, samples)
        for d in devs[:3]:                               # two devices never advertise
            d.session.advertise()
        for d in devs[:3]:
            d.session.share_keys()
        for d in devs[:3]:        # each device refuses: a sum of t = 3 inputs would carry only 3/4 of σ²C²
            with pytest.raises(SecAggRoundLost, match="would hold only 3/4 of σ²C²"):
                d.mask()
        for d in devs[:3]:        # the server's own guard, for a device that does not check (an older fedfs)
            inbox = d.session._wait_for("inbox", "masked")
            y = d.session.device.masked_input(inbox, np.zeros(d.session.params.dim), 1)["y"]
            d.client.request("PUT", f"{d.session.path}/masked-input", content=y,
                             content_type="application/octet-stream")
        info = wait_round(srv, 2, timeout=60.0)
        assert info["state"] == "failed" and "needs 4" in info["reason"] and "nothing was unmasked" in info["reason"]
        with pytest.raises(SecAggRoundLost):
            devs[0].session.unmask()                      # no unmask request was ever made
        with srv.admin() as c:
            assert c.get("/v1/models/latest").json()["version"] == 2
    finally:
        srv.stop()
