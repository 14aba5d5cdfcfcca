"""The secure round's saved state (server_agg.secagg_rounds.SecAggRound) without HTTP: a crash
between writing a new sum file and the record that names it leaves a stale file, which must
never be mistaken for the sum; every restore gives the same unmasked result; messages between
phase closes are journaled, not rewritten with the whole state, and a torn append is cut off."""
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
    # the snapshot of the last phase close, its sum and its journal (the unmask messages)
    assert sorted(p.name for p in path.parent.iterdir()) == ["r000001.j4", "r000001.json", "r000001.sum3"]
    sr.remove()
    assert not list(path.parent.iterdir())


def test_messages_between_phase_closes_are_journaled_and_a_torn_append_is_cut_off(tmp_path):
    path = tmp_path / "secagg" / "r000001.json"
    path.parent.mkdir()
    sr = SecAggRound(1, IDS, FIELDS, path, opened=0.0, masked_deadline=100.0)
    sr.save()
    snapshot = path.read_bytes()
    devs = {d: SecAggDevice(sr.params, sr.index[d], policy=DevicePolicy.honest_but_curious()) for d in IDS}
    for d in IDS[:2]:
        sr.receive(d, "advertise", to_json(devs[d].advertise()).encode())
    assert path.read_bytes() == snapshot                 # the whole state is not rewritten per message
    journal = path.with_name("r000001.j1")
    good = journal.read_bytes()
    journal.write_bytes(good + b"\x01\x03\x00\x00\x00\xff\xff")   # a crash mid-append: never acknowledged
    sr = SecAggRound.load(path, 1)
    assert sorted(sr.srv.pks) == [1, 2] and journal.read_bytes() == good
    advert = to_json(devs["dc"].advertise()).encode()
    sr.receive("dc", "advertise", advert)
    assert sorted(SecAggRound.load(path, 1).srv.pks) == [1, 2, 3]   # appended after the cut, read back
    flipped = bytearray(journal.read_bytes())
    flipped[len(good) + 20] ^= 1                          # a damaged last record is not replayed either
    journal.write_bytes(bytes(flipped))
    assert sorted(SecAggRound.load(path, 1).srv.pks) == [1, 2]
    sr = SecAggRound.load(path, 1)
    sr.receive("dc", "advertise", advert)                 # its answer was lost: it sends again
    sr.advance(1.0)                                       # the phase closes: a new generation, the old journal goes
    assert sorted(p.name for p in path.parent.iterdir()) == ["r000001.json"]
    assert from_json(path.read_bytes())["journal"] == "r000001.j2"
