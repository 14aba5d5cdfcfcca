"""fedfs_sdk.federation.secagg and its simulator import without torch (the ORT device has no torch)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_secagg_imports_without_torch():
    code = ("import sys, fedfs_sdk.federation.secagg, device_sim.secagg_sim\n"
            "bad = [m for m in ('torch', 'onnxruntime') if m in sys.modules]\n"
            "assert not bad, bad\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
