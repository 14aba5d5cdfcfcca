"""Where the real test assets are (``shared/``: LFW, third-party face models; never committed).

``shared/`` sits beside the repository (``ROOT.parent / "shared"``, as in CI and the main
checkout); ``FEDFS_SHARED_DIR`` points elsewhere (e.g. from a git worktree). Tests that use it
skip cleanly where it is absent."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FEDFS_SHARED_DIR") or ROOT.parent / "shared")
LFW = SHARED / "data" / "lfw"
MODELS = SHARED / "models"
