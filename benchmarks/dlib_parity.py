"""fedfs's ``dlib-resnet`` vs the ``face_recognition`` library's pipeline on the same LFW pairs.

Usage: PYTHONPATH=. python benchmarks/dlib_parity.py [--data ../shared/data/lfw] [--limit N] [--threads 1]

Two pipelines per photo:

* **face_recognition** — what ``face_recognition.face_encodings(img)`` runs, called through dlib's
  API directly (the ``face_recognition`` package imports ``pkg_resources``, which recent setuptools
  no longer ship): ``dlib.get_frontal_face_detector()(img, 1)`` (``face_locations``, HOG, one
  upsampling), ``shape_predictor_5_face_landmarks`` on the box (``model="small"``), then
  ``face_recognition_model_v1.compute_face_descriptor(img, shape, 1)``; the largest face of a photo.
  Scores: ``−‖a − b‖`` (``face_distance``; "same person" below its 0.6 tolerance).
* **fedfs** — ``preprocess(photo, 150, detect_face="dlib-chip")`` (fedfs's detectors, dlib's
  5-point chip) and the ``dlib-resnet`` built-in model in torch (``load_builtin``).

Pairs: every pair of photos that face_recognition could encode (genuine: same person; impostor:
different people). Printed: max |Δ descriptor| between the pipelines, how many chips differ,
AUROC / EER / TAR@FAR 1e-3 of both (fedfs also with cosine, the score its templates use), and
each one's accept rates at the 0.6 tolerance.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared = Path(os.environ.get("FEDFS_SHARED_DIR") or ROOT.parent / "shared")
    ap.add_argument("--data", default=str(shared / "data" / "lfw"), help="folder of <person>/<photo>")
    ap.add_argument("--limit", type=int, default=0, help="only the first N photos (0: all)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import dlib

    from device_sim.metrics import verification_metrics
    from fedfs_sdk.nn.builtin_models import load_builtin, model_file
    from fedfs_sdk.runtime.align import _shape_predictor_5
    from fedfs_sdk.runtime.preprocess import load_image, preprocess
    from fedfs_sdk.errors import NoFaceError

    files = sorted(Path(args.data).glob("*/*"))
    files = [f for f in files if f.suffix.lower() in (".jpg", ".jpeg", ".png")]
    if args.limit:
        files = files[:args.limit]
    hog, sp5 = dlib.get_frontal_face_detector(), _shape_predictor_5()
    rec = dlib.face_recognition_model_v1(str(model_file("dlib-resnet")))
    model, meta = load_builtin("dlib-resnet")
    print(f"{len(files)} photos of {len({f.parent.name for f in files})} people; dlib-resnet model_id {meta['model_id']}, "
          f"{args.threads} thread(s)")

    fr, ours, labels, no_face_fr, no_face_ours = [], [], [], [], []
    t_fr = t_ours = 0.0
    for f in files:
        rgb = load_image(f)
        t = time.perf_counter()
        boxes = hog(rgb, 1)
        d_fr = None
        if len(boxes):
            box = max(boxes, key=lambda r: r.area())
            d_fr = np.array(rec.compute_face_descriptor(rgb, sp5(rgb, box), 1))
        t_fr += time.perf_counter() - t
        t = time.perf_counter()
        try:
            x = preprocess(rgb, 150, detect_face="dlib-chip")
            with torch.no_grad():
                d_ours = model(torch.from_numpy(x)).embedding[0].double().numpy()
        except NoFaceError:
            d_ours = None
        t_ours += time.perf_counter() - t
        if d_fr is None:
            no_face_fr.append(f)
            no_face_ours += [f] if d_ours is None else []
            continue
        if d_ours is None:          # found by face_recognition's detector but not ours: cannot happen (same HOG first)
            no_face_ours.append(f)
            continue
        fr.append(d_fr)
        ours.append(d_ours)
        labels.append(f.parent.name)
    fr_a, ours_a = np.stack(fr), np.stack(ours)
    diff = np.abs(fr_a - ours_a).max(axis=1)
    print(f"face_recognition encoded {len(fr)} photos, no face in {len(no_face_fr)}; fedfs's detectors found "
          f"{len(no_face_fr) - sum(1 for f in no_face_fr if f in no_face_ours)} of those too")
    print(f"descriptor max |Δ| over {len(fr)} photos: {diff.max():.2e} (photos with |Δ| > 1e-4: {(diff > 1e-4).sum()}); "
          f"time per photo: face_recognition path {1e3 * t_fr / len(files):.0f} ms, fedfs {1e3 * t_ours / len(files):.0f} ms")

    lab = np.asarray(labels)
    iu = np.triu_indices(len(lab), 1)
    same = (lab[:, None] == lab[None, :])[iu]

    def euclid(e: np.ndarray) -> np.ndarray:
        sq = (e * e).sum(1)
        return np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2 * e @ e.T, 0))[iu]

    def cosine(e: np.ndarray) -> np.ndarray:
        u = e / np.linalg.norm(e, axis=1, keepdims=True)
        return (u @ u.T)[iu]

    print(f"pairs: {int(same.sum())} genuine, {int((~same).sum())} impostor")
    print(f"{'pipeline':<34}{'AUROC':>8}{'EER':>8}{'TAR@FAR1e-3':>13}{'genuine <0.6':>14}{'impostor <0.6':>15}")
    rows = {"face_recognition (−euclidean)": (fr_a, "e"), "fedfs dlib-resnet (−euclidean)": (ours_a, "e"),
            "fedfs dlib-resnet (cosine)": (ours_a, "c")}
    for name, (e, kind) in rows.items():
        d = euclid(e)
        s = -d if kind == "e" else cosine(e)
        m = verification_metrics(s[same], s[~same], fars=(1e-3,))
        acc = f"{np.mean(d[same] < 0.6):>14.4f}{np.mean(d[~same] < 0.6):>15.4f}" if kind == "e" else f"{'':>29}"
        print(f"{name:<34}{m['auroc']:>8.4f}{m['eer']:>8.4f}{m['tar_at_far'][1e-3]:>13.4f}{acc}")


if __name__ == "__main__":
    sys.exit(main())
