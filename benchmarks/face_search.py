"""Each choice of issue 31's face search against the search before it, on real and hard photos.

    python benchmarks/face_search.py --data ../shared/data/yalefaces --data /tmp/hard_faces \\
        --data ../shared/data/lfw --max-ids 30 --max-images 10

Per folder and search (all through :func:`device_sim.face_locate.locate_faces`, a fresh face
cache each, ``--workers`` processes):

* ``before``: HOG, HOG on the border-padded photo, then the MMOD CNN on ≤ 320 px — the search
  at dc7a663 (``DetectSettings(equalize=False)``, no crop fallback);
* ``+equalized HOG``: HOG again on a CLAHE-equalized copy before the CNN (the default);
* ``+equalized, no CNN``: the cheap path alone;
* ``+crop fallback``: the default, plus the crop fallback where the folder is a folder of crops.

Printed: failure-to-acquire (photos with no face / photos), seconds, how many photos each
detector found, the landmark distance to ``before``'s five points on the photos both found
(mean ‖Δp‖ / inter-ocular distance; 0 where the same detector found them), and ξ = dlib-resnet
on the chips: pair AUROC over the photos the search acquired (every same-identity pair genuine,
every other pair impostor) and TAR at FAR 1e-3 over *all* pairs, a pair with an unacquired
photo counted as rejected (failure-to-acquire charged to the search, as a phone would).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from device_sim.face_cache import FaceCache
from device_sim.face_locate import locate_faces
from device_sim.metrics import auroc
from fedfs_sdk.nn.builtin_models import load_builtin
from fedfs_sdk.runtime.align import DetectSettings, cut
from fedfs_sdk.runtime.preprocess import IMAGE_EXTENSIONS, load_image, to_model_input

SEARCHES = [("before", DetectSettings(equalize=False), False), ("+equalized HOG", DetectSettings(), False),
            ("+equalized, no CNN", DetectSettings(cnn=False), False), ("+crop fallback", DetectSettings(), True)]


def photos(root: Path, max_ids: int, max_images: int) -> tuple[list[Path], np.ndarray]:
    files, labels = [], []
    ids = [d for d in sorted(root.iterdir()) if d.is_dir()][:max_ids]
    for k, d in enumerate(ids):
        fs = [f for f in sorted(d.iterdir()) if f.suffix.lower() in IMAGE_EXTENSIONS][:max_images]
        files += fs
        labels += [k] * len(fs)
    return files, np.array(labels)


_SEEN: dict[tuple, np.ndarray] = {}


def embed(xi, files: list[Path], faces: dict) -> dict[int, np.ndarray]:
    """Unit dlib-resnet embeddings of each located photo's chip (a chip already embedded for
    another search — same photo, same box and points — is not embedded again)."""
    def key(i):
        f = faces[i]
        return (str(files[i]), f.box, f.points.tobytes())

    out = {i: _SEEN[key(i)] for i in faces if key(i) in _SEEN}
    idx = sorted(i for i in faces if i not in out)
    for a in range(0, len(idx), 64):
        part = idx[a:a + 64]
        x = np.stack([to_model_input(cut(load_image(files[i]), faces[i], 150), 150) for i in part])
        with torch.no_grad():
            v = xi(torch.from_numpy(x))
        v = (v.embedding if hasattr(v, "embedding") else v).float().numpy()
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        out.update(zip(part, v))
        _SEEN.update((key(i), e) for i, e in zip(part, v))
    return out


def pair_scores(emb: dict[int, np.ndarray], labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Genuine / impostor cosine scores of acquired pairs, and the number of all genuine /
    impostor pairs (acquired or not)."""
    n = labels.size
    same = labels[:, None] == labels[None, :]
    iu = np.triu_indices(n, 1)
    n_gen, n_imp = int(same[iu].sum()), int((~same)[iu].sum())
    idx = np.array(sorted(emb))
    E = np.stack([emb[i] for i in idx])
    S = E @ E.T
    ju = np.triu_indices(idx.size, 1)
    s = S[ju]
    g = labels[idx][ju[0]] == labels[idx][ju[1]]
    return s[g], s[~g], n_gen, n_imp


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", action="append", required=True)
    p.add_argument("--max-ids", type=int, default=1000)
    p.add_argument("--max-images", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--no-xi", action="store_true", help="skip the dlib-resnet AUROC")
    p.add_argument("--only", action="append", choices=[n for n, _, _ in SEARCHES], default=None,
                   help="run only these searches (the landmark Δ is then against the first one run)")
    a = p.parse_args()
    torch.set_num_threads(1)
    xi = None if a.no_xi else load_builtin("dlib-resnet")[0].eval()
    for data in a.data:
        files, labels = photos(Path(data), a.max_ids, a.max_images)
        print(f"\n## {data}: {len(files)} photos of {labels.max() + 1} identities; {a.workers} workers on a shared "
              "machine (seconds are noisy)")
        print("| search | no face (FTA) | s | HOG / eq-HOG / CNN / crop-fallback | landmark Δ / IOD vs before "
              "| pair AUROC (acquired) | TAR@FAR=1e-3 over all pairs |")
        print("|---|---|---|---|---|---|---|")
        ref = None
        for name, st, fb in [x for x in SEARCHES if a.only is None or x[0] in a.only]:
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                got = locate_faces(files, "dlib-chip", st, FaceCache(tmp), a.workers, fallback=fb)
                secs = time.perf_counter() - t0
            s = got.summary
            if ref is None:
                ref = got.faces
            both = [i for i in got.faces if i in ref]
            d = []
            for i in both:
                p0, p1 = ref[i].points, got.faces[i].points
                iod = np.linalg.norm(p0[:2].mean(0) - p0[2:4].mean(0))
                d.append(np.linalg.norm(p1 - p0, axis=1).mean() / max(iod, 1e-6))
            lm = f"{np.mean(d):.3f} (max {np.max(d):.3f})" if d else "–"
            found = " / ".join(str(s.found[m]) for m in ("dlib-hog", "dlib-hog-eq", "dlib-cnn", "crop-fallback"))
            au = tar = "–"
            if xi is not None and len(got.faces) > 2:
                gen, imp, n_gen, n_imp = pair_scores(embed(xi, files, got.faces), labels)
                au = f"{auroc(gen, imp):.4f}"
                thr = np.quantile(imp, 1 - 1e-3) if imp.size else np.inf     # FAR 1e-3 on the acquired impostor pairs
                tar = f"{(gen > thr).sum() / n_gen:.4f}"
            print(f"| {name} | {s.none} / {s.photos} ({s.fta:.1%}) | {secs:.0f} | {found} | {lm} | {au} | {tar} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
