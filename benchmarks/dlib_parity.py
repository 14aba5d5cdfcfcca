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

    # detection and chips photo by photo; the two networks then run in batches (dlib 16, torch 64)
    imgs, shapes, chips, labels, no_face_fr, no_face_ours = [], [], [], [], [], []
    t_det = time.perf_counter()
    for f in files:
        rgb = load_image(f)
        boxes = hog(rgb, 1)                                   # face_recognition.face_locations(img)
        try:
            chip = preprocess(rgb, 150, detect_face="dlib-chip")[0]
        except NoFaceError:
            chip = None
        if not len(boxes):
            no_face_fr.append(f)
            no_face_ours += [f] if chip is None else []
            continue
        if chip is None:   # cannot happen: fedfs's detectors try the same HOG first
            no_face_ours.append(f)
            continue
        box = max(boxes, key=lambda r: r.area())
        imgs.append(rgb)
        shapes.append(sp5(rgb, box))                          # pose_predictor_5_point(img, box)
        chips.append(chip)
        labels.append(f.parent.name)
    t_det = time.perf_counter() - t_det
    t = time.perf_counter()
    fr = []
    for i in range(0, len(imgs), 16):                         # face_encoder.compute_face_descriptor(img, shape, 1)
        faces = []
        for sh in shapes[i:i + 16]:
            one = dlib.full_object_detections()
            one.append(sh)
            faces.append(one)
        out = rec.compute_face_descriptor(imgs[i:i + 16], faces, 1)
        fr += [np.array(d[0]) for d in out]
    t_fr = time.perf_counter() - t
    t = time.perf_counter()
    ours = []
    with torch.no_grad():
        for i in range(0, len(chips), 64):
            ours.append(model(torch.from_numpy(np.stack(chips[i:i + 64]))).embedding.double().numpy())
    ours = list(np.concatenate(ours))
    t_ours = time.perf_counter() - t
    fr_a, ours_a = np.stack(fr), np.stack(ours)
    diff = np.abs(fr_a - ours_a).max(axis=1)
    print(f"face_recognition encoded {len(fr)} photos, no face in {len(no_face_fr)}; fedfs's detectors found "
          f"{len(no_face_fr) - sum(1 for f in no_face_fr if f in no_face_ours)} of those too")
    print(f"descriptor max |Δ| over {len(fr)} photos: {diff.max():.2e} (photos with |Δ| > 1e-4: {(diff > 1e-4).sum()}); "
          f"time per face: dlib's network {1e3 * t_fr / len(fr):.0f} ms, fedfs dlib-resnet (torch, batch 64) "
          f"{1e3 * t_ours / len(fr):.0f} ms; detection of both pipelines {t_det:.0f} s")

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
