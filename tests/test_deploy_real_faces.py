"""docs/real-faces.md's deployment as written ("Deploy: a server and phones from a real
model"), with real processes on 127.0.0.1 and LFW people: ``fedfs import-model`` (the PaddleX
MobileFaceNet of ../shared/models) or the built-in ``dlib-resnet``, ``fedfs impostors``, ``fedfs
serve --xi … --impostors …``, three ``fedfs device --enroll`` and ``fedfs verify``. The owners
are accepted and strangers rejected at the enrollment's stated FAR (issue 29: the docs' way used
to load the imported weights into the wrong layers, and the verifier accepted everyone).

Kept small (3 devices, 1 round, 7 photos each, 24 public impostor photos); skips cleanly without
../shared."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest_server import ADMIN, ROOT, free_port, subprocess_env
from shared_assets import LFW, MODELS

pytestmark = pytest.mark.timeout(1800)

PADDLEX = MODELS / "paddlex-mobilefacenet-ms1mv3.onnx"


def fedfs(*args: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedfs_sdk.cli.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, **kw)


def people(n_owners: int = 3, n_public: int = 8, n_strangers: int = 4) -> tuple[list[Path], list[Path], list[Path]]:
    """Disjoint LFW people: owners (≥ 9 photos), public identities, strangers."""
    all_people = sorted(p for p in LFW.iterdir() if p.is_dir())
    rich = [p for p in all_people if len(list(p.iterdir())) >= 9]
    owners = rich[:n_owners]
    rest = [p for p in all_people if p not in owners]
    return owners, rest[:n_public], rest[n_public:n_public + n_strangers]


def link(files: list[Path], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        (folder / f.name).symlink_to(f)
    return folder


@pytest.mark.skipif(not LFW.is_dir(), reason="../shared (LFW) not present")
@pytest.mark.parametrize("xi", ["paddlex", "dlib-resnet"])
def test_the_documented_deployment_accepts_owners_and_rejects_strangers(tmp_path, xi):
    env = {**subprocess_env(), "OMP_NUM_THREADS": "1"}      # 3 devices + a server on a small machine
    if xi == "paddlex":
        if not PADDLEX.is_file():
            pytest.skip("../shared/models/paddlex-mobilefacenet-ms1mv3.onnx not present")
        r = fedfs("import-model", str(PADDLEX), "--out", str(tmp_path / "xi.safetensors"), env=env, timeout=600)
        assert r.returncode == 0 and "mobilefacenet-affine" in r.stdout, r.stdout + r.stderr
        model, detect = str(tmp_path / "xi.safetensors"), ["--detect-face"]
    else:
        from fedfs_sdk.nn.builtin_models import available

        if not available("dlib-resnet"):
            pytest.skip("the faces extra (dlib, face-recognition-models) is not installed")
        model, detect = "dlib-resnet", []           # dlib-resnet is always fed dlib's face chip
    owners, public, strangers = people()
    pub = tmp_path / "public_faces"
    for p in public:
        link(sorted(p.iterdir())[:3], pub / p.name)
    stranger_dir = link([sorted(p.iterdir())[0] for p in strangers], tmp_path / "strangers")
    r = fedfs("impostors", "--images", str(pub), "--model", model, *detect, "--out", str(tmp_path / "impostors.npz"),
              env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "fedfs_sdk.cli.main", "serve", "--state", str(tmp_path / "server"),
                               "--port", str(port), "--admin-token", ADMIN, "--xi", model,
                               "--impostors", str(tmp_path / "impostors.npz"), "--rounds", "1",
                               "--min-participants", "3", "--log-level", "warning"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        devices = []
        for o in owners:
            photos = sorted(o.iterdir())
            link(photos[:7], tmp_path / o.name / "train")
            link(photos[7:9], tmp_path / o.name / "probe")
            devices.append(subprocess.Popen(
                [sys.executable, "-m", "fedfs_sdk.cli.main", "device", "--server", url, "--images",
                 str(tmp_path / o.name / "train"), "--state", str(tmp_path / o.name / "state"), "--rounds", "1",
                 "--enroll", "--q", "0.8", *detect, "--wait-timeout", "900"],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [d.communicate(timeout=1500)[0] for d in devices]
        for d, out in zip(devices, outs):
            assert d.returncode == 0, out
            assert "took part in 1 round(s)" in out and "enrolled" in out, out
            assert "verifies with:" in out and "public impostor photos" in out, out   # the check ran
    finally:
        server.terminate()
        server.wait(30)
    accepted_owner, accepted_stranger, stated_far = 0, 0, []
    for o in owners:
        state = tmp_path / o.name / "state"
        key = ["--enrollment", str(state / "enrollment.fedfs"), "--key-file", str(state / "enrollment.key")]
        own = fedfs("verify", *key, str(tmp_path / o.name / "probe"), env=env, timeout=600)      # no flag: as enrolled
        others = fedfs("verify", *key, str(stranger_dir), env=env, timeout=600)
        assert own.returncode in (0, 1) and others.returncode in (0, 1), own.stderr + others.stderr
        accepted_owner += int(re.search(r"(\d+) of 2 accepted", own.stdout).group(1))
        accepted_stranger += int(re.search(r"(\d+) of 4 accepted", others.stdout).group(1))
        stated = re.search(r"FAR ([0-9.]+) on the (\d+) public impostor photos", own.stdout)
        assert stated is not None, own.stdout
        stated_far.append(float(stated.group(1)))
    print(f"{xi}: owners {accepted_owner} of 6 probes accepted, strangers {accepted_stranger} of 12, "
          f"stated FAR on the public set {stated_far}")                   # shown with pytest -s
    assert accepted_owner >= 5, f"owners: {accepted_owner} of 6 probes accepted"
    # strangers: no more than the enrollments' stated FAR on the public set lets through (it was 12 of 12)
    assert accepted_stranger <= int(12 * max(stated_far)), f"strangers: {accepted_stranger} of 12 accepted, " \
        f"stated FAR {stated_far}"
