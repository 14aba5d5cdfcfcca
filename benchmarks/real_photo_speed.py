"""`fedfs simulate --data DIR` (no flag) before / after issue 31: wall time cold and warm, the table, FTA.

    git worktree add /tmp/before dc7a663        # the code before issue 31, outside the repo
    python benchmarks/make_hard_faces.py --src ../shared/data/yalefaces --src ../shared/data/lfw --out /tmp/hard_faces
    python benchmarks/real_photo_speed.py --before /tmp/before --data ../shared/data/lfw \\
        --data ../shared/data/yalefaces --data /tmp/hard_faces --work /tmp/rps

For each ``--data`` folder it runs the command line a new user types, ``fedfs simulate --data
DIR`` with no other flag (``--threads`` aside, when given), as separate processes:

* **before**: the tree at ``--before`` (``PYTHONPATH``), its own cache directory — it keeps no
  faces, so its cold and warm runs are the same;
* **after cold**: this tree, an empty face cache (``FEDFS_CACHE_DIR`` fresh);
* **after warm**: this tree again, the face cache of the cold run.

Then one table per folder: wall seconds (``time.perf_counter`` around the process), photos
with no usable face (failure-to-acquire, from each run's skipped files), and each method's
template AUROC with the after − before difference. A finished run is kept under ``--work``
(``--redo`` runs it again), so the table can be printed again without rerunning. Timings on
a shared machine are noisy: the runs of one folder follow each other, and the load average
at each start and the CPU seconds of each run (its process and face workers: less sensitive to
the other users than wall time) are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(tree: Path, data: str, out: Path, cache: Path, threads: int | None, redo: bool,
        report_only: bool = False, extra: list[str] | None = None) -> dict | None:
    done = out / "bench.json"
    if done.is_file() and not redo:
        return json.loads(done.read_text())
    if report_only:
        return None
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "FEDFS_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-c", "import sys; from fedfs_sdk.cli.main import main; sys.exit(main())",
           "simulate", "--data", data, "--out", str(out / "run")] + (["--threads", str(threads)] if threads else []) \
        + list(extra or [])
    load = os.getloadavg()[0]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)     # the run and its face workers
    (out / "stdout.txt").write_text(p.stdout)
    (out / "stderr.txt").write_text(p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}); see {out}/stderr.txt:\n{p.stderr[-2000:]}")
    res = json.loads((out / "run" / "results.json").read_text())
    skipped = (res.get("skipped") or {}).get("files") or []
    no_face = sum("no face" in s["reason"] for s in skipped)
    photos = sum(1 for d in Path(data).iterdir() if d.is_dir() for f in d.iterdir() if f.is_file())
    rec = {"command": cmd[3:], "tree": str(tree), "wall_s": wall, "cpu_s": cpu, "load_at_start": load, "photos": photos, "no_face": no_face,
           "fta": no_face / photos if photos else 0.0,
           "auroc": {m["label"]: m["eval"]["verification"]["auroc"]["mean"] for m in res["methods"]},
           "timing": res.get("timing"), "faces": (res.get("faces") or {}).get("line"),
           "table_tail": p.stdout.strip().splitlines()[-3:]}
    done.write_text(json.dumps(rec, indent=1))
    return rec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", action="append", required=True)
    p.add_argument("--before", default=None, help="a worktree of the code before (e.g. dc7a663); omit to skip")
    p.add_argument("--work", default="/tmp/real_photo_speed")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", choices=["before", "after"], default=None)
    p.add_argument("--redo", action="store_true")
    p.add_argument("--after", default=str(REPO), help="the tree of the 'after' runs (default: this one)")
    p.add_argument("--args", default="", help="more simulate flags for every run, e.g. '--clients 30 --rounds 3' "
                                              "(a reduced run where the whole folder takes too long)")
    p.add_argument("--faces-from", default=None,
                   help="a face cache folder (…/faces) copied into every run's cache first: the runs then "
                        "detect nothing, and 'after cold' is 'after, faces cached' (ξ's trunk features still cold)")
    p.add_argument("--report-only", action="store_true", help="print the finished runs under --work, run nothing")
    a = p.parse_args()
    work, after, extra = Path(a.work), Path(a.after), a.args.split()
    for data in a.data:
        name = Path(data).name
        rows = []
        seeded = a.faces_from is not None

        def seed(cache: Path) -> None:
            if seeded and not a.report_only and not (cache / "faces").exists():
                shutil.copytree(a.faces_from, cache / "faces")

        if a.before and a.only != "after":
            seed(work / "cache-before")
            rows.append(("before", run(Path(a.before), data, work / name / "before", work / "cache-before",
                                       a.threads, a.redo, a.report_only, extra)))
        if a.only != "before":
            cache = work / f"cache-after-{name}"
            if not a.report_only and (a.redo or not (work / name / "after-cold" / "bench.json").is_file()):
                shutil.rmtree(cache, ignore_errors=True)
            seed(cache)
            rows.append(("after, faces cached" if seeded else "after cold",
                         run(after, data, work / name / "after-cold", cache, a.threads, a.redo, a.report_only,
                             extra)))
            rows.append(("after warm", run(after, data, work / name / "after-warm", cache, a.threads, a.redo,
                                           a.report_only, extra)))
        rows = [(label, r) for label, r in rows if r is not None]
        if not rows:
            print(f"\n## {data}: no finished run under {work}")
            continue
        methods = list(rows[0][1]["auroc"])
        base = dict(rows).get("before")
        flags = " ".join(extra) if extra else "(no flag)"
        print(f"\n## fedfs simulate --data {data} {flags}; {os.cpu_count()} cores, shared: timings are noisy")
        print("| run | wall s | CPU s | load avg at start | no face / photos (FTA) | " + " | ".join(f"AUROC {m}" for m in methods) + " |")
        print("|---|---|---|---|---|" + "---|" * len(methods))
        for label, r in rows:
            cells = []
            for m in methods:
                v = r["auroc"].get(m, float("nan"))
                d = f" ({v - base['auroc'][m]:+.4f})" if base and label != "before" and m in base["auroc"] else ""
                cells.append(f"{v:.4f}{d}")
            print(f"| {label} | {r['wall_s']:.0f} | {r.get('cpu_s', float('nan')):.0f} | {r['load_at_start']:.1f} | {r['no_face']} / {r['photos']} "
                  f"({r['fta']:.1%}) | " + " | ".join(cells) + " |")
        for label, r in rows:
            if r.get("faces"):
                print(f"{label}: {r['faces']}")
            if r.get("timing"):
                print(f"{label}: {r['table_tail'][-2]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
