"""A folder of real-looking photos (generated faces written as 92×112 greyscale PGMs, like a
studio face set) just works: folder-sized defaults, named skips, marked columns (issue 12)."""
from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from device_sim.folder_split import auto_warmup_q
from device_sim.report import column_notes
from device_sim.splits import make_splits
from device_sim.synthfaces import SynthFaces
from fedfs_sdk.cli.main import main

TINY = ["--width", "4", "--embedding-dim", "16", "--pretrain-epochs", "1", "--pretrain-batch-size", "16", "--quiet"]


def write_photo_folder(root: Path, identities: int, images: int, seed: int = 11) -> Path:
    """``identities × images`` 92×112 greyscale PGMs in ``root/person_XX/`` (SynthFaces rendered
    at 56 px — quick — upscaled to 112 and cropped to a studio set's aspect)."""
    faces = SynthFaces(seed=seed, image_size=56)
    for i in range(identities):
        d = root / f"person_{i:02d}"
        d.mkdir(parents=True, exist_ok=True)
        for k, im in enumerate(faces.render_uint8(i, np.arange(images))):
            big = cv2.resize(cv2.cvtColor(im, cv2.COLOR_RGB2GRAY), (112, 112), interpolation=cv2.INTER_LINEAR)
            cv2.imwrite(str(d / f"{k:02d}.pgm"), big[:, 10:102])
    return root


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    root = write_photo_folder(tmp_path_factory.mktemp("photos") / "faces", 32, 10)
    # the bad data a real folder has: a truncated file, a lone photo, a stray file, a nested folder
    (root / "person_01" / "truncated.pgm").write_bytes((root / "person_01" / "01.pgm").read_bytes()[:300])
    (root / "zz_one_photo").mkdir()
    (root / "zz_one_photo" / "a.pgm").write_bytes((root / "person_03" / "00.pgm").read_bytes())
    (root / "notes.txt").write_text("not a face")
    (root / "person_02" / "old").mkdir()
    (root / "person_02" / "old" / "x.pgm").write_bytes((root / "person_02" / "00.pgm").read_bytes())
    (root / "person_04" / "readme.md").write_text("hi")
    return root


