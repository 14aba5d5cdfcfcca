"""Rebuild ``fedfs_sdk/data/bch_generators.npz`` with galois and check the pinned hashes.

The SDK never builds BCH codes at run time (:mod:`fedfs_sdk.runtime.codes` loads this file); run
this only to regenerate or audit the data::

    python tools/regenerate_bch_data.py           # rebuild, refuse if a hash differs, write
    python tools/regenerate_bch_data.py --check   # rebuild and compare with the shipped file

A build whose generator does not hash to ``codes.GENERATOR_SHA256`` is refused: changing
the matrices would give every device other codewords than the ones already enrolled.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedfs_sdk.runtime import codes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = ap.parse_args(argv)
    built = {}
    for n in sorted(codes.KNOWN_CODES):
        print(f"building BCH({n},{codes.KNOWN_CODES[n]}) with galois …", flush=True)
        built[n] = codes.build_with_galois(n)
    arrays = codes.pack_generators(built)              # raises CodeError on a hash mismatch
    path = codes.data_path()
    if args.check:
        with np.load(path, allow_pickle=False) as shipped:
            same = set(shipped.files) == set(arrays) and all(np.array_equal(shipped[k], v) for k, v in arrays.items())
        print(f"{path}: {'matches' if same else 'DIFFERS FROM'} the galois build")
        return 0 if same else 1
    np.savez_compressed(path, **arrays)
    print(f"wrote {path} ({path.stat().st_size} bytes); hashes match the pins")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
