"""What the server sees in a secure-aggregation round does not reveal any single update.

Everything the server receives and sends is kept (``keep_transcript``); the tests act as the
server: masked vectors look uniform on Z_{2^64} (byte chi-square, per-bit balance), even after
the server removes the self-mask it can reconstruct, and it never holds both the self-mask
share and the mask-key share of one device. A control shows the tests do flag a plain
encoding, so they can fail."""
import numpy as np
import pytest

from device_sim.secagg_sim import gaussian_updates, run_round
from fedfs_sdk.federation.secagg import DevicePolicy, RefusedError, ReplayError, SecAggDevice, SecAggParams, SecAggServer, shamir
from fedfs_sdk.federation.secagg.prg import expand
from secagg_adversary import key_exchange

DIM = 4000
N = 8


def _chi2_bytes(words: np.ndarray) -> float:
    counts = np.bincount(words.view(np.uint8), minlength=256)
    e = counts.sum() / 256
    return float(((counts - e) ** 2 / e).sum())


def _bit_z(words: np.ndarray) -> float:
    bits = np.unpackbits(words.view(np.uint8)).reshape(words.size, 64)
    p = bits.mean(axis=0)
    return float(np.max(np.abs(p - 0.5) / np.sqrt(0.25 / words.size)))


# chi-square with 255 dof: mean 255, sd ≈ 22.6; 400 is > 6 sd. Bit z-scores: 64 of them, |z| < 5.
def looks_uniform(words: np.ndarray) -> bool:
    return _chi2_bytes(words) < 400 and _bit_z(words) < 5


@pytest.fixture(scope="module")
def round_seen_by_server():
    p = SecAggParams(round_id=11, dim=DIM)
    upd = gaussian_updates(DIM, seed=3)
    rep = run_round(p, range(1, N + 1), upd, {"masked_input": [2]}, keep_transcript=True)
    return p, upd, rep


def test_control_plain_encoding_is_not_uniform():
    p = SecAggParams(round_id=11, dim=DIM)
    words, _ = p.fixed_point.encode(gaussian_updates(DIM)(1)[0], 50)
    assert not looks_uniform(words)
    assert looks_uniform(expand(bytes(32), DIM + 1).copy())


def test_masked_vectors_look_uniform(round_seen_by_server):
    p, upd, rep = round_seen_by_server
    ys = {m["device"]: np.frombuffer(m["y"], "<u8") for m in rep.server.transcript if m["type"] == "masked_input"}
    assert sorted(ys) == [u for u in range(1, N + 1) if u != 2]
    for u, y in ys.items():
        assert looks_uniform(y.copy()), f"masked vector of device {u} is not uniform-looking"
        x, _ = p.fixed_point.encode(*upd(u))
        diff = y - x                                  # the total mask, mod 2^64
        assert np.count_nonzero(diff) == diff.size
        assert looks_uniform(diff)


def test_even_with_reconstructed_self_mask_a_survivor_stays_masked(round_seen_by_server):
    """The server can rebuild b_u of every survivor (that is the protocol); y_u − PRG(b_u) still
    carries the pairwise masks with every other survivor, which need s_sk_u — never revealed."""
    p, upd, rep = round_seen_by_server
    srv = rep.server
    t = srv.threshold
    for u in srv.u3:
        b = shamir.reconstruct(srv.b_shares[u], t, 32)
        y = next(np.frombuffer(m["y"], "<u8") for m in srv.transcript
                 if m["type"] == "masked_input" and m["device"] == u)
        residual = y - expand(b, p.words) - p.fixed_point.encode(*upd(u))[0]
        assert looks_uniform(residual)
        assert u not in srv.s_shares                  # no share of s_sk of a survivor
    assert set(srv.s_shares) == {2}                   # only the dropped device's mask key


def test_server_never_holds_both_shares_of_one_device(round_seen_by_server):
    _, _, rep = round_seen_by_server
    for m in rep.server.transcript:
        if m["type"] == "unmask_shares":
            b = {e["of"] for e in m["b_shares"]}
            s = {e["of"] for e in m["s_shares"]}
            assert not b & s
    assert not set(rep.server.b_shares) & set(rep.server.s_shares)
    # what the server routed in ShareKeys was ciphertext only: no share bytes appear in it
    share_bytes = {e["share"] for m in rep.server.transcript if m["type"] == "unmask_shares"
                   for e in m["b_shares"] + m["s_shares"]}
    cts = [e["ct"] for m in rep.server.transcript if m["type"] == "share_keys" for e in m["ciphertexts"]]
    assert cts and not any(s in ct for s in share_bytes for ct in cts)


def _to_unmask(n=5, round_id=2):
    p = SecAggParams(round_id=round_id, dim=10)
    srv = SecAggServer(p)
    devs = {u: SecAggDevice(p, u, policy=DevicePolicy.honest_but_curious()) for u in range(1, n + 1)}
    roster, inboxes = key_exchange(srv, devs)
    for u, d in devs.items():
        srv.receive(d.masked_input(inboxes[u], np.zeros(10, np.float32), 1))
    return p, srv, devs


def test_device_refuses_to_reveal_both():
    p, srv, devs = _to_unmask()
    bad = {"type": "unmask_request", "round": 2, "survivors": [1, 2, 3, 4, 5], "dropped": [3]}
    with pytest.raises(RefusedError, match=r"both as survivors and as dropped") as ei:
        devs[1].unmask(bad)
    assert ei.value.status == 403
    # asked twice in one round (first as survivor, then as dropped): the second is refused
    devs[1].unmask({"type": "unmask_request", "round": 2, "survivors": [1, 2, 4, 5], "dropped": [3]})
    with pytest.raises(ReplayError, match="already answered"):
        devs[1].unmask({"type": "unmask_request", "round": 2, "survivors": [1, 2, 3, 5], "dropped": [4]})


def test_device_refuses_too_few_survivors():
    _, _, devs = _to_unmask()
    with pytest.raises(RefusedError, match="only 3 survivors, threshold is 4"):
        devs[1].unmask({"type": "unmask_request", "round": 2, "survivors": [1, 2, 3], "dropped": [4, 5]})
