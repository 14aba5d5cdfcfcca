"""Shared fixtures. The BCH generator cache goes to a per-session temp dir unless the
user set FEDFS_CACHE_DIR (CI sets it so codes are built once per run)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("FEDFS_CACHE_DIR", str(ROOT / ".fedfs_cache"))

# Under pytest-xdist (.ci/run: one worker per core) each worker and the processes its tests start
# get an equal share of the cores as torch/OpenMP threads: N workers × all-core thread pools would
# oversubscribe the machine and spin. A user's own OMP_NUM_THREADS wins.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """In-process CLI runs (``--threads 1``) set torch's global thread count; restore it so a
    later test's float rounding does not depend on which tests ran before it."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)
