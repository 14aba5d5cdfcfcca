"""A folder of hard-to-detect face photos, derived from real ones (issue 31).

    python benchmarks/make_hard_faces.py --src ../shared/data/yalefaces --src ../shared/data/lfw \\
        --per-source 20 --out /tmp/hard_faces

Each photo of the first ``--per-source`` identities (with ≥ ``--min-images`` photos) of each
source becomes a **tight face crop** (dlib HOG's box on the original photo, 10 % margin,
resized to 92×112 — a face filling the frame, as in cropped face sets) taken under **hard
light**: per photo (seeded by its path) an exposure gain log-uniform in [0.08, 0.5], a side
light (one side up to 1.9× the other, random direction) and gamma 1.3 — dark and side-lit,
the photos the detectors lose. Photos whose face the plain HOG does not find in the original
are left out (the crop needs a box). Identities are ``<source>_<name>``.
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import cv2
import numpy as np

from fedfs_sdk.runtime.align import DetectSettings, locate
from fedfs_sdk.runtime.preprocess import IMAGE_EXTENSIONS, load_image


def hard(rgb: np.ndarray, key: str) -> np.ndarray:
    rng = np.random.default_rng(int(hashlib.sha256(key.encode()).hexdigest()[:12], 16))
    x = rgb.astype(np.float32) / 255.0
    gain = float(np.exp(rng.uniform(np.log(0.08), np.log(0.5))))
    h, w = x.shape[:2]
    ang = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    ramp = ((xx / w - 0.5) * np.cos(ang) + (yy / h - 0.5) * np.sin(ang)) * 2     # −1 … 1 across the frame
    light = 1.0 + rng.uniform(0.4, 0.9) * ramp
    x = np.clip(x * gain * light[..., None], 0, 1) ** 1.3
    return np.clip(np.rint(x * 255), 0, 255).astype(np.uint8)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", action="append", required=True)
    p.add_argument("--per-source", type=int, default=20)
    p.add_argument("--min-images", type=int, default=8)
    p.add_argument("--max-images", type=int, default=16)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = Path(a.out)
    plain = DetectSettings(equalize=False, cnn=False)
    n = 0
    for src in a.src:
        root = Path(src)
        ids = [d for d in sorted(root.iterdir()) if d.is_dir()
               and sum(f.suffix.lower() in IMAGE_EXTENSIONS for f in d.iterdir()) >= a.min_images][:a.per_source]
        for d in ids:
            files = [f for f in sorted(d.iterdir()) if f.suffix.lower() in IMAGE_EXTENSIONS][:a.max_images]
            for f in files:
                rgb = load_image(f)
                face = locate(rgb, "dlib-chip", plain)
                if face is None:
                    continue
                l, t, r, b = face.box
                m = int(0.1 * (r - l))
                l, t, r, b = max(0, l - m), max(0, t - m), min(rgb.shape[1], r + m), min(rgb.shape[0], b + m)
                crop = cv2.resize(rgb[t:b, l:r], (92, 112), interpolation=cv2.INTER_AREA)
                img = hard(crop, f"{root.name}/{d.name}/{f.name}")
                dst = out / f"{root.name}_{d.name}" / (f.stem + ".png")
                dst.parent.mkdir(parents=True, exist_ok=True)
                cv2.imwrite(str(dst), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
                n += 1
    print(f"wrote {n} photos of {len(list(out.iterdir()))} identities under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
