"""The round state machine in-process (no HTTP): registration, sampling, quorum, deadline,
automatic rounds, clipping and crash recovery, with a controllable clock."""
from __future__ import annotations

import json
import math
import sqlite3

import pytest
import torch

from fedfs_sdk.errors import CheckpointError, InputError
from fedfs_sdk.nn.model import FaceNet, ModelConfig
from fedfs_sdk.federation.wire import MODEL_FORMAT, decode_weights, encode_update, encode_weights, sha256_hex, update_norm
from server_agg.auth import hash_token
from server_agg.errors import Conflict, Forbidden, Gone, Unauthorized, Unprocessable
from server_agg.rounds import Coordinator
from server_agg.store import Layout


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def checkpoint_bytes(**cfg) -> bytes:
    config = ModelConfig(backbone="tiny", **cfg).resolved()
    torch.manual_seed(0)
    return encode_weights(FaceNet(config).state_dict(), {"format": MODEL_FORMAT, "model_config": config.to_json(),
                                                         "meta": "{}"})


def make(tmp_path, clock=None, model=True, **policy) -> Coordinator:
    c = Coordinator(Layout(tmp_path / "state"), policy_overrides=policy or None, clock=clock or Clock())
    if model and c.model is None:
        c.install_model(checkpoint_bytes(code_length=127))
    return c


def join(c: Coordinator) -> dict:
    """Register a device and make its first poll (an authenticated request): only then is it
    sampled (a device that only registered never is)."""
    d = c.register()
    c.authenticate(d["token"])
    return d


def body_for(c: Coordinator, round_id: int, n: int, delta: float = 0.01) -> bytes:
    w = {k: v + delta for k, v in c.model.weights.items()}
    return encode_update(w, round_id=round_id, model_version=c.model.version, num_samples=n)


def test_registration_issues_unique_bases_and_stores_only_token_hashes(tmp_path, monkeypatch):
    c = make(tmp_path, model=False)
    draws = iter([7, 7, 7, 9])                     # a collision must not reissue b_u = 7
    monkeypatch.setattr("server_agg.round_devices.secrets.randbits", lambda bits: next(draws))
    a, b = c.register(), c.register()
    assert (a["base_vector"], b["base_vector"]) == (7, 9)
    rows = c.db.all("SELECT id, token_hash FROM devices")
    stored = {r["id"]: r["token_hash"] for r in rows}
    assert stored[a["device_id"]] == hash_token(a["token"]) and a["token"] not in stored.values()
    assert c.authenticate(a["token"]) == a["device_id"]
    with pytest.raises(Unauthorized, match="invalid token"):
        c.authenticate(a["token"][:-2] + "xx")
    with pytest.raises(Unauthorized, match="unknown device"):
        c.authenticate("dffffffffffffffff.x")


def test_sampling_fraction_min_count_and_quorum(tmp_path):
    c = make(tmp_path, participation=0.3, min_participants=2, quorum=0.5)
    devices = [join(c) for _ in range(10)]
    info = c.open_round()
    assert info["sampled"] == 3 and info["quorum"] == 2          # ⌈0.3·10⌉, ⌈0.5·3⌉
    sampled = c.round.participants
    outsider = next(d for d in devices if d["device_id"] not in sampled)
    assert c.task_for(outsider["device_id"])["action"] == "wait"
    with pytest.raises(Forbidden, match="not sampled"):
        c.submit_update(outsider["device_id"], 1, body_for(c, 1, 3))
    inside = sorted(sampled)
    assert c.task_for(inside[0])["action"] == "train"
    c.submit_update(inside[0], 1, body_for(c, 1, 3))
    assert c.task_for(inside[0])["action"] == "wait"                # uploaded: nothing more to do
    last = body_for(c, 1, 1)
    c.submit_update(inside[1], 1, last)
    assert c.round is None and c.model.version == 2                 # quorum of 2 closed it
    # The closing upload's answer was lost; its retry after the close gets the same receipt.
    again = c.submit_update(inside[1], 1, last)
    assert again["duplicate"] is True and again["num_samples"] == 1 and c.model.version == 2
    with pytest.raises(Gone):                                        # but nothing new is taken
        c.submit_update(inside[1], 1, body_for(c, 1, 2))


def test_sampling_is_reproducible_from_the_seed(tmp_path, monkeypatch):
    def sampled(name: str, seed: int) -> list[str]:
        ids = iter(f"d{i:04d}" for i in range(100))
        monkeypatch.setattr("server_agg.round_devices.new_device_id", lambda: next(ids))
        c = make(tmp_path / name, participation=0.4, seed=seed)
        for _ in range(20):
            join(c)
        c.open_round()
        return sorted(c.round.participants)

    assert sampled("a", 1) == sampled("b", 1)
    assert sampled("c", 1) != sampled("d", 2)