def test_simulate_with_only_data_prints_a_table_and_names_every_skip(photos: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    code = main(["simulate", "--data", str(photos), "--method", "pretrained", "--cache-dir", str(tmp_path / "c"),
                 "--out", str(out), *TINY])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "| pretrained |" in printed.out
    # 33 identities with a usable image: 25 % public (8), 10 % new users (3), the other 22 clients
    assert "8 public identities (ξ), 22 clients, 3 new users; 80/20" in printed.out
    # 8 training images allow q = 1 − 1/8 (0.9 would need 10): said, and used
    assert "warm-up q = 0.875" in printed.out
    for name in ("truncated.pgm", "notes.txt", "person_02/old", "readme.md"):
        assert name in printed.out
    res = json.loads((out / "results.json").read_text())
    assert res["eval_config"]["q"] == 0.875 and res["population"]["clients"] == 22
    files = {Path(f["path"]).name: f["reason"] for f in res["skipped"]["files"]}
    assert set(files) == {"truncated.pgm"} and "truncated.pgm" in files["truncated.pgm"]
    ignored = {Path(f["path"]).name: f["reason"] for f in res["skipped"]["ignored"]}
    assert "nested folder" in ignored["old"] and "not inside an identity folder" in ignored["notes.txt"]
    assert "not an image" in ignored["readme.md"]
    # the one-photo identity cannot be a client; it fills a public place instead of failing the run
    assert "zz_one_photo" not in res["clients"] and len(res["clients"]) == 22
    ev = res["methods"][0]["eval"]
    assert not np.isnan(ev["warmup"]["tpr"]["mean"])
    # each client has 2 test images; 21 other clients → 42 impostor images: FAR 1e-2 < 1/42 is marked
    notes = res["methods"][0]["column_notes"]
    assert "1/42" in notes["verification.tar_at_far.0.001.mean"]
    assert "verification.tar_at_far.0.001.mean" in notes and "identification_clients.tpir_at_fpir.0.1.mean" not in notes
    assert "†" in printed.out and "† " in (out / "results.md").read_text()


def test_pretrain_with_only_data_then_simulate_reuses_its_split(photos: Path, tmp_path: Path, capsys) -> None:
    xi = tmp_path / "xi.safetensors"
    assert main(["pretrain", "--data", str(photos), "--out", str(xi), "--cache-dir", str(tmp_path / "c"), *TINY]) == 0
    printed = capsys.readouterr().out
    assert "on 8 public identities" in printed and "truncated.pgm" in printed
    # the ξ from `pretrain --data DIR` fits `simulate --data DIR` (same public identities held out)
    assert main(["simulate", "--data", str(photos), "--pretrained", str(xi), "--method", "pretrained",
                 "--out", str(tmp_path / "run"), "--quiet"]) == 0


def test_conflicts_are_one_line_naming_the_flag(photos: Path, tmp_path: Path, capsys) -> None:
    base = ["simulate", "--data", str(photos), "--method", "pretrained", "--backbone", "tiny",   # ξ pre-trained here
            "--out", str(tmp_path / "r"), "--quiet"]
    assert main([*base, "--clients", "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--clients 100 does not fit" in err and "--clients 0" in err
    assert main([*base, "--train-per-client", "20"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--train-per-client 0" in err
    assert main([*base, "--public", "31"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lower --public" in err
    assert main([*base, "--clients", "-3"]) == 2
    assert "--clients must be ≥ 0" in capsys.readouterr().err


def test_auto_q_and_resolution_notes_by_hand() -> None:
    class DS:
        num_identities = 5

        def count(self, i: int) -> int:
            return [5, 5, 5, 5, 5][i]
    splits = make_splits(DS(), 0, 4, 0, None, None)             # 80/20 of 5 → 4 train images
    q, note = auto_warmup_q(splits)
    assert q == 0.75 and "0.75" in note                           # ⌈1/(1−0.75)⌉ = 4
    ev = {"verification": {"far_resolution": 1 / 38, "tar_at_far": {"0.001": {"mean": 0.001}, "0.1": {"mean": 0.4}}},
          "new_user_images": 0, "warmup": {"tpr": {"mean": float("nan")}, "n_insufficient": 7}}
    notes = column_notes(ev, q=0.9)
    assert "1/38" in notes["verification.tar_at_far.0.001.mean"]
    assert "0.1" not in [k.split(".")[-2] for k in notes if k.startswith("verification")]
    assert "all 7 users" in notes["warmup.tpr.mean"] and "= 10" in notes["warmup.tpr.mean"]


def test_synth_defaults_unchanged() -> None:
    import argparse

    from device_sim import cli_simulate
    from device_sim.experiment_data import build_data
    from device_sim.experiment_resolve import experiment_from_args
    p = argparse.ArgumentParser()
    cli_simulate.add_arguments(p)
    d = experiment_from_args(p.parse_args(["--public-images", "4"]))
    ds, splits = build_data(d)
    d = d.data
    assert (d.clients, d.new_users, d.public, d.train_per_client, d.test_per_client) == (100, 20, 300, 20, 10)
    assert splits.num_clients == 100 and len(splits.public) == 300 and splits.clients[0].train.size == 20


def test_seeds_table_carries_the_notes(photos: Path, tmp_path: Path, capsys) -> None:
    assert main(["simulate", "--data", str(photos), "--method", "pretrained", "--seeds", "2",
                 "--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "run"), *TINY]) == 0
    out = capsys.readouterr().out
    assert out.count("split of the folder: 8 public identities") == 1 and "warm-up q = 0.875" in out
    assert "† TAR@FAR=1e-3" in out or "TAR@FAR=1e-3:" in out
