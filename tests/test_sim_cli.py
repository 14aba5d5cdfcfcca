"""CLI smoke tests on tiny settings: pretrain, simulate (+ resume), demo, bench."""
from __future__ import annotations

import json

from device_sim.datasets import ImageFolderDataset
from device_sim.splits import make_splits
from device_sim.synthfaces import SynthFaces, write_image_folder
from device_sim.throughput import BenchConfig, format_table, run_benchmark
from fedfs_sdk.cli.main import main

TINY_DATA = ["--clients", "4", "--new-users", "2", "--public", "6", "--train-per-client", "10",
             "--test-per-client", "3", "--public-images", "6", "--width", "4", "--embedding-dim", "16",
             "--pretrain-epochs", "1", "--pretrain-batch-size", "12"]


def test_pretrain_then_simulate_with_it(tmp_path, capsys) -> None:
    ck = tmp_path / "xi.safetensors"
    assert main(["pretrain", *TINY_DATA, "--cache-dir", str(tmp_path / "c"), "--out", str(ck), "--quiet"]) == 0
    assert ck.is_file() and "AUROC" in capsys.readouterr().out
    out = tmp_path / "run"
    args = ["simulate", "--method", "pretrained", "feduv:c=127,neg=all", *TINY_DATA, "--pretrained", str(ck),
            "--rounds", "2", "--participation", "0.5", "--out", str(out), "--checkpoint-every", "1", "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert [m["label"] for m in res["methods"]] == ["pretrained", "feduv (c=127, ℓ_neg)"]
    assert res["methods"][1]["rounds"] == 2 and len(res["methods"][1]["history"]) == 2
    assert (out / "roc.png").stat().st_size > 1000 and "| feduv (c=127, ℓ_neg) |" in (out / "results.md").read_text()
    assert "TAR@FAR=1e-3" in printed
    # resume: nothing left to train, same final metrics
    assert main([*args[:args.index("--rounds")], "--rounds", "2", *args[args.index("--participation"):], "--resume"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["methods"][1]["eval"]["verification"] == res["methods"][1]["eval"]["verification"]


def test_image_folder_one_client_per_identity_and_xi_overlap_check(tmp_path, capsys) -> None:
    root = write_image_folder(SynthFaces(seed=3, image_size=32), tmp_path / "faces", range(10), 8)
    data = ["--data", str(root), "--public", "4", "--clients", "0", "--new-users", "2", "--train-per-client", "0",
            "--width", "4", "--embedding-dim", "16", "--pretrain-epochs", "1", "--pretrain-batch-size", "8"]
    ck = tmp_path / "xi.safetensors"
    assert main(["pretrain", *data, "--cache-dir", str(tmp_path / "c"), "--out", str(ck), "--quiet"]) == 0
    out = tmp_path / "run"
    assert main(["simulate", "--method", "fedfs", *data, "--pretrained", str(ck), "--rounds", "1",
                 "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["population"]["clients"] == 4 and res["methods"][0]["eval"]["clients_evaluated"] == 4
    capsys.readouterr()
    # a split whose clients include identities ξ was pre-trained on is refused
    ds = ImageFolderDataset(root, 32)
    public = set(make_splits(ds, 4, 4, 2, None, None, seed=0).identities("public").tolist())
    seed = next(s for s in range(1, 50)
                if public & set(make_splits(ds, 4, 4, 2, None, None, seed=s).identities("clients").tolist()))
    code = main(["simulate", "--method", "fedfs", *data, "--split-seed", str(seed), "--pretrained", str(ck),
                 "--rounds", "1", "--out", str(tmp_path / "r2"), "--quiet"])
    assert code == 2 and "pre-trained on" in capsys.readouterr().err


def test_unknown_method_fails_fast(tmp_path, capsys) -> None:
    assert main(["simulate", "--method", "fedprox", "--out", str(tmp_path), "--quiet"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_demo_tiny(tmp_path, capsys) -> None:
    args = ["demo", "--clients", "4", "--new-users", "2", "--public", "6", "--train-per-client", "10",
            "--test-per-client", "3", "--public-images", "6", "--rounds", "1", "--participation", "0.5",
            "--pretrain-epochs", "1", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| fedfs+feduv (c=127) |" in out and "verify own held-out image" in out
    assert (tmp_path / "results.md").is_file()


def test_bench_in_process() -> None:
    res = run_benchmark(BenchConfig(clients=2, images_per_client=6, batch_size=4, repeats=1, width=4), ["cpu"],
                        isolate=False)
    assert {r["executor"] for r in res["rows"]} == {"sequential", "batched"}
    assert all(r["client_updates_per_s"] > 0 for r in res["rows"]) and res["winner"]["cpu"] in ("sequential", "batched")
    assert "winner on cpu" in format_table(res)


def test_eval_every_survives_resume(tmp_path) -> None:
    out = tmp_path / "run"
    args = ["simulate", "--method", "feduv", *TINY_DATA, "--cache-dir", str(tmp_path / "c"), "--rounds", "3",
            "--participation", "0.5", "--eval-every", "1", "--checkpoint-every", "1", "--out", str(out), "--quiet"]
    assert main(args) == 0
    full = json.loads((out / "results.json").read_text())["methods"][0]["history"]
    assert [h["eval"] is not None for h in full] == [True, True, False]   # the last round gets the full eval
    (out / "checkpoints" / "feduv-c-127" / "round_00003.safetensors").unlink(missing_ok=False)  # "crash" after round 2
    assert main([*args, "--resume"]) == 0
    resumed = json.loads((out / "results.json").read_text())["methods"][0]["history"]
    assert [h["eval"] for h in resumed[:2]] == [h["eval"] for h in full[:2]]   # round 2's eval was in its checkpoint
    assert [h["metrics"] for h in resumed] == [h["metrics"] for h in full]


def test_xi_overlap_compares_identity_names_not_positions(tmp_path) -> None:
    import pytest

    from device_sim.cli_common import check_xi_disjoint
    from fedfs_sdk.errors import CheckpointError

    root = write_image_folder(SynthFaces(seed=3, image_size=32), tmp_path / "faces", range(6), 2)
    ds = ImageFolderDataset(root, 32)
    splits = make_splits(ds, 2, 3, 1, None, None, seed=0)
    public, clients = splits.identities("public"), splits.identities("clients")
    # ξ saw a client by name, although its recorded positions (another folder listing) are public here
    with pytest.raises(CheckpointError, match="pre-trained on 1 identities"):
        check_xi_disjoint({"public_identities": public.tolist(),
                           "public_identity_names": ds.identity_names(clients[:1])}, splits, ds)
    # ξ's positions hit clients here, but its identities (names) are this split's public ones: fine
    check_xi_disjoint({"public_identities": clients.tolist(), "public_identity_names": ds.identity_names(public)},
                      splits, ds)
    # a ξ written before names were recorded: positions, as before
    with pytest.raises(CheckpointError, match="predates identity names"):
        check_xi_disjoint({"public_identities": clients[:1].tolist()}, splits, ds)
    check_xi_disjoint({"public_identities": public.tolist()}, splits, ds)


def test_progress_is_whole_lines_when_stderr_is_not_a_terminal(tmp_path, capsys) -> None:
    """A log file or pipe gets a line per 10 % (no tqdm \\r frames); --quiet gets nothing."""
    args = ["simulate", "--method", "feduv", *TINY_DATA, "--cache-dir", str(tmp_path / "c"), "--rounds", "2",
            "--out", str(tmp_path / "run")]
    assert main(args) == 0
    err = capsys.readouterr().err           # capsys: not a tty, like `fedfs simulate … 2> log`
    assert "\r" not in err
    lines = err.splitlines()
    assert any(line.startswith("pre-training ξ:") for line in lines), err
    assert any(line.startswith("feduv (c=127): 2/2 round (100%)") for line in lines), err
    assert len(err) < 4000
    assert main([*args, "--quiet", "--out", str(tmp_path / "run2")]) == 0
    assert capsys.readouterr().err == ""


def test_line_progress_reports_every_tenth() -> None:
    import io

    from fedfs_sdk.cli.progress import progress_bar

    buf = io.StringIO()
    with progress_bar("work", total=200, unit="step", file=buf) as bar:
        for _ in range(200):
            bar.update(1)
            bar.set_postfix(loss="0.5")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("work: 20/200 step (10%)") and lines[-1].startswith("work: 200/200")
    assert lines[-1].endswith("[loss=0.5]")
    buf = io.StringIO()
    with progress_bar("open-ended", file=buf) as bar:       # no total: a final line only (short task)
        bar.update(3)
    assert buf.getvalue().startswith("open-ended: done 3 it in ")


def test_help_shows_defaults_and_describes_every_flag(capsys) -> None:
    import argparse

    import pytest

    from fedfs_sdk.cli.main import build_parser

    for command in ("serve", "export", "demo", "simulate", "pretrain"):
        sub = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
        undocumented = [a.option_strings[0] for a in sub.choices[command]._actions if not a.help]
        assert undocumented == [], (command, undocumented)
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        if command == "serve":
            assert "--embedding-dim EMBEDDING_DIM embedding size" in text and "--init-seed INIT_SEED seed" in text
            assert "--port PORT TCP port" in text and "(default: 8080)" in text
            assert "--device-ttl" in text and "a new state starts with 600.0" in text
        if command == "export":
            assert "--quiet no progress display" in text
        if command == "demo":
            assert "relative to the current directory" in text and "(default: runs/demo)" in text
            assert "--clients CLIENTS federated clients" in text and "(default: 100)" in text
        if command == "simulate":
            assert "--momentum MOMENTUM local SGD momentum (default: 0.0)" in text