def test_too_few_devices_and_method_model_mismatch(tmp_path):
    c = make(tmp_path, min_participants=2)
    join(c)
    with pytest.raises(Conflict, match="needs 2"):
        c.open_round()
    join(c)
    with pytest.raises(Conflict, match="proj_dim") as e:          # refused when set, not when a round opens
        c.set_policy({"method": "fedfs"})
    assert e.value.code == "model_method_mismatch" and c.policy.method == "feduv"
    # a state written before that check (method stored as is): opening still refuses
    c.db.set_meta("policy", json.dumps(dict(c.policy.to_json(), method="fedfs")))
    c.policy = c.policy.updated({"method": "fedfs"})
    with pytest.raises(Conflict, match="proj_dim"):
        c.open_round()


def test_model_and_method_must_fit_each_other(tmp_path):
    c = make(tmp_path)                                               # feduv, model with a FedUV head only
    fedfs_only = checkpoint_bytes(proj_dim=32)
    with pytest.raises(Conflict, match="code_length") as e:
        c.install_model(fedfs_only)
    assert e.value.code == "model_method_mismatch" and c.model.version == 1
    with pytest.raises(Unprocessable):
        c.install_model(fedfs_only, method="fedprox")
    c.install_model(fedfs_only, method="fedfs")                      # both switched in one step
    assert (c.model.version, c.policy.method) == (2, "fedfs")
    assert json.loads(c.db.get_meta("policy"))["method"] == "fedfs"
    with pytest.raises(Conflict, match="FedUV head"):
        c.set_policy({"method": "fedfs+feduv"})
    c.close()
    # start-up settings are checked together: a method override the stored model cannot run
    with pytest.raises(InputError, match="state's model v2"):
        Coordinator(Layout(tmp_path / "state"), policy_overrides={"method": "feduv"}, clock=Clock())
    c2 = Coordinator(Layout(tmp_path / "state"), clock=Clock())
    assert c2.policy.method == "fedfs"                               # the refused override changed nothing
    with pytest.raises(InputError, match="initial model"):
        Coordinator(Layout(tmp_path / "new"), clock=Clock()).configure({}, checkpoint_bytes(proj_dim=32))


def test_devices_not_seen_within_the_ttl_are_not_sampled(tmp_path):
    clock = Clock()
    c = make(tmp_path, clock, device_ttl_s=30.0)
    alive, dead, silent = c.register(), c.register(), c.register()
    c.authenticate(dead["token"])                                   # polled once, then went away
    clock.t += 20
    assert c.authenticate(alive["token"]) == alive["device_id"]    # e.g. GET /v1/task
    clock.t += 15                                                   # dead: last request 35 s ago
    assert c.eligible_devices() == [alive["device_id"]]            # silent: registered, never polled
    assert c.status()["active_devices"] == 1 and c.status()["devices"] == 3
    info = c.open_round()
    assert info["sampled"] == 1 and c.round.participants == {alive["device_id"]}
    assert c.task_for(dead["device_id"])["action"] == "wait"
    c.close_round(1)
    clock.t += 31                                                   # nobody seen for 31 s
    c.set_policy({"min_participants": 1})
    with pytest.raises(Conflict, match="0 of 3 registered device"):
        c.open_round()
    c.tick()                                                        # automatic rounds wait for live devices
    assert c.round is None
    c.set_policy({"device_ttl_s": 0})                               # 0: liveness off, even the silent one
    assert c.open_round()["sampled"] == 3
    with pytest.raises(Unprocessable, match="device_ttl_s"):
        c.set_policy({"device_ttl_s": -1})


def test_a_device_that_only_registered_is_not_sampled_even_after_a_restart(tmp_path):
    clock = Clock()
    c = make(tmp_path, clock, device_ttl_s=600.0)
    polled, silent = c.register(), c.register()
    c.authenticate(polled["token"])
    assert c.eligible_devices() == [polled["device_id"]]            # the window is long; registering is no poll
    c.close()
    c2 = Coordinator(Layout(tmp_path / "state"), clock=clock)
    assert c2.eligible_devices() == [polled["device_id"]]
    assert c2.db.scalar("SELECT last_seen FROM devices WHERE id = ?", silent["device_id"]) is None


