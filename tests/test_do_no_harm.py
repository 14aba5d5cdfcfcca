"""Do no harm: the selection rule keeps ξ when a personalized model is worse (a planted bad
update) — in numpy, in the simulator and on a device — and picks a model that really is
better; scope='top' trains only the top and equals the simulator's; capture shifts are
deterministic per seed."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from fedfs_sdk.nn.checkpoint import save_checkpoint
from fedfs_sdk.nn.model import FaceNet, ModelConfig, personal_config
from fedfs_sdk.training.scope import Trunk, is_top_key
from fedfs_sdk.training.selection import check_candidate, choose, holdout_split
from fedfs_sdk.training.trainer import LocalTrainer, TrainConfig, initial_global_weights


def _person(rng, centre, n, spread):
    return centre + spread * rng.standard_normal((n, centre.size))


def test_choose_keeps_xi_against_a_planted_bad_update_and_takes_a_real_gain() -> None:
    rng = np.random.default_rng(0)
    owner = rng.standard_normal(64)
    others = [rng.standard_normal(64) for _ in range(40)]
    imp = np.concatenate([_person(rng, c, 10, 0.6) for c in others])
    enroll, hold = _person(rng, owner, 10, 1.5), _person(rng, owner, 3, 1.5)      # ξ: not yet perfect
    xi = check_candidate("xi", enroll, hold, imp)
    # a planted bad update: the personalized model maps everything through a random projection + noise
    bad = rng.standard_normal((64, 64))
    worse = check_candidate("personalized", enroll @ bad + 3 * rng.standard_normal((10, 64)),
                            hold @ bad + 3 * rng.standard_normal((3, 64)), imp @ bad)
    assert worse.margin < xi.margin
    assert choose([xi, worse]).chosen == "xi"
    # equal models: a tie keeps the reference
    same = check_candidate("personalized", enroll, hold, imp)
    assert choose([xi, same]).chosen == "xi"
    # a model that really separates the owner (owner's photos pulled together, impostors untouched)
    pull = lambda x: 0.3 * x + 0.7 * owner        # noqa: E731
    better = check_candidate("personalized", pull(enroll), pull(hold), imp)
    sel = choose([xi, better])
    assert sel.chosen == "personalized" and "margin" in sel.reason


def test_federation_verdict_lets_a_modest_gain_through_but_not_harm() -> None:
    from fedfs_sdk.training.selection import CandidateCheck, HARM_MARGIN, population_verdict

    def c(name, margin, auroc=0.9, tar=0.5):
        return CandidateCheck(name, tar, margin, auroc, 0.3, 3, 300)
    rng = np.random.default_rng(0)
    # 50 devices: the personalized margin is +0.2 better on average, each device's evidence is noisy
    devices = [[c("xi", 0.0), c("personalized", 0.2 + 0.3 * rng.standard_normal())] for _ in range(50)]
    v = population_verdict("personalized", devices)
    assert v.helps and v.n == 50 and v.mean_margin_gain > 2 * v.se
    modest = [c("xi", 0.0), c("personalized", 0.1)]               # too small to show alone …
    assert choose(modest).chosen == "xi"
    assert choose(modest, {"personalized": v}).chosen == "personalized"     # … enough with the federation's
    harmful = [c("xi", 0.0), c("personalized", -HARM_MARGIN - 0.01)]
    assert choose(harmful, {"personalized": v}).chosen == "xi"               # but not where it harms here
    flat = population_verdict("personalized", [[c("xi", 0.0), c("personalized", 0.3 * rng.standard_normal())]
                                               for _ in range(50)])
    assert not flat.helps


def test_holdout_split_is_seeded_and_leaves_enough_to_train() -> None:
    tr, ho = holdout_split(13, seed=5)
    assert ho.size == 3 and tr.size == 10 and np.intersect1d(tr, ho).size == 0
    assert np.array_equal(ho, holdout_split(13, seed=5)[1]) and not np.array_equal(ho, holdout_split(13, seed=6)[1])
    assert holdout_split(3, seed=0)[1].size == 0          # 3 photos: holding 2 out would leave 1 to train


# ---- scope='top' ------------------------------------------------------------------------------

def _fedfs_config(code_length=None) -> ModelConfig:
    return ModelConfig("tiny", proj_dim=32, code_length=code_length)


def test_scope_top_trains_only_the_embedding_layer_and_heads() -> None:
    torch.manual_seed(0)
    cfg = _fedfs_config(127)
    xi = FaceNet(ModelConfig("tiny")).eval()
    w0 = initial_global_weights(cfg, xi)
    x = torch.rand(8, 3, 32, 32) * 2 - 1
    v = np.where(np.random.default_rng(0).random(127) < 0.5, -1, 1).astype(np.int8)
    res = LocalTrainer(cfg, TrainConfig(method="fedfs+feduv", scope="top", lr=0.1, batch_size=4), xi=xi).train(
        w0, x, codeword=v)
    moved = {k for k in w0 if not torch.equal(w0[k], res.weights[k])}
    assert moved and all(is_top_key(k) for k in moved)
    assert {"backbone.embed.weight", "uv_head.weight"} <= moved
    assert all(torch.equal(res.personal_weights[k], w0[k]) for k in res.personal_weights if not is_top_key(k))
    full = LocalTrainer(cfg, TrainConfig(method="fedfs+feduv", scope="all", lr=0.1, batch_size=4), xi=xi).train(
        w0, x, codeword=v)
    assert any(not is_top_key(k) and not torch.equal(w0[k], full.weights[k]) for k in w0)
    # the shared-trunk fast path gives the gradients of the full forward with a frozen trunk
    t = Trunk(xi.backbone)
    assert torch.allclose(xi.backbone.embed_norm(xi.backbone.embed(t(x))), xi.backbone(x), atol=1e-6)


def test_simulator_scope_top_matches_the_device_trainer() -> None:
    from device_sim.executors import LocalConfig, SequentialExecutor, ClientTask
    from device_sim.methods import parse_method
    from device_sim.methods.base import SimContext

    torch.manual_seed(0)
    xi = FaceNet(ModelConfig("tiny")).eval()
    m = parse_method("fedfs:scope=top,select=off,lr=0.05")
    m.setup(SimContext(ModelConfig("tiny"), xi, num_clients=1))
    g = m.init_global()
    params = {"global": g, **m.init_private(g)}
    x = torch.rand(6, 3, 32, 32) * 2 - 1
    plan = m.configure_round(1, np.array([0]))
    out = SequentialExecutor("cpu").train(m, plan, [ClientTask(0, x, params, {}, seed=3)],
                                          LocalConfig(batch_size=3, lr=0.05))
    ref = LocalTrainer(m.model_config, TrainConfig(method="fedfs", scope="top", lr=0.05, batch_size=3), xi=xi).train(
        g, x, seed=3)
    for k, v in ref.weights.items():
        torch.testing.assert_close(out.params["global"][k][0], v, atol=1e-5, rtol=1e-5)


# ---- the simulator: a planted bad update is not used -----------------------------------------

def _planted_bad_global(method: str, new_users: int, tmp_path):
    """A 6-client SynthFaces federation with a tiny pre-trained ξ, ``method`` set up and bound to
    the clients' hold-out; returns ``(population, ξ, method, its initial global weights, those
    weights with every backbone conv / linear weight scrambled)``."""
    from device_sim.cli_simulate import experiment_from_argv, public_impostors
    from device_sim.experiment_data import build_data
    from device_sim.methods import parse_method
    from device_sim.methods.base import SimContext
    from device_sim.methods.selection import HoldoutView
    from device_sim.population import Population
    from device_sim.pretrain import PretrainConfig, train_xi

    cfg = experiment_from_argv(["--clients", "6", "--new-users", str(new_users), "--public", "12",
                                "--out", str(tmp_path)])
    ds, splits = build_data(cfg)
    pop = Population(ds, splits)
    ids, idx, lab = splits.pairs("public", "train")
    xi = train_xi(ds, ids, idx, lab, PretrainConfig(backbone="tiny", epochs=6, seed=0))[0].eval()
    m = parse_method(method)
    m.setup(SimContext(ModelConfig("tiny"), xi, num_clients=pop.num_clients))
    m.prepare(HoldoutView(pop, public_impostors(cfg, pop), seed=0))
    g = m.init_global()
    torch.manual_seed(0)
    bad = {k: (v + 2.0 * torch.randn_like(v) if k.startswith("backbone.") and v.dim() > 1 else v)
           for k, v in g.items()}                              # planted: every conv / linear weight scrambled
    return pop, xi, m, g, bad


@pytest.mark.parametrize("check", ["in-domain", "public"])
def test_simulated_selection_keeps_xi_for_a_planted_bad_update(check, tmp_path) -> None:
    pop, _, m, g, bad = _planted_bad_global(f"fedfs:select=on,check={check}", 0, tmp_path)
    m.prepare_evaluation(g, lambda c: {"personal": bad}, list(range(pop.num_clients)))
    assert not m.selection.verdicts["personalized"].helps      # the federation sees the harm too
    for c in range(pop.num_clients):
        spec = m.verifier(m.client_state_init(c), g, {"personal": bad})
        # never the scrambled θ_c: ξ (the in-domain check may also take norm-adapt ξ, a shared model)
        assert spec.shared_key == "xi" or (check == "in-domain" and spec.shared_key == "norm-adapt")
    counts = m.selection.counts()
    assert counts["personalized"] == 0 and counts["global"] == 0 and sum(counts.values()) == 6
    assert check == "in-domain" or counts["xi"] == 6
    assert check == "in-domain" or all(d["checks"][-1]["margin"] < d["checks"][0]["margin"]
                                       for d in m.selection.details.values())


# ---- a device: TorchRuntime candidates and the same rule ------------------------------------

def test_device_keeps_xi_for_a_planted_bad_update(tmp_path) -> None:
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.server_client import ServerClient
    from fedfs_sdk.federation.wire import encode_weights
    from fedfs_sdk.runtime.impostors import ImpostorSet
    from fedfs_sdk.nn.checkpoint import read_checkpoint_bytes

    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    xi = FaceNet(ModelConfig("tiny")).eval()
    save_checkpoint(tmp_path / "xi.safetensors", xi, ModelConfig("tiny"))
    cfg = ModelConfig("tiny", proj_dim=32)
    glob = FaceNet(cfg)
    glob.load_state_dict(initial_global_weights(cfg, xi))
    save_checkpoint(tmp_path / "global.safetensors", glob, cfg)
    model_bytes = read_checkpoint_bytes(tmp_path / "global.safetensors")
    base = rng.integers(0, 255, (40, 40, 3))
    owner = [np.clip(base + rng.normal(0, 10, base.shape), 0, 255).astype(np.uint8) for _ in range(12)]
    imgs = [rng.integers(0, 255, (40, 40, 3)).astype(np.uint8) for _ in range(60)]
    from fedfs_sdk.runtime.preprocess import preprocess
    u8 = np.rint(preprocess(imgs, 32).transpose(0, 2, 3, 1) * 127.5 + 127.5).astype(np.uint8)
    np.savez(tmp_path / "dummy.npz")       # (nothing else is read from disk)
    imp = ImpostorSet(u8, np.arange(60) // 3, [f"p{i}" for i in range(20)])
    from fedfs_sdk.runtime.impostors import save_impostors
    save_impostors(tmp_path / "imp.npz", imp)
    state = DeviceState(tmp_path / "state")
    personal = FaceNet(personal_config(cfg))
    personal.load_state_dict({k: v for k, v in glob.state_dict().items() if not k.startswith("uv_head.")})
    with torch.no_grad():                                   # planted bad update of θ_c
        for n_, p in personal.named_parameters():
            if n_.startswith("backbone.") and p.dim() > 1:
                p.add_(0.5 * torch.randn_like(p))
    state.save_weights_bytes("personal", encode_weights(personal.state_dict()))
    config = DeviceConfig(xi_path=tmp_path / "xi.safetensors", impostors=tmp_path / "imp.npz")
    agent = DeviceAgent(ServerClient("http://127.0.0.1:9"), state, owner, config)
    train, hold = agent.holdout_split()
    assert hold.size == 2 and train.size == 10
    assert agent.images_array(32).shape[0] == 10          # training never sees the hold-out
    from fedfs_sdk.runtime.impostors import load_impostors
    from fedfs_sdk.federation.device_enrollment import choose_model
    chosen, record = choose_model(agent, "fedfs", model_bytes, 1, "template", "personal",
                                  load_impostors(tmp_path / "imp.npz"))
    assert chosen == "xi", record
    assert [c["name"] for c in record["checks"]] == ["xi", "global", "personalized"]
    state.close()


# ---- capture shifts: deterministic per seed, phones only -------------------------------------

def test_capture_shifts_are_deterministic_per_seed() -> None:
    from device_sim.capture_shifts import CAPTURE_SHIFTS, apply_shift

    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (112, 112, 3)).astype(np.uint8)
    for name in ("phone", "night"):
        a = apply_shift(img, CAPTURE_SHIFTS[name], 0, "alice", 3)
        assert np.array_equal(a, apply_shift(img, CAPTURE_SHIFTS[name], 0, "alice", 3))
        assert not np.array_equal(a, apply_shift(img, CAPTURE_SHIFTS[name], 1, "alice", 3))   # another seed
        assert not np.array_equal(a, apply_shift(img, CAPTURE_SHIFTS[name], 0, "alice", 4))   # another photo
        assert not np.array_equal(a, img)
    assert np.array_equal(apply_shift(img, CAPTURE_SHIFTS["none"], 0, "alice", 3), img)
    night = apply_shift(img, CAPTURE_SHIFTS["night"], 0, "bob", 0).astype(float)
    assert night.mean() < img.mean()                     # low light


def test_shifted_dataset_changes_phones_only_and_any_batch_order(tmp_path) -> None:
    import cv2

    from device_sim.capture_shifts import CaptureShiftDataset
    from device_sim.datasets import ImageFolderDataset

    rng = np.random.default_rng(0)
    for p in range(3):
        (tmp_path / f"p{p}").mkdir()
        for j in range(3):
            cv2.imwrite(str(tmp_path / f"p{p}" / f"{j}.png"), rng.integers(0, 255, (40, 40, 3)).astype(np.uint8))
    base = ImageFolderDataset(tmp_path, 32)
    ds = CaptureShiftDataset(base, "night", seed=7, shifted=[1, 2])
    assert torch.equal(ds.images(0, [0, 1, 2]), base.images(0, [0, 1, 2]))       # public: as it is
    shifted = ds.batch([1, 2, 1], [0, 2, 2])
    assert not torch.equal(shifted, base.batch([1, 2, 1], [0, 2, 2]))
    again = CaptureShiftDataset(base, "night", seed=7, shifted=[1, 2]).batch([1, 1, 2], [2, 0, 2])
    assert torch.equal(again[[1, 2, 0]], shifted)                                   # order- and batch-independent
    assert not torch.equal(CaptureShiftDataset(base, "night", seed=8, shifted=[1, 2]).batch([1], [0]), shifted[:1])
    assert ds.fingerprint() != CaptureShiftDataset(base, "night", seed=8, shifted=[1, 2]).fingerprint()
    levels = shifted * 127.5 + 127.5
    assert torch.equal(levels, levels.round())          # still on the uint8 grid of every fedfs input
    # the uint8 path — what the simulator's image store and population read — is shifted the same
    # (it once forwarded to the folder and silently dropped the shift)
    fresh = CaptureShiftDataset(base, "night", seed=7, shifted=[1, 2])
    for cache in (True, False):
        u8 = fresh.batch_uint8([1, 2, 1, 0], [0, 2, 2, 1], cache=cache)
        assert u8.dtype == torch.uint8 and torch.equal(u8[:3].float(), levels)
        assert torch.equal(u8[3], base.batch_uint8([0], [1])[0])


def test_real_night_on_lfw_is_deterministic_and_leaves_public_photos_alone(tmp_path) -> None:
    """The real-photo scenario on ../shared/data/lfw (skipped without it): three people's photos,
    two of them phones under 'night', built twice with one seed and once with another."""
    import pytest as _pytest

    from tests.shared_assets import LFW

    if not LFW.is_dir():
        _pytest.skip(f"needs the shared LFW folder ({LFW})")
    from device_sim.capture_shifts import CaptureShiftDataset
    from device_sim.datasets import ImageFolderDataset

    people = sorted(p for p in LFW.iterdir() if p.is_dir())[:3]
    for p in people:
        (tmp_path / p.name).symlink_to(p)
    base = ImageFolderDataset(tmp_path, 112)
    a = CaptureShiftDataset(base, "night", seed=0, shifted=[1, 2])
    b = CaptureShiftDataset(base, "night", seed=0, shifted=[1, 2])
    c = CaptureShiftDataset(base, "night", seed=1, shifted=[1, 2])
    ids, idx = np.array([0, 1, 2, 1]), np.array([0, 0, 1, 3])
    xa, xb, xc = a.batch(ids, idx), b.batch(ids[::-1], idx[::-1]), c.batch(ids, idx)
    assert torch.equal(xa, xb.flip(0))                   # same seed, any order: the same photos
    assert torch.equal(xa[0], base.batch([0], [0])[0])   # public identity: as it is
    assert not torch.equal(xa[1:], xc[1:])               # another seed, another capture
    assert float(xa[1:].mean()) < float(base.batch(ids[1:], idx[1:]).mean())   # darker


def test_trunk_cache_and_split_verifiers_give_the_full_models_embeddings() -> None:
    """The simulator's speed-up is exact: cached trunk features are the trunk's, and a verifier run
    as its top on them embeds like the whole verifier (ξ, and a scope=top dual verifier)."""
    from device_sim.evaluate import embed
    from device_sim.methods import parse_method
    from device_sim.methods.base import SimContext, VerifierSpec, backbone_weights, verifier_net
    from device_sim.methods.selection import split_spec
    from device_sim.trunk_cache import TrunkCache

    torch.manual_seed(0)
    xi = FaceNet(ModelConfig("tiny")).eval()
    x = torch.rand(7, 3, 32, 32) * 2 - 1
    cache = TrunkCache(xi.backbone)
    f1 = cache(x)
    assert torch.equal(f1, cache(x)) and cache.hits == 7 and cache.misses == 7
    torch.testing.assert_close(f1, Trunk(xi.backbone)(x), atol=1e-6, rtol=1e-6)
    spec = VerifierSpec(verifier_net(ModelConfig("tiny"), with_head=False), backbone_weights(xi.state_dict()))
    full = embed(spec, x, torch.device("cpu"))["embedding"]
    torch.testing.assert_close(embed(split_spec(spec, xi), x, torch.device("cpu"))["embedding"], full,
                               atol=1e-5, rtol=1e-5)
    m = parse_method("fedfs+feduv:select=off")
    m.setup(SimContext(ModelConfig("tiny"), xi, num_clients=1))
    g = m.init_global()
    personal = {k: (v + 0.01 * torch.randn_like(v) if is_top_key(k) else v) for k, v in g.items()
                if not k.startswith("uv_head.")}
    dual = m.verifier(m.client_state_init(0), g, {"personal": personal})
    assert dual.trunk is not None
    whole = embed(replace_trunk(dual), x, torch.device("cpu"))["embedding"]
    torch.testing.assert_close(embed(dual, x, torch.device("cpu"))["embedding"], whole, atol=1e-5, rtol=1e-5)


def replace_trunk(spec):
    from dataclasses import replace
    return replace(spec, trunk=None, top=None)


@pytest.mark.parametrize("check", ["in-domain", "public"])
def test_simulated_new_users_check_the_shipped_model_too(check, tmp_path) -> None:
    """A user who never trained runs the device's rule over ξ, norm-adapt and the global model
    (issue 29 item 4: ``feduv``'s new users accepted 71 % of strangers with the unchecked global
    model on LFW): a scrambled global model is never what a new user enrolls with."""
    from device_sim.evaluate import EvalConfig, evaluate
    from device_sim.methods import parse_method
    from device_sim.methods.base import SimContext

    pop, xi, m, g, bad = _planted_bad_global(f"feduv:select=on,check={check}", 3, tmp_path)
    out = evaluate(m, bad, lambda c: None, pop, EvalConfig(fars=(1e-2,)))
    chose = out["new_users"]["chose"]
    assert sum(chose.values()) == 3 and chose.get("global", 0) == 0, chose
    assert set(m.selection.new_user_details) == {6, 7, 8}
    for d in m.selection.new_user_details.values():
        assert [c["name"] for c in d["checks"]][-1] == "global"        # checked, not trusted
    # select=off (the papers' behaviour): the new users get the scrambled model, unchecked
    off = parse_method("feduv:select=off")
    off.setup(SimContext(ModelConfig("tiny"), xi, num_clients=pop.num_clients))
    paper = evaluate(off, bad, lambda c: None, pop, EvalConfig(fars=(1e-2,)))["new_users"]
    assert "chose" not in paper
    assert out["new_users"]["auroc"]["mean"] > paper["auroc"]["mean"] + 0.05
