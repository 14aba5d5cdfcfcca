"""The typed, frozen experiment config built once at the CLI edge (issue 22 item 6): it is
frozen, its defaults are the command line's, and resolving a command line gives the values
the Namespace used to be mutated into (results.json's ``settings``, key for key)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from device_sim import cli_pretrain, cli_simulate
from device_sim.experiment import DataConfig, ExperimentConfig
from device_sim.experiment_data import build_data
from device_sim.experiment_resolve import experiment_from_args, resolve_experiment
from device_sim.synthfaces import SynthFaces, write_image_folder
from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.builtin_models import FACES_INSTALL


def _ns(*argv: str, module=cli_simulate) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """12 identities × 6 images (SynthFaces at 32 px, PNG)."""
    return write_image_folder(SynthFaces(seed=5, image_size=32), tmp_path_factory.mktemp("f") / "faces", range(12), 6)


@pytest.fixture
def no_builtin(monkeypatch) -> None:
    """As without the ``faces`` extra: no built-in real face recognizer to default to."""
    monkeypatch.setattr("device_sim.experiment_resolve.default_real_face_model", lambda: None)


def test_config_is_frozen_and_changes_make_copies() -> None:
    cfg = ExperimentConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data = DataConfig()                 # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.split_seed = 3                 # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.method = ("fedfs",)           # type: ignore[misc]
    other = cfg.with_fields(seed=4, split_seed=5, out="x", threads=1)
    assert (other.train.seed, other.data.split_seed, other.output.out, other.runtime.threads) == (4, 5, "x", 1)
    assert (cfg.train.seed, cfg.data.split_seed, cfg.output.out, cfg.runtime.threads) == (0, 0, "runs/simulate", None)
    with pytest.raises(TypeError, match="unknown experiment field"):
        cfg.with_fields(sede=1)


def test_defaults_are_the_command_lines_and_settings_keep_every_option() -> None:
    ns = _ns()
    assert ExperimentConfig.from_mapping(vars(ns)) == ExperimentConfig()
    assert ExperimentConfig().to_settings() == vars(ns)          # every option, by its name, nothing else


def test_synth_defaults_resolve_to_the_old_values() -> None:
    ns = _ns("--public-images", "4")
    before = dict(vars(ns))
    cfg = experiment_from_args(ns)
    assert vars(ns) == before                   # the Namespace is read, never changed
    assert cfg.resolved and cfg.notes == ()
    expected = {**before, "clients": 100, "new_users": 20, "public": 300, "train_per_client": 20,
                "test_per_client": 10, "image_size": 32}
    assert cfg.to_settings() == expected
    ds, splits = build_data(cfg)
    assert splits.num_clients == 100 and len(splits.public) == 300 and splits.clients[0].train.size == 20
    assert resolve_experiment(cfg) == cfg       # resolving twice changes nothing


def test_cross_domain_scenario_resolves_to_its_settings() -> None:
    ns = _ns("--scenario", "cross-domain", "--clients", "5", "--pretrain-data", "synth")
    cfg = experiment_from_args(ns)
    d = cfg.data
    assert (d.data, d.domain, d.pretrain_domain, d.pretrain_data) == ("synth", "phone", "studio", None)
    assert cfg.to_settings() == {**vars(ns), "domain": "phone", "pretrain_domain": "studio", "pretrain_data": None,
                                 "clients": 5, "new_users": 20, "public": 300, "train_per_client": 20,
                                 "test_per_client": 10, "image_size": 32}
    # results.json's settings give back the same config (benchmarks/real_faces.py rebuilds a run's data so)
    again = ExperimentConfig.from_mapping(json.loads(json.dumps(cfg.to_settings())))
    assert resolve_experiment(again) == cfg


def test_folder_run_resolves_and_splits_as_before(folder: Path, no_builtin) -> None:
    ns = _ns("--data", str(folder))
    cfg = experiment_from_args(ns)
    assert cfg.notes == (f"ξ: pre-trained on the folder's public identities; for a real face recognizer as ξ "
                         f"(dlib-resnet): {FACES_INSTALL}",)
    assert cfg.to_settings() == {**vars(ns), "image_size": 32}    # a folder's split sizes stay for the plan
    ds, splits = build_data(cfg)
    # 12 identities: 25 % public (3), 10 % new users (1), the other 8 clients, 80/20 of 6 images
    assert splits.meta["plan"] == [cfg.notes[0], "split of the folder: 3 public identities (ξ), 8 clients, 1 new "
                                                 "users; 80/20 train/test images per identity"]
    assert (len(splits.public), splits.num_clients, len(splits.new_users)) == (3, 8, 1)


def test_real_photo_default_xi_and_the_pretrain_command(folder: Path, monkeypatch) -> None:
    monkeypatch.setattr("device_sim.experiment_resolve.default_real_face_model", lambda: "dlib-resnet")
    cfg = experiment_from_args(_ns("--data", str(folder)))
    assert (cfg.xi.pretrained, cfg.data.image_size, cfg.data.detect_face) == ("dlib-resnet", 150, "dlib-chip")
    assert "built-in dlib-resnet" in cfg.notes[0]
    # fedfs pretrain trains ξ: it has no --pretrained and never defaults to a built-in one
    pre = experiment_from_args(_ns("--data", str(folder), module=cli_pretrain))
    assert (pre.xi.pretrained, pre.data.image_size, pre.data.detect_face) == (None, 32, False)


@pytest.mark.parametrize("argv, message", [
    (["--capture-shift", "phone"], "--capture-shift applies to a folder of real photos"),
    (["--scenario", "synth-to-folder"], "needs the clients' images: pass --data PATH"),
    (["--data", "/nonexistent/faces"], "is not a directory"),
    (["--pretrained", "dlib-resnet", "--image-size", "112"], "takes 150 px inputs; drop --image-size 112"),
])
def test_bad_combinations_raise_the_same_errors(argv: list[str], message: str) -> None:
    with pytest.raises(InputError, match=message):
        experiment_from_args(_ns(*argv))


def test_builders_refuse_an_unresolved_config() -> None:
    with pytest.raises(ValueError, match="resolve_experiment"):
        build_data(ExperimentConfig())