def test_default_ttl_is_ten_poll_intervals_at_least_60_s_and_last_seen_survives_a_restart(tmp_path):
    clock = Clock()
    c = make(tmp_path, clock, round_timeout_s=10.0)
    assert c.device_ttl() == 60.0                                   # 10 × 2 s < 60 s
    assert Coordinator(Layout(tmp_path / "other"), clock=clock, poll_interval_s=10.0).device_ttl() == 100.0
    d = c.register()
    clock.t += 15
    c.authenticate(d["token"])
    c.close()
    clock.t += 55                                                   # 70 s after registering, 55 s after the request
    c2 = Coordinator(Layout(tmp_path / "state"), clock=clock)
    assert c2.eligible_devices() == [d["device_id"]]
    assert c2.db.scalar("SELECT last_seen FROM devices") == 1015.0
    clock.t += 6                                                    # 61 s after the request
    assert c2.eligible_devices() == []


def test_old_database_gets_the_last_seen_column(tmp_path):
    layout = Layout(tmp_path / "state")
    layout.create()
    con = sqlite3.connect(layout.db)
    con.executescript("CREATE TABLE devices(id TEXT PRIMARY KEY, token_hash TEXT NOT NULL, "
                      "base INTEGER NOT NULL UNIQUE, created_at REAL NOT NULL);"
                      "INSERT INTO devices VALUES ('dold', 'x', 5, 1.0);")
    con.close()
    clock = Clock()
    c = Coordinator(layout, policy_overrides={"device_ttl_s": 60.0}, clock=clock)
    assert "last_seen" in {r["name"] for r in c.db.all("PRAGMA table_info(devices)")}
    assert c.eligible_devices() == []                               # not seen since the upgrade
    c.db.conn.execute("UPDATE devices SET last_seen = ? WHERE id = 'dold'", (clock.t,))
    c.close()                                                       # liveness is read from the database at start
    c = Coordinator(layout, clock=clock)
    assert c.eligible_devices() == ["dold"]


def test_deadline_fails_without_updates_and_aggregates_with_enough(tmp_path):
    clock = Clock()
    c = make(tmp_path, clock, round_timeout_s=10.0, min_updates=1)
    a, b = join(c), join(c)
    c.open_round()
    clock.t += 11
    c.tick()
    r1 = c.round_status(1)
    assert r1["state"] == "failed" and "0 update(s)" in r1["reason"] and c.model.version == 1
    c.open_round()
    c.submit_update(a["device_id"], 2, body_for(c, 2, 4))
    clock.t += 11
    with pytest.raises(Gone, match="deadline"):
        c.submit_update(b["device_id"], 2, body_for(c, 2, 4))       # late: refused and closes the round
    r2 = c.round_status(2)
    assert r2["state"] == "closed" and r2["accepted"] == 1 and r2["result_version"] == 2


def test_retry_into_a_failed_round_is_not_reported_as_counted(tmp_path):
    clock = Clock()
    c = make(tmp_path, clock, round_timeout_s=10.0, min_updates=2)
    a, _ = join(c), join(c)
    c.open_round()
    body = body_for(c, 1, 4)
    assert c.submit_update(a["device_id"], 1, body)["duplicate"] is False
    clock.t += 11
    c.tick()
    assert c.round_status(1)["state"] == "failed"                   # 1 update < min_updates
    with pytest.raises(Gone, match="not aggregated"):
        c.submit_update(a["device_id"], 1, body)                      # the retry learns it did not count


def test_install_model_refuses_hostile_configs(tmp_path):
    from server_agg.errors import Unprocessable
    c = make(tmp_path, model=False)
    good = checkpoint_bytes(code_length=127)
    w, meta = decode_weights(good)
    for cfg in ({"backbone": "tiny", "embedding_dim": -1}, {"backbone": "tiny", "code_length": 4_000_000},
                {"backbone": "tiny", "width": -1}, {"backbone": ["tiny"]}, "[" * 5000):
        text = cfg if isinstance(cfg, str) else json.dumps(cfg)
        with pytest.raises(Unprocessable, match="model rejected"):
            c.install_model(encode_weights(w, {**meta, "model_config": text}))


def test_automatic_rounds_then_done(tmp_path):
    c = make(tmp_path, rounds=2, min_participants=1)
    c.tick()
    assert c.round is None                                          # no device yet
    d = c.register()
    c.tick()
    assert c.round is None                                          # registered, never polled: not sampled
    c.authenticate(d["token"])                                      # its first GET /v1/task
    for rnd in (1, 2):
        c.tick()
        task = c.task_for(d["device_id"])
        assert task["action"] == "train" and task["round_id"] == rnd
        c.submit_update(d["device_id"], rnd, body_for(c, rnd, 2))
    c.tick()
    assert c.task_for(d["device_id"]) == {"action": "done", "model_version": 3}


