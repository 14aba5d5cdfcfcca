"""The secure round's saved state (server_agg.secagg_rounds.SecAggRound) without HTTP: a crash
between writing a new sum file and the JSON that names it leaves a stale file, which must
never be mistaken for the sum; every restore gives the same unmasked result."""
from __future__ import annotations

import numpy as np

from fedfs_sdk.federation.secagg import DevicePolicy, SecAggDevice, from_json, to_json
from server_agg.secagg_rounds import SecAggRound

FIELDS = {"dim": 6, "threshold": None, "neighbours": None, "clip": 4.0, "scale_bits": 20, "max_devices": 3,
          "max_samples": 100, "min_devices": 3, "layout_sha256": "x", "phase_timeout_s": 10.0}
IDS = ["da", "db", "dc"]


def test_stale_sum_file_from_a_crashed_save_is_overwritten(tmp_path):
    path = tmp_path / "secagg" / "r000001.json"
    path.parent.mkdir()
    sr = SecAggRound(1, IDS, FIELDS, path, opened=0.0, masked_deadline=100.0)
    sr.save()
    devs = {d: SecAggDevice(sr.params, sr.index[d], policy=DevicePolicy.honest_but_curious()) for d in IDS}
    for d in IDS:
        sr.receive(d, "advertise", to_json(devs[d].advertise()).encode())
    sr.advance(1.0)
    for d in IDS:
        sr.receive(d, "share-keys", to_json(devs[d].share_keys(from_json(to_json(sr.roster)))).encode())
    sr.advance(2.0)
    rng = np.random.default_rng(0)
    ws = {d: (rng.normal(0, 1, 6), int(rng.integers(1, 100))) for d in IDS}
    ys = {d: devs[d].masked_input(sr.srv.inbox(sr.index[d]), *ws[d])["y"] for d in IDS}
    sr.receive("da", "masked-input", ys["da"])
    # a crash right after writing the sum of 2 inputs, before the JSON: a file the JSON does not name
    (path.parent / "r000001.sum2").write_bytes(b"\xff" * (8 * 7))
    sr = SecAggRound.load(path, 1)
    assert sr.srv._masked_from == {1}
    sr.receive("dc", "masked-input", ys["dc"])          # another device comes first after the restart
    sr = SecAggRound.load(path, 1)                      # … and the sum on disk is the real one
    sr.receive("db", "masked-input", ys["db"])
    sr = SecAggRound.load(path, 1)
    sr.advance(3.0)
    for d in IDS:
        sr.receive(d, "unmask", to_json(devs[d].unmask(from_json(to_json(sr.request)))).encode())
    result = sr.advance(4.0)
    assert result is not None
    exact = sum(np.clip(w, -4, 4) * n for w, n in ws.values()) / sum(n for _, n in ws.values())
    np.testing.assert_allclose(result.mean, exact, atol=2.0 ** -21 + 1e-6)
    assert sorted(p.name for p in path.parent.iterdir()) == ["r000001.json", "r000001.sum3"]
    sr.remove()
    assert not list(path.parent.iterdir())
