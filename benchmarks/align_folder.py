"""Write an aligned copy of an ImageFolder (``DIR/<person>/<photo>``) once, so experiments do not
re-detect every face on every run.

Each photo goes through :func:`fedfs_sdk.runtime.align.align_face` (dlib HOG, then its CNN
detector; five points onto the ArcFace 112×112 template) — exactly what ``--detect-face`` does
inside ``fedfs simulate`` — and is written as a lossless PNG at ``--size``. A photo with no
face found is listed and left out (``--detect-face`` skips it the same way), unless
``--fallback center`` writes its centre crop instead.

    python benchmarks/align_folder.py --data ../shared/data/lfw --out /tmp/faces/lfw-112

Prints how many photos were aligned by which detector and names every photo left out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np

from fedfs_sdk.runtime.align import align_face
from fedfs_sdk.runtime.preprocess import IMAGE_EXTENSIONS, center_square, load_image


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="ImageFolder root: DIR/<person>/<photo>")
    p.add_argument("--out", required=True, help="where the aligned copy goes (same layout, .png)")
    p.add_argument("--size", type=int, default=112, help="output side in pixels (ArcFace template scaled)")
    p.add_argument("--fallback", choices=["skip", "center"], default="skip",
                   help="a photo without a detected face: leave it out (default) or write its centre crop")
    args = p.parse_args(argv)
    src, dst = Path(args.data), Path(args.out)
    if not src.is_dir():
        print(f"error: --data {src} is not a directory", file=sys.stderr)
        return 2
    counts: dict[str, int] = {}
    left_out: list[str] = []
    for person in sorted(d for d in src.iterdir() if d.is_dir()):
        for f in sorted(person.iterdir()):
            if f.suffix.lower() not in IMAGE_EXTENSIONS:
                continue
            out = dst / person.name / (f.stem + ".png")
            if out.is_file():
                counts["already there"] = counts.get("already there", 0) + 1
                continue
            rgb = load_image(str(f))
            res = align_face(rgb, args.size)
            img = res.image
            if img is None:
                if args.fallback == "skip":
                    left_out.append(f"{f}: {res.reason}")
                    continue
                img = cv2.resize(center_square(rgb), (args.size, args.size), interpolation=cv2.INTER_AREA)
                counts["centre crop (no face)"] = counts.get("centre crop (no face)", 0) + 1
            else:
                counts[res.method] = counts.get(res.method, 0) + 1
            out.parent.mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(out), cv2.cvtColor(np.ascontiguousarray(img), cv2.COLOR_RGB2BGR))
    print(f"{dst}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f", {len(left_out)} left out")
    for line in left_out:
        print(f"  left out {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