def test_update_norm_is_clipped_to_the_bound(tmp_path):
    c = make(tmp_path, max_update_norm=0.5)
    d = join(c)
    c.open_round()
    ref = {k: v.clone() for k, v in c.model.weights.items()}
    receipt = c.submit_update(d["device_id"], 1, body_for(c, 1, 3, delta=0.1))
    assert receipt["clipped"] is True and receipt["update_norm"] > 0.5
    assert math.isclose(update_norm(c.model.weights, ref), 0.5, rel_tol=1e-4)   # one update: w = clipped w_c


def test_install_model_refused_while_round_open(tmp_path):
    c = make(tmp_path)
    join(c)
    c.open_round()
    with pytest.raises(Conflict, match="round 1 is open"):
        c.install_model(checkpoint_bytes(code_length=127))


def test_crash_after_model_file_before_commit_is_repaired(tmp_path):
    """A version file written but never committed is discarded; the round, whose updates
    are all committed, closes again on start-up and publishes the same average."""
    c = make(tmp_path, quorum=1.0)
    d = join(c)
    c.open_round()
    body = body_for(c, 1, 4, delta=0.25)
    layout = c.layout
    c.close()
    # The crash window: the update committed, the close not yet (half-written v2 on disk).
    rdir = layout.round_dir(1)
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / f"{d['device_id']}.safetensors").write_bytes(body)
    layout.model_file(2).write_bytes(b"half a model")
    con = sqlite3.connect(layout.db)
    con.execute("INSERT INTO updates VALUES (1, ?, 4, ?, ?, ?, 0.1, 0, 0.0)",
                (d["device_id"], sha256_hex(body), f"{d['device_id']}.safetensors", sha256_hex(body)))
    con.commit()
    con.close()
    c2 = Coordinator(layout, clock=Clock())
    assert c2.round is None and c2.model.version == 2
    sent, _ = decode_weights(body)
    published, meta = decode_weights(layout.model_file(2).read_bytes())
    for k in sent:
        torch.testing.assert_close(published[k], sent[k], rtol=0, atol=1e-7)
    assert json.loads(meta["meta"])["num_updates"] == 1


def test_corrupt_update_file_stops_the_server(tmp_path):
    c = make(tmp_path, quorum=1.0)
    a, _ = join(c), join(c)
    c.open_round()
    c.submit_update(a["device_id"], 1, body_for(c, 1, 4))
    layout = c.layout
    c.close()
    f = layout.update_file(1, a["device_id"])
    f.write_bytes(f.read_bytes()[:-1] + b"\x01")
    with pytest.raises(CheckpointError, match="SHA-256"):
        Coordinator(layout, clock=Clock())


def test_policy_survives_restart_and_flags_override(tmp_path):
    c = make(tmp_path, participation=0.25, rounds=3)
    c.close()
    c2 = Coordinator(Layout(tmp_path / "state"), policy_overrides={"rounds": 5}, clock=Clock())
    assert c2.policy.participation == 0.25 and c2.policy.rounds == 5


def test_admin_token_is_generated_once_with_mode_0600(tmp_path, monkeypatch):
    from server_agg.auth import load_admin_token

    monkeypatch.delenv("FEDFS_ADMIN_TOKEN", raising=False)
    path = tmp_path / "admin_token"
    token, generated = load_admin_token(path, None)
    assert generated and len(token) >= 40 and path.stat().st_mode & 0o777 == 0o600
    assert load_admin_token(path, None) == (token, False)
    assert load_admin_token(path, "given") == ("given", False)
    monkeypatch.setenv("FEDFS_ADMIN_TOKEN", "from-env")
    assert load_admin_token(path, None) == ("from-env", False)


def test_restart_after_a_close_republishes_nothing(tmp_path):
    c = make(tmp_path, quorum=1.0)
    d = join(c)
    c.open_round()
    c.submit_update(d["device_id"], 1, body_for(c, 1, 2))
    sha = c.model.sha256
    c.close()
    c2 = Coordinator(Layout(tmp_path / "state"), clock=Clock())
    assert c2.model.version == 2 and c2.model.sha256 == sha and c2.round is None
    assert sorted(p.name for p in c2.layout.models.iterdir()) == ["v000001.safetensors", "v000002.safetensors"]
    assert list(c2.layout.updates.iterdir()) == []                   # closed rounds' update files are gone
    assert c2.status()["rounds_completed"] == 1
