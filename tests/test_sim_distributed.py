"""torch.distributed for the simulator: 2 gloo ranks on 127.0.0.1 against one process.

The bound (device_sim/distributed.py, docs/simulation.md): with the same torch thread count
every client's update is the same bits on any rank, and only the float64 summation order
of the FedAvg sums depends on the world size, so round 1's global model is within 1 float32
ulp of the one-process model; round 2 trains from that model, so its difference is local
SGD started ≤ 1 ulp apart (tolerance below; measured max |Δ| 1.2e-7 here).

``--rank-split balanced`` (the default) trains some clients off their home rank: with
``--seed 1`` round 1 draws 4 clients homed on rank 0 and 2 on rank 1 and round 2 the
reverse, so both rounds borrow θ_c, and round 2 borrows a client that trained in round 1
(its stored row crosses ranks twice). The tests check that it happened.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torch.distributed as dist
import torch.multiprocessing as mp

from device_sim import distributed
from device_sim.client_store import ClientStore
from device_sim.federation import check_distributable
from device_sim.methods import parse_method
from device_sim.rank_split import assign_participants
from fedfs_sdk.nn.checkpoint import read_safetensors
from fedfs_sdk.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--method", "fedfs", "softmax", "--clients", "12", "--new-users", "4", "--public", "8",
        "--train-per-client", "10", "--test-per-client", "4", "--public-images", "8", "--width", "4",
        "--embedding-dim", "16", "--pretrain-epochs", "1", "--pretrain-batch-size", "16", "--rounds", "2",
        "--participation", "0.5", "--local-epochs", "1", "--batch-size", "5", "--eval-clients", "12",
        "--threads", "1", "--checkpoint-every", "1", "--quiet", "--seed", "1"]
ROUND2_ATOL = 1e-5
"""Round 2 starts local SGD from a model ≤ 1 ulp away; measured max |Δ| 1.2e-7 on these
weights (|w| ≲ 1), so 100× that: a wrong split (a client trained twice or not at all, a
missing rank's sums) moves weights by ~1e-3."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fedfs_sdk.cli.main", "simulate", *ARGS, "--out", str(out), *extra]


def _env(cache: Path, **more: str) -> dict[str, str]:
    env = {**os.environ, "FEDFS_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), **more}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if k not in more:
            env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One-process run, then the same command as 2 ranks launched the way torchrun does
    (rank 1 given another --out and working directory, which must stay empty)."""
    tmp = tmp_path_factory.mktemp("dist")
    cache = tmp / "cache"
    single = tmp / "single"
    subprocess.run(_cmd(single), env=_env(cache), cwd=ROOT, check=True, timeout=300)
    port = str(_free_port())
    r1_cwd = tmp / "rank1_cwd"
    r1_cwd.mkdir()
    procs = []
    for rank, out, cwd in ((0, tmp / "dist", ROOT), (1, tmp / "rank1_out", r1_cwd)):
        env = _env(cache, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(_cmd(out, "--distributed"), env=env, cwd=cwd,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
    assert "wrote" in outs[0][0] and outs[1][0] == ""        # rank 1 prints nothing either
    return {"single": single, "dist": tmp / "dist", "rank1_out": tmp / "rank1_out", "rank1_cwd": r1_cwd}


def _ck(run: Path, slug: str, r: int) -> dict[str, torch.Tensor]:
    tensors, _ = read_safetensors(run / "checkpoints" / slug / f"round_{r:05d}.safetensors", "fedfs-federation/1",
                                  "federation checkpoint")
    return tensors


def _within_ulp(a: torch.Tensor, b: torch.Tensor, ulps: int = 1) -> bool:
    a32, b32 = a.float().numpy(), b.float().numpy()
    spacing = np.spacing(np.maximum(np.abs(a32), np.abs(b32)))
    return bool(np.all(np.abs(a32.astype(np.float64) - b32) <= ulps * spacing.astype(np.float64)))


@pytest.mark.parametrize("slug", ["fedfs", "softmax"])
def test_two_gloo_ranks_equal_one_process_within_the_bound(runs, slug) -> None:
    s1, d1 = _ck(runs["single"], slug, 1), _ck(runs["dist"], slug, 1)
    glob = [k for k in s1 if k.startswith("global/")]
    assert glob and set(glob) == {k for k in d1 if k.startswith("global/")}
    for k in glob:            # round 1: same client updates, only the float64 sum order differs
        assert _within_ulp(s1[k], d1[k]), k
    s2, d2 = _ck(runs["single"], slug, 2), _ck(runs["dist"], slug, 2)
    moved = max(float((s2[k].float() - s1[k].float()).abs().max()) for k in glob)
    assert moved > 100 * ROUND2_ATOL       # round 2 trained: the tolerance is far below a round's change
    for k in glob:
        torch.testing.assert_close(d2[k], s2[k], rtol=0, atol=ROUND2_ATOL, msg=k)
    if slug == "fedfs":       # θ_c of every touched client reached rank 0 (the gathered store)
        assert torch.equal(s2["store/rows"] >= 0, d2["store/rows"] >= 0) and int((s2["store/rows"] >= 0).sum()) > 6
        rows_s, rows_d = s2["store/rows"].numpy(), d2["store/rows"].numpy()
        touched = np.flatnonzero(rows_s >= 0)
        torch.testing.assert_close(d2["store/data"][rows_d[touched]], s2["store/data"][rows_s[touched]],
                                   rtol=0, atol=ROUND2_ATOL)
    for k in ("rng/torch",):
        assert torch.equal(s2[k], d2[k])


def _history(run: Path, slug: str) -> list[dict]:
    methods = json.loads((run / "results.json").read_text())["methods"]
    return next(m for m in methods if m["label"] == slug)["history"]


def _round_participants(run: Path) -> list[np.ndarray]:
    """fedfs's participants of rounds 1 and 2, read back from the one-process checkpoints:
    round 1's are the clients with a stored θ_c, round 2's those whose θ_c is new or changed."""
    s1, s2 = _ck(run, "fedfs", 1), _ck(run, "fedfs", 2)
    r1, r2 = s1["store/rows"].numpy(), s2["store/rows"].numpy()
    p1 = np.flatnonzero(r1 >= 0)
    p2 = [c for c in np.flatnonzero(r2 >= 0)
          if r1[c] < 0 or not torch.equal(s1["store/data"][r1[c]], s2["store/data"][r2[c]])]
    return [p1, np.asarray(p2)]


def test_balanced_split_trains_clients_off_their_home_rank(runs) -> None:
    """Both rounds borrow θ_c (counted in the history), round 2 borrows a client that already
    has a row, and the store rank 0 gathers holds the one-process rows."""
    p1, p2 = _round_participants(runs["single"])
    assert len(p1) == len(p2) == 6
    off = [p[assign_participants(p, None, 2) != p % 2] for p in (p1, p2)]    # SynthFaces: 10 images each
    assert [len(o) for o in off] == [1, 1]
    assert [h["borrowed"] for h in _history(runs["dist"], "fedfs")] == [1, 1]
    assert [h["borrowed"] for h in _history(runs["single"], "fedfs")] == [None, None]
    assert set(off[1].tolist()) & set(p1.tolist())       # its stored row went to the trainer and back
    # Round 1: a client's update is the same bits on any rank (device_sim/distributed.py) and
    # borrowed rows travel as their bytes, so the gathered store is the one-process store.
    s1, d1 = _ck(runs["single"], "fedfs", 1), _ck(runs["dist"], "fedfs", 1)
    rs, rd = s1["store/rows"].numpy(), d1["store/rows"].numpy()
    assert np.array_equal(rs >= 0, rd >= 0)
    assert torch.equal(d1["store/data"][rd[p1]], s1["store/data"][rs[p1]])


def test_metrics_and_history_match(runs) -> None:
    a = json.loads((runs["single"] / "results.json").read_text())["methods"]
    b = json.loads((runs["dist"] / "results.json").read_text())["methods"]
    assert [m["label"] for m in a] == [m["label"] for m in b] == ["fedfs", "softmax"]
    for ma, mb in zip(a, b):
        assert [(h["participants"], h["num_samples"], h["clients_with_steps"]) for h in ma["history"]] == \
               [(h["participants"], h["num_samples"], h["clients_with_steps"]) for h in mb["history"]]
        for k, v in ma["history"][0]["metrics"].items():      # round 1: same per-client losses, other sum order
            assert mb["history"][0]["metrics"][k] == pytest.approx(v, rel=1e-12, abs=1e-15)
        for k, v in ma["history"][1]["metrics"].items():
            assert mb["history"][1]["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7)
        va, vb = ma["eval"]["verification"], mb["eval"]["verification"]
        assert vb["auroc"]["mean"] == pytest.approx(va["auroc"]["mean"], abs=1e-4)
        for far, stats in va["tar_at_far"].items():
            assert vb["tar_at_far"][far]["mean"] == pytest.approx(stats["mean"], abs=1e-4)


def test_rank_other_than_0_writes_nothing(runs) -> None:
    assert not runs["rank1_out"].exists()
    assert list(runs["rank1_cwd"].iterdir()) == []
    assert (runs["dist"] / "results.json").is_file() and (runs["dist"] / "results.md").is_file()
    assert sorted(p.name for p in (runs["dist"] / "checkpoints" / "fedfs").iterdir()) == \
           ["round_00001.safetensors", "round_00002.safetensors"]


def test_workers_2_runs_the_same_mechanism(runs, tmp_path) -> None:
    """--workers 2: two spawned local ranks, the same round-1 model as one process."""
    out = tmp_path / "w2"
    args = _cmd(out, "--workers", "2")
    args[args.index("fedfs"):args.index("softmax") + 1] = ["softmax"]
    args[args.index("--rounds") + 1] = "1"
    args += ["--rank-split", "home"]        # the first design: every client on its home rank
    subprocess.run(args, env=_env(runs["single"].parent / "cache"), cwd=ROOT, check=True, timeout=300)
    assert [h["borrowed"] for h in _history(out, "softmax")] == [0]
    s1, w1 = _ck(runs["single"], "softmax", 1), _ck(out, "softmax", 1)
    for k in (k for k in s1 if k.startswith("global/")):
        assert _within_ulp(s1[k], w1[k]), k


def test_torchrun_two_gloo_processes(runs, tmp_path) -> None:
    """The documented launch: torchrun --nproc-per-node 2 -m fedfs_sdk.cli.main simulate --distributed."""
    out = tmp_path / "tr"
    args = _cmd(out, "--distributed")[1:]
    args[args.index("fedfs"):args.index("softmax") + 1] = ["softmax"]
    args[args.index("--rounds") + 1] = "1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(_free_port()), *args]
    done = subprocess.run(torchrun, env=_env(runs["single"].parent / "cache"), cwd=ROOT, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1             # rank 0 alone reports
    s1, t1 = _ck(runs["single"], "softmax", 1), _ck(out, "softmax", 1)
    for k in (k for k in s1 if k.startswith("global/")):
        assert _within_ulp(s1[k], t1[k]), k


def test_methods_whose_server_reads_uploads_are_refused() -> None:
    for name in ("fedaws", "fedgc", "privacyface"):
        with pytest.raises(InputError, match="cannot run distributed"):
            check_distributable(parse_method(name))
    for name in ("fedfs", "feduv", "fedfs+feduv", "softmax"):
        check_distributable(parse_method(name))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_store_rows_move_between_shards_bit_for_bit(dtype) -> None:
    template = {"personal": {"w": torch.linspace(-1, 1, 6).reshape(2, 3)}}
    a = ClientStore(10, template, dtype)
    b = ClientStore(10, template, dtype)
    w = torch.randn(3, 2, 3, generator=torch.Generator().manual_seed(0)) * 1e-3 + template["personal"]["w"]
    a.put([7, 2, 5], {"personal": {"w": w}})
    b.put([2], {"personal": {"w": w[:1] * 0}})         # a stale row b must overwrite
    b.import_rows([7, 2, 5], a.export_rows([7, 2, 5]))
    assert torch.equal(b.export_rows([2, 5, 7]), a.export_rows([2, 5, 7]))
    assert torch.equal(b.get([7, 2, 5])["personal"]["w"], a.get([7, 2, 5])["personal"]["w"])
    with pytest.raises(InputError, match="no stored row"):
        a.export_rows([0])


# ---- the assignment and the row transfers, unit by unit -----------------------------------

def test_assignment_hand_computed() -> None:
    # homes 0,1,0,1 → loads 6 | 2; client 2 (load 1 < gap 4) moves: 5 | 3; then the only
    # client left on rank 0 has load 5 ≥ gap 2, so it stops
    assert assign_participants([0, 1, 2, 3], [5, 1, 1, 1], 2).tolist() == [0, 1, 1, 1]
    # equal loads, 4 homed on rank 0 and 2 on rank 1: one client moves (the smallest id)
    assert assign_participants([0, 2, 4, 6, 1, 3], None, 2).tolist() == [1, 0, 0, 0, 1, 1]
    # an even home split moves nobody (greedy LPT from empty ranks would move half)
    assert assign_participants([0, 2, 1, 3], None, 2).tolist() == [0, 0, 1, 1]
    assert assign_participants([0, 2, 4, 6, 1], None, 2, "home").tolist() == [0, 0, 0, 0, 1]
    assert assign_participants([5, 7], [3, 2], 1).tolist() == [0, 0]
    with pytest.raises(InputError, match="distinct"):
        assign_participants([1, 1], None, 2)
    with pytest.raises(InputError, match="> 0"):
        assign_participants([1, 2], [1, 0], 2)
    with pytest.raises(InputError, match="rank-split"):
        assign_participants([1, 2], None, 2, "random")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_assignment_is_balanced_within_one_client_and_deterministic(world) -> None:
    rng = np.random.default_rng(world)
    for _ in range(50):
        clients = np.sort(rng.choice(1000, int(rng.integers(1, 40)), replace=False))
        loads = rng.integers(1, 60, clients.size).astype(float)
        ranks = assign_participants(clients, loads, world)
        assert ranks.shape == clients.shape and set(ranks.tolist()) <= set(range(world))   # each once, one rank
        assert np.array_equal(ranks, assign_participants(clients.copy(), loads.copy(), world))
        per_rank = np.bincount(ranks, weights=loads, minlength=world)
        home = np.bincount(clients % world, weights=loads, minlength=world)
        assert per_rank.max() - per_rank.min() <= loads.max()
        assert per_rank.max() <= home.max()
        if home.max() - home.min() <= loads.min():        # nothing fits in the gap: nobody moves
            assert np.array_equal(ranks, clients % world)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_borrowed_row_round_trips_bit_for_bit(dtype) -> None:
    """Home store → trainer (get with borrowed rows, never stored there) → trained rows
    encoded by the trainer → home import: the bits the home's own put would store."""
    template = {"personal": {"w": torch.linspace(-1, 1, 6).reshape(2, 3)}, "head": {"b": torch.ones(2)}}
    home, trainer, reference = (ClientStore(10, template, dtype) for _ in range(3))
    g = torch.Generator().manual_seed(1)
    first = {"personal": {"w": template["personal"]["w"] + 1e-3 * torch.randn(2, 2, 3, generator=g)},
             "head": {"b": 1 + 1e-3 * torch.randn(2, 2, generator=g)}}
    for s in (home, reference):
        s.put([4, 6], first)
    trainer.put([4], {g_: {k: v[1:] * 0 for k, v in p.items()} for g_, p in first.items()})  # a stale row
    fresh = trainer.flatten_one({"personal": {"w": torch.zeros(2, 3)}, "head": {"b": torch.zeros(2)}})
    lent = {4: home.export_rows([4])[0], 8: None}        # 8: no row anywhere → the fresh weights
    got = trainer.get([4, 8], fresh_flat=fresh, borrowed=lent)
    want = reference.get([4, 8], fresh_flat=fresh)
    for g_ in want:
        for k in want[g_]:
            assert torch.equal(got[g_][k], want[g_][k]), (g_, k)
    assert not trainer.has(8) and trainer.touched().tolist() == [4]
    trained = {g_: {k: v + 1e-4 for k, v in p.items()} for g_, p in got.items()}
    home.import_rows([4, 8], trainer.encode_rows(trained, 2))
    reference.put([4, 8], trained)
    assert torch.equal(home.export_rows([4, 6, 8]), reference.export_rows([4, 6, 8]))
    assert not trainer.has(8)


def _exchange_worker(rank: int, port: int, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ctx = distributed.current()
        assert ctx is not None
        rows = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1) / 7).to(torch.bfloat16)
        # rank 0 sends 3 rows to rank 1; rank 1 sends 1 row to rank 0
        sends = {1 - rank: rows if rank == 0 else rows[:1]}
        got = distributed.exchange_rows(sends, {1 - rank: 1 if rank == 0 else 3}, 4, torch.bfloat16, ctx)
        torch.save({"sent": rows, "got": got[1 - rank]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_exchange_rows_two_gloo_ranks_bf16(tmp_path) -> None:
    out = str(tmp_path / "x")
    mp.start_processes(_exchange_worker, args=(_free_port(), out), nprocs=2, join=True, start_method="spawn")
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert r1["got"].dtype == torch.bfloat16 and torch.equal(r1["got"], r0["sent"])
    assert torch.equal(r0["got"], r1["sent"][:1])


@pytest.mark.gpu
def test_nccl_two_ranks_need_two_gpus() -> None:
    """NCCL path (--device cuda): run where ≥ 2 GPUs exist (one rank per GPU)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL with 2 ranks needs 2 CUDA devices")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"fedfs_nccl_{os.getpid()}"
    cmd = ["torchrun", "--nproc-per-node", "2", "-m", "fedfs_sdk.cli.main", "simulate", *ARGS, "--device", "cuda",
           "--distributed", "--out", str(tmp)]
    subprocess.run(cmd, env=_env(tmp / "cache"), cwd=ROOT, check=True, timeout=600)
    assert (tmp / "results.json").is_file()
