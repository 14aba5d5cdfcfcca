"""fedfs next to the `face_recognition` library on the same genuine / impostor pairs of real photos.

    python benchmarks/real_faces.py --data ../shared/data/lfw --model xi.safetensors --detect-face
    python benchmarks/real_faces.py --data ../shared/data/lfw --model xi.safetensors --detect-face \\
        --run runs/lfw          # + the personalized rows of a `fedfs simulate --data … --checkpoint…` run

**face_recognition** (ageitgey, the library most users pick): ``face_locations`` (dlib's HOG
detector, upsampled once), ``face_encodings`` (the 5-point shape predictor, dlib's ResNet
descriptor of the 150×150 chip, one jitter) and ``face_distance`` (Euclidean), "same person"
at its default ``tolerance=0.6``. Where ``import face_recognition`` works it is used; otherwise
the same dlib calls are made directly (they are all the library does; its package needs
``pkg_resources``, which recent setuptools no longer ship) — the output says which. A photo
where the detector finds no face gets the whole image as its box (face_recognition would return
no encoding; counted and printed).

**fedfs**: each ``--model`` (a fedfs checkpoint or .onnx; e.g. an imported MobileFaceNet or
``dlib-resnet``) embeds the photos as ``fedfs enroll`` does (``--detect-face``: five-point
alignment); the score is the cosine. Its operating threshold is set the way ``fedfs enroll --far``
sets one: at FAR 1e-3 on impostor pairs of the **public** identities (a seeded quarter of the
folder, never scored below), with the conformal rule of :mod:`fedfs_sdk.runtime.operating_point`.

**Protocol A (global models)** — every identity not public: genuine = every pair of photos of
one person, impostor = every pair of photos of two people. AUROC, TAR@FAR 1e-3, EER, and each
one's accept rates at its own operating point (face_recognition: distance ≤ 0.6; fedfs: τ_far).

**Protocol B (``--run DIR``, personalized)** — the pairs of a simulation's pairwise protocol
(docs/evaluation.md): for each evaluated client, every pair of its test photos (genuine) and
each of them × the other clients' test photos (impostor), mean over clients. The run's methods
scored those pairs with each client's own verifier (``results.json``); face_recognition and each
``--model`` score the same pairs here. Needs a run without capture shift (``--scenario real-*``
changes the pixels face_recognition would have to see) and an impostor pool holding every
client's test photos (``--impostor-pool`` ≥ their number).

Embeddings are cached (``--cache``, keyed by model file, photo list and preprocessing).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from device_sim import metrics as M  # noqa: E402
from fedfs_sdk.runtime.operating_point import far_threshold  # noqa: E402
from fedfs_sdk.runtime.preprocess import IMAGE_EXTENSIONS  # noqa: E402

FAR = 1e-3
TOLERANCE = 0.6


def list_folder(root: Path) -> tuple[list[str], list[Path]]:
    names, files = [], []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        for f in sorted(d.iterdir()):
            if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS:
                names.append(d.name)
                files.append(f)
    return names, files


def _cache_file(cache: Path, kind: str, files: list[Path], extra: str) -> Path:
    h = hashlib.sha256(extra.encode())
    for f in files:
        h.update(str(f.resolve()).encode())
    return cache / f"{kind}-{h.hexdigest()[:20]}.npz"


# ---- face_recognition (or the dlib calls it makes) --------------------------------------------

def face_recognition_encoder():
    """``(encode(rgb) -> (128-d, found), label)``: the library if it imports, else its dlib calls."""
    try:
        import face_recognition as fr

        def encode(rgb):
            boxes = fr.face_locations(rgb)                    # HOG, upsample 1
            found = bool(boxes)
            if not found:
                boxes = [(0, rgb.shape[1], rgb.shape[0], 0)]  # (top, right, bottom, left): the whole image
            return np.asarray(fr.face_encodings(rgb, boxes)[0]), found   # 5 points, 1 jitter
        return encode, "face_recognition " + getattr(fr, "__version__", "?")
    except Exception as e:          # noqa: BLE001 — any import failure: make its calls ourselves
        why = f"{type(e).__name__}: {e}".splitlines()[0]
    import importlib.util

    import dlib

    spec = importlib.util.find_spec("face_recognition_models")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("neither face_recognition nor face_recognition_models is installed: "
                         "pip install 'fedfs[faces]'")
    models = Path(list(spec.submodule_search_locations)[0]) / "models"
    detector = dlib.get_frontal_face_detector()
    shape5 = dlib.shape_predictor(str(models / "shape_predictor_5_face_landmarks.dat"))
    net = dlib.face_recognition_model_v1(str(models / "dlib_face_recognition_resnet_model_v1.dat"))

    def encode(rgb):
        boxes = detector(rgb, 1)
        found = len(boxes) > 0
        box = boxes[0] if found else dlib.rectangle(0, 0, rgb.shape[1], rgb.shape[0])
        return np.asarray(net.compute_face_descriptor(rgb, shape5(rgb, box), 1)), found
    return encode, f"dlib {dlib.__version__} called as face_recognition calls it (face_recognition did not import: {why})"


def fr_descriptors(files: list[Path], cache: Path) -> tuple[np.ndarray, np.ndarray, str]:
    encode, label = face_recognition_encoder()
    path = _cache_file(cache, "face_recognition", files, "hog1-shape5-jitter1")
    if path.is_file():
        z = np.load(path)
        return z["d"], z["found"], label
    from PIL import Image
    d, found = [], []
    for f in files:
        rgb = np.array(Image.open(f).convert("RGB"))     # face_recognition.load_image_file
        v, ok = encode(rgb)
        d.append(v)
        found.append(ok)
    d, found = np.stack(d), np.array(found)
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(path, d=d, found=found)
    return d, found, label


# ---- fedfs ----------------------------------------------------------------------------------

def fedfs_embeddings(model: str, files: list[Path], detect_face: bool, cache: Path) -> np.ndarray:
    """Embeddings of ``files`` by a fedfs model file or a built-in name (``dlib-resnet``), each
    photo preprocessed as ``fedfs enroll`` would (the model's own face crop where it has one)."""
    from fedfs_sdk.cli.common import load_backend
    from fedfs_sdk.nn.builtin_models import builtin_name, save_builtin
    from fedfs_sdk.runtime.preprocess import model_face_mode, preprocess

    if builtin_name(model):
        cache.mkdir(parents=True, exist_ok=True)
        model = str(save_builtin(builtin_name(model), cache / f"{builtin_name(model)}.safetensors"))
    mh = hashlib.sha256(Path(model).read_bytes()).hexdigest()[:16]
    path = _cache_file(cache, "fedfs", files, f"{mh}-{detect_face}")
    if path.is_file():
        return np.load(path)["e"]
    backend = load_backend(model)
    mode = model_face_mode(detect_face, getattr(backend, "alignment", None)) or False
    from fedfs_sdk.errors import NoFaceError

    out, faceless = [], []
    for a in range(0, len(files), 64):
        chunk = [str(f) for f in files[a:a + 64]]
        try:
            x = preprocess(chunk, backend.input_size, detect_face=mode)
        except NoFaceError:     # one photo without a face: the others as usual, it as a centre crop
            parts = []
            for f in chunk:
                try:
                    parts.append(preprocess([f], backend.input_size, detect_face=mode))
                except NoFaceError:
                    faceless.append(f)
                    parts.append(preprocess([f], backend.input_size, detect_face=False))
            x = np.concatenate(parts)
        out.append(backend.run(x)["embedding"])
    if faceless:
        print(f"fedfs {Path(model).name}: no face found in {len(faceless)} photo(s), scored as centre crops: "
              + ", ".join(Path(f).name for f in faceless))
    e = np.concatenate(out).astype(np.float64)
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(path, e=e)
    return e


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


# ---- protocol A ------------------------------------------------------------------------------

def pair_scores(sim: np.ndarray, labels: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Genuine / impostor scores of every unordered pair among ``rows`` (``sim``: full matrix)."""
    s = sim[np.ix_(rows, rows)]
    lab = labels[rows]
    iu = np.triu_indices(rows.size, 1)
    same = (lab[:, None] == lab[None, :])[iu]
    v = s[iu]
    return v[same], v[~same]


def summarize(g: np.ndarray, i: np.ndarray, accept_at: float) -> dict:
    return {"auroc": M.auroc(g, i), "tar": M.tar_at_far(g, i, FAR), "eer": M.eer(g, i),
            "accept_genuine": float((g >= accept_at).mean()), "accept_impostor": float((i >= accept_at).mean()),
            "n_genuine": int(g.size), "n_impostor": int(i.size)}


def protocol_a(labels: np.ndarray, public: np.ndarray, evaluated: np.ndarray, fr: np.ndarray,
               fedfs: dict[str, np.ndarray], fr_label: str) -> list[tuple[str, dict, str]]:
    rows = []
    d = np.linalg.norm(fr[:, None, :] - fr[None, :, :], axis=-1)
    g, i = pair_scores(-d, labels, evaluated)
    rows.append((fr_label.split(" (")[0], summarize(g, i, -TOLERANCE), f"distance ≤ {TOLERANCE} (its default)"))
    for name, e in fedfs.items():
        u = _unit(e)
        sim = u @ u.T
        _, pub_imp = pair_scores(sim, labels, public)
        tau = far_threshold(pub_imp, FAR).tau
        g, i = pair_scores(sim, labels, evaluated)
        rows.append((f"fedfs ξ {name}", summarize(g, i, tau),
                     f"cosine ≥ {tau:.4f} (FAR {FAR:g} on {pub_imp.size:,} public impostor pairs)"))
    return rows


# ---- protocol B ------------------------------------------------------------------------------

def protocol_b(run: Path, files_by_key: dict[tuple[str, str], int], fr: np.ndarray,
               fedfs: dict[str, np.ndarray], fr_label: str) -> list[tuple[str, dict, str]]:
    from device_sim.experiment import ExperimentConfig
    from device_sim.experiment_data import build_data
    from device_sim.experiment_resolve import resolve_experiment
    from device_sim.report import lookup

    res = json.loads((run / "results.json").read_text())
    if "per_seed" in res:
        raise SystemExit(f"{run} is a --seeds run: pass one seed's folder ({run}/seed_0)")
    cfg = resolve_experiment(ExperimentConfig.from_mapping(res["settings"]))   # the run's data, as it resolved it
    if (cfg.data.capture_shift or "none") != "none":
        raise SystemExit("protocol B needs a run without a capture shift (face_recognition would have to see the "
                         "shifted pixels)")
    ds, splits = build_data(cfg)
    ev = res["methods"][0]["eval"]
    clients = ev["clients"]
    test = {c: [files_by_key[(ds.names[splits.clients[c].identity], Path(ds.files[splits.clients[c].identity][j]).stem)]
                for j in splits.clients[c].test] for c in clients}
    pool_n = sum(len(v) for v in test.values())
    if ev["impostor_pool"] < pool_n:
        raise SystemExit(f"the run sampled {ev['impostor_pool']} of {pool_n} test photos as impostors: rerun it with "
                         f"--impostor-pool {pool_n}")

    def per_client(score_fn) -> dict:
        au, tar, eer = [], [], []
        for c in clients:
            own = np.array(test[c])
            others = np.array([k for o in clients if o != c for k in test[o]])
            g, i = score_fn(own, others)
            au.append(M.auroc(g, i))
            tar.append(M.tar_at_far(g, i, FAR))
            eer.append(M.eer(g, i))
        return {"auroc": float(np.mean(au)), "tar": float(np.mean(tar)), "eer": float(np.mean(eer))}

    def fr_fn(own, others):
        iu = np.triu_indices(own.size, 1)
        dd = -np.linalg.norm(fr[own][:, None] - fr[own][None], axis=-1)
        return dd[iu], -np.linalg.norm(fr[own][:, None] - fr[others][None], axis=-1).ravel()

    rows = [(fr_label.split(" (")[0], per_client(fr_fn), "same pairs")]
    for name, e in fedfs.items():
        u = _unit(e)

        def fn(own, others, u=u):
            iu = np.triu_indices(own.size, 1)
            return (u[own] @ u[own].T)[iu], (u[own] @ u[others].T).ravel()
        rows.append((f"fedfs ξ {name}", per_client(fn), "same pairs"))
    for m in res["methods"]:
        e = m["eval"]
        eer = lookup(e, "pairwise.per_client_eer")
        rows.append((f"fedfs run: {m['label']}", {"auroc": lookup(e, "pairwise.auroc.mean"),
                                                  "tar": lookup(e, "pairwise.tar_at_far.0.001.mean"),
                                                  "eer": float(np.nanmean(eer)) if eer else math.nan},
                     "each client's own verifier, results.json" + (
                         f"; chose ξ/global/personalized {m['selection']['counts']}" if m.get("selection") else "")))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="folder of real photos: DIR/<person>/<photo> (as taken, not aligned)")
    p.add_argument("--model", action="append", default=[], help="a fedfs ξ (checkpoint, .onnx, or a built-in name: "
                   "dlib-resnet); repeatable")
    p.add_argument("--detect-face", action="store_true", help="fedfs: five-point alignment, as enroll --detect-face")
    p.add_argument("--public", type=float, default=0.25, help="share of identities that are public (fedfs's τ)")
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--run", type=Path, default=None, help="a fedfs simulate output folder (protocol B)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "fedfs" / "real_faces")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    root = Path(args.data)
    names, files = list_folder(root)
    people = sorted(set(names))
    labels = np.array([people.index(n) for n in names])
    order = np.random.default_rng(args.split_seed).permutation(len(people))
    n_pub = max(2, int(round(args.public * len(people))))
    public = np.flatnonzero(np.isin(labels, order[:n_pub]))
    evaluated = np.flatnonzero(np.isin(labels, order[n_pub:]))
    fr, found, fr_label = fr_descriptors(files, args.cache)
    fedfs = {Path(m).stem: fedfs_embeddings(m, files, args.detect_face, args.cache) for m in args.model}
    print(f"{root}: {len(people)} people, {len(files)} photos; {n_pub} public identities ({public.size} photos) for "
          f"fedfs's threshold, {len(people) - n_pub} evaluated ({evaluated.size} photos)")
    print(f"face_recognition: {fr_label}; no face found by its HOG detector in {int((~found).sum())} photo(s) "
          "(scored with the whole image as the box)")
    rows = protocol_a(labels, public, evaluated, fr, fedfs, fr_label)
    print(f"\n### Protocol A: every pair of the {len(people) - n_pub} evaluated people "
          f"({rows[0][1]['n_genuine']:,} genuine, {rows[0][1]['n_impostor']:,} impostor pairs)\n")
    print("| model | AUROC | TAR@FAR=1e-3 | EER | operating point | genuine accepted | impostors accepted |")
    print("|---|---|---|---|---|---|---|")
    for name, r, op in rows:
        print(f"| {name} | {r['auroc']:.4f} | {r['tar']:.4f} | {r['eer']:.4f} | {op} | {r['accept_genuine']:.4f} | "
              f"{r['accept_impostor']:.5f} |")
    if args.run is not None:
        keys = {(n, f.stem): k for k, (n, f) in enumerate(zip(names, files))}
        rows = protocol_b(args.run, keys, fr, fedfs, fr_label)
        print(f"\n### Protocol B: the pairwise pairs of {args.run} (mean over its evaluated clients)\n")
        print("| model | pairwise AUROC | TAR@FAR=1e-3 | EER | note |")
        print("|---|---|---|---|---|")
        for name, r, note in rows:
            print(f"| {name} | {r['auroc']:.4f} | {r['tar']:.4f} | {r['eer']:.4f} | {note} |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
