"""False accepts under control on real photos: ``enroll(..., far=1e-3)`` against held-out impostors.

    python benchmarks/enroll_far.py --data ../shared/data/lfw --model xi.safetensors --detect-face
    python benchmarks/enroll_far.py --data ../shared/data/lfw --model dlib-resnet

The folder's people are split (seeded) into a **public impostor set** (``--public`` of them, every
photo: what ships with the model) and **owners**. Each owner enrolls with ``fedfs_sdk.enroll``
on 80 % of its photos — FedUV's warm-up at ``q`` and τ for FAR ``--far`` on the public set
(:mod:`fedfs_sdk.runtime.operating_point`) — and is then probed with

* its own other 20 % (genuine: TAR at τ);
* every photo of every *other owner* (held-out impostors, never in the public set): the FAR.

Printed: the stated bound ``(k+1)/(n+1)``, the held-out impostor accept rate (mean over owners,
and pooled), the warm-up TPR at τ, the TAR, and how many owners ``enroll`` refused because the
warm-up could not reach ``q`` at that FAR. The same with FedUV's warm-up τ alone (no FAR target)
for comparison. Each model embeds each photo once (the cache of ``benchmarks/real_faces.py``);
``enroll`` runs unchanged on those embeddings through a look-up backend.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.real_faces import fedfs_embeddings, list_folder  # noqa: E402
from fedfs_sdk.errors import OperatingPointError  # noqa: E402
from fedfs_sdk.runtime.enrollment import enroll  # noqa: E402


class LookupBackend:
    """An inference backend over embeddings computed once: photo ``i`` is passed to ``enroll`` as
    a tiny array holding ``i``; ``run`` returns the model's embedding of that photo."""

    outputs = ("embedding",)
    input_size = 4

    def __init__(self, emb: np.ndarray, model_id: str) -> None:
        self.emb, self.model_id = emb.astype(np.float32), model_id

    def photos(self, idx: np.ndarray) -> np.ndarray:
        x = np.zeros((len(idx), 3, 4, 4), np.float32)
        x[:, 0, 0, 0] = idx
        return x

    def run(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return {"embedding": self.emb[x[:, 0, 0, 0].astype(np.int64)]}


class LookupImpostors:
    """The public impostor set as :func:`enroll` reads one: photos (look-up arrays) and their people."""

    def __init__(self, photos: np.ndarray, identity: np.ndarray) -> None:
        self.photos, self.identity = photos, identity
        self.num_identities = int(np.unique(identity).size)

    def __len__(self) -> int:
        return len(self.photos)

    def batch(self, input_size: int) -> np.ndarray:
        return self.photos

    def digest(self) -> str:
        return "lookup"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--model", required=True, help="fedfs checkpoint / .onnx, or a built-in name (dlib-resnet)")
    p.add_argument("--detect-face", action="store_true")
    p.add_argument("--public", type=float, default=0.5, help="share of people in the public impostor set")
    p.add_argument("--far", type=float, default=1e-3)
    p.add_argument("--q", type=float, default=0.8, help="warm-up TPR the enrollment must keep (16 photos: ≥ 5 needed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "fedfs" / "real_faces")
    args = p.parse_args(argv)
    names, files = list_folder(Path(args.data))
    people = sorted(set(names))
    labels = np.array([people.index(n) for n in names])
    emb = fedfs_embeddings(args.model, files, args.detect_face, args.cache)
    backend = LookupBackend(emb, f"lookup:{Path(args.model).name}")
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(people))
    n_pub = int(round(args.public * len(people)))
    public = np.flatnonzero(np.isin(labels, order[:n_pub]))
    owners = order[n_pub:]
    imp = LookupImpostors(backend.photos(public), labels[public])
    rows = {"far": [], "q": []}
    for o in owners:
        mine = rng.permutation(np.flatnonzero(labels == o))
        k = int(round(0.8 * mine.size))
        warm, test = mine[:k], mine[k:]
        others = np.flatnonzero(np.isin(labels, owners) & (labels != o))
        for mode in ("far", "q"):
            try:
                e = enroll(backend, backend.photos(warm), q=args.q, impostors=imp,
                           far=args.far if mode == "far" else None)
            except OperatingPointError as err:
                rows[mode].append({"refused": str(err)})
                continue
            t = e.template.astype(np.float64)
            u = emb / np.linalg.norm(emb, axis=1, keepdims=True)
            op = e.meta["operating_point"]
            rows[mode].append({"far": float((u[others] @ t >= e.threshold).mean()), "n_imp": int(others.size),
                               "accepted": int((u[others] @ t >= e.threshold).sum()),
                               "tar": float((u[test] @ t >= e.threshold).mean()) if test.size else np.nan,
                               "warm": op["warmup_tpr"], "bound": op.get("far_bound"),
                               "bound_people": op.get("far_bound_people"),
                               "far_public": op["far_public"]})
    print(f"{args.data}: {len(people)} people; public impostor set: {n_pub} people, {public.size} photos; "
          f"{len(owners)} owners (80 % warm-up, 20 % genuine probes), held-out impostors: the other owners' photos")
    print(f"model {args.model}; q = {args.q}\n")
    print("| τ from | owners enrolled | refused | stated bound: photos / people | held-out impostor accept rate "
          "(mean over owners) | pooled | max over owners | public accept rate | warm-up TPR | TAR (own held-out photos) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, label in (("far", f"FAR {args.far:g} on the public set (enroll far=)"), ("q", f"FedUV warm-up q = {args.q}")):
        ok = [r for r in rows[mode] if "refused" not in r]
        ref = len(rows[mode]) - len(ok)
        if not ok:
            print(f"| {label} | 0 | {ref} | – | – | – | – | – | – | – |")
            continue
        bound = ok[0]["bound"]
        pooled = sum(r["accepted"] for r in ok) / sum(r["n_imp"] for r in ok)
        bp = ok[0].get("bound_people")
        print(f"| {label} | {len(ok)} | {ref} | {('≤ %.2g / ≤ %.2g' % (bound, bp)) if bound else '–'} | "
              f"{np.mean([r['far'] for r in ok]):.5f} | {pooled:.5f} | {max(r['far'] for r in ok):.4f} | "
              f"{np.mean([r['far_public'] for r in ok]):.5f} | {np.mean([r['warm'] for r in ok]):.3f} | "
              f"{np.nanmean([r['tar'] for r in ok]):.3f} |")
    refusals = [r["refused"] for r in rows["far"] if "refused" in r]
    if refusals:
        print(f"\nrefused ({len(refusals)}), e.g.: {refusals[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
