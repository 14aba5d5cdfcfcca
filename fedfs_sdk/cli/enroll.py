"""``fedfs enroll``: warm-up enrollment of the device owner (FedUV Alg. 2)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from .common import env_default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="verifier: a fedfs .safetensors checkpoint, an exported .onnx, "
                   "a built-in model's name (dlib-resnet: dlib's face recognizer, the 'faces' extra; it cuts dlib's "
                   "face chip itself), or "
                   "a simulation checkpoint (fedfs simulate … --checkpoint-every K: "
                   "DIR/checkpoints/<method>/round_N.safetensors; its global model, or --client N's)")
    p.add_argument("--client", type=int, default=None,
                   help="with a simulation checkpoint: enroll with simulated client N's personalized verifier "
                        "(results.json 'clients'[N] names its identity); default: the global model")
    p.add_argument("--images", required=True, help="folder of the owner's warm-up images")
    p.add_argument("--out", required=True, help="enrollment file to write (encrypted)")
    p.add_argument("--key-file", default=env_default("FEDFS_KEY_FILE"), required=env_default("FEDFS_KEY_FILE") is None,
                   help="32-byte AES key; created (0600) after a successful enrollment if missing "
                        "(default: $FEDFS_KEY_FILE)")
    p.add_argument("--q", type=float, default=0.9, help="target true-positive rate (default 0.9)")
    p.add_argument("--device-state", default=None,
                   help="device state dir holding the FedUV codeword (codeword mode); template mode without it")
    p.add_argument("--template-output", choices=("embedding", "uv"), default="embedding",
                   help="template mode only: build the template on the backbone embedding (default) or on the "
                        "FedUV head output 'uv' (a cosine template in the head space W·g — the head-template "
                        "scoring measured in docs/personalization.md; needs a model with a FedUV head)")
    p.add_argument("--detect-face", action="store_true", help="align the largest face to the 112×112 five-point template (dlib, the 'faces' extra; falls back to an OpenCV Haar crop without it)")
    p.add_argument("--far", type=float, default=None,
                   help="target false-accept rate (e.g. 1e-3): τ is set so that at most ⌊far·(n+1)⌋−1 of the n public "
                        "impostor photos pass (needs --impostors with ≥ ⌈1/far⌉−1 photos); refused when the warm-up "
                        "then accepts fewer than q of the owner's photos; with --far-stats and a public set too small "
                        "for the target, τ is set in the federation's conditions instead")
    p.add_argument("--far-stats", default=None, metavar="FILE",
                   help="a statistics round's published sum (xi.features and xi.tail, GET /v1/stats): with --far, τ "
                        "is predicted in the federation's capture conditions (docs/personalization.md; a torch model "
                        "whose trunk is ξ's, and --impostors: the public set of the round's tail directions)")
    p.add_argument("--tail-model", default=None, help="with --far-stats: the model the round's tail histograms were "
                   "computed with — ξ for xi.tail (default: --model itself; its trunk must be --model's)")
    p.add_argument("--far-evidence", choices=("auto", "public", "federation"), default="auto",
                   help="which evidence sets τ for --far: 'auto' (default) the public set when it holds ≥ ⌈1/far⌉−1 "
                        "photos, else --far-stats; 'public'; 'federation'")
    p.add_argument("--impostors", default=None,
                   help="public impostor set (`fedfs impostors --out FILE`): the operating point's FAR is measured on "
                        "it (and set with --far)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing enrollment")
    p.add_argument("--outliers", choices=("mad", "none"), default="mad",
                   help="drop warm-up images whose score is far below the others (e.g. someone else's photo) "
                        "before the threshold is set: 'mad' (default; robust z-score, k=3.5) or 'none'")


def outlier_lines(rule: str, dropped: list[dict], n_given: int, kept: Sequence[dict] = (),
                  min_warmup: int | None = None) -> list[str]:
    """What outlier rejection did, for the user: the rule, the dropped images, and the flagged
    images the warm-up floor kept (one line each). ``rule``/``dropped``/``n_given``/``kept``/
    ``min_warmup`` are an enrollment's ``meta["outlier_rule"]``, ``meta["dropped"]``,
    ``meta["n_given"]``, ``meta["kept_at_floor"]`` and ``meta["min_warmup"]``."""
    lines = [f"outlier rule: {rule}"]
    if dropped:
        names = ", ".join(d.get("file", f"#{d['index']}") for d in dropped)
        lines.append(f"dropped {len(dropped)} of {n_given} warm-up images as outliers (not the owner?): {names}")
    if kept:
        names = ", ".join(d.get("file", f"#{d['index']}") for d in kept)
        lines.append(f"kept {len(kept)} warm-up image(s) the rule flags as outliers, so that "
                     f"{min_warmup if min_warmup is not None else 'the minimum of'} remain for q "
                     f"(they may lower τ): {names} — add photos of the owner, or remove these if they are not the owner")
    return lines


def _codeword(state_dir: str, key: bytes | None):
    """The FedUV codeword of a device state, opened read-only (a typo creates nothing). Its
    secrets are encrypted under the device's key: the given key file's, else the state's own
    ``enrollment.key``."""
    from ..federation.device_state import DeviceKeyError, DeviceState

    with DeviceState(state_dir, read_only=True, key=key) as st:
        try:
            return st.load_codeword()
        except DeviceKeyError:
            if key is None or not st.file("enrollment.key").is_file():
                raise
    with DeviceState(state_dir, read_only=True) as st:     # the device ran without --key-file
        return st.load_codeword()


def run(args: argparse.Namespace) -> int:
    from ..runtime.enrollment import enroll, save_enrollment
    from ..errors import EnrollmentExistsError, InputError
    from ..runtime.operating_point import describe
    from ..runtime.preprocess import list_images
    from .common import load_backend, read_key

    key_path = Path(args.key_file)
    # An existing key is checked now; a new one is created only once the enrollment succeeded,
    # so a failed `fedfs enroll` leaves no key file behind.
    key = read_key(args.key_file, create=False) if key_path.exists() else None
    if Path(args.out).exists() and not args.overwrite:
        raise EnrollmentExistsError(f"{args.out} already holds an enrollment; pass --overwrite to replace it")
    backend = load_backend(args.model, client=args.client)
    codeword = _codeword(args.device_state, key) if args.device_state else None
    files = list_images(args.images)
    impostors = None
    if args.impostors:
        from ..runtime.impostors import load_impostors
        impostors = load_impostors(args.impostors)
    elif args.far is not None:
        raise InputError("--far needs a public impostor set to set τ on: pass --impostors FILE "
                         "(make one with `fedfs impostors --images DIR --model MODEL --out FILE`; with --far-stats it "
                         "is the set the statistics round's tail directions came from)")
    in_domain = None
    if args.far_stats is not None:
        if args.far is None:
            raise InputError("--far-stats sets τ for a false-accept target: give --far too")
        from ..stats.evidence import evidence_for_backend
        xi = backend if args.tail_model is None else load_backend(args.tail_model)
        in_domain = evidence_for_backend(args.far_stats, backend, xi, impostors)
    from ..nn.builtin_models import builtin_name

    recorded = builtin_name(args.model) or str(Path(args.model).resolve())    # a built-in model by name
    e = enroll(backend, [str(f) for f in files], q=args.q, codeword=codeword, detect_face=args.detect_face,
               meta={"model_path": recorded,
                     **({"model_client": args.client} if args.client is not None else {})}, outliers=args.outliers,
               template_output=args.template_output, far=args.far, impostors=impostors, in_domain=in_domain,
               far_evidence=args.far_evidence)
    created = key is None
    if created:
        key = read_key(args.key_file, create=True)
    try:
        save_enrollment(args.out, e, key, overwrite=args.overwrite)
    except BaseException:
        if created:
            key_path.unlink(missing_ok=True)
        raise
    for line in outlier_lines(e.meta["outlier_rule"], e.meta["dropped"], e.meta["n_given"],
                              e.meta.get("kept_at_floor", ()), e.meta.get("min_warmup")):
        print(line)
    mode = e.mode if e.mode == "codeword" else f"template on {e.template_output}"
    print(f"enrolled from {e.n_warmup} images: mode={mode} τ={e.threshold:.4f} (q={e.q}) model={e.model_id} → {args.out}")
    print(describe(e.meta))
    return 0
