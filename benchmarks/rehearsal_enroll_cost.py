"""Per-device CPU of an enrollment's public-impostor scoring, with and without the shared outputs of
fedfs_sdk/runtime/impostor_outputs.PUBLIC_OUTPUTS, on one device folder a rehearsal left:

    PYTHONPATH=. python benchmarks/rehearsal_enroll_cost.py OUT/fleet/client_00000

Prints the thread CPU of enrolling with ξ (scoring the set itself), of filling the shared entry and of
enrolling from it, and whether the operating point and τ are the same."""
import time, sys, glob
import numpy as np, torch
torch.set_num_threads(1)
from threadpoolctl import threadpool_limits
threadpool_limits(1, user_api="blas")
from fedfs_sdk.nn.checkpoint import load_verifier
from fedfs_sdk.runtime.inference import TorchBackend
from fedfs_sdk.runtime.impostors import load_impostors
from fedfs_sdk.runtime.enrollment import enroll
from fedfs_sdk.runtime.impostor_outputs import PublicOutputs
from fedfs_sdk.runtime.preprocess import preprocess
d = sys.argv[1]
net, mid = load_verifier(f"{d}/state/xi.safetensors")
b = TorchBackend(net, mid)
imp = load_impostors(f"{d}/state/impostors.npz")
photos = sorted(glob.glob(f"{d}/photos/*.png"))
x = preprocess(photos, b.input_size)
def cpu(f):
    c0, t0 = time.thread_time(), time.perf_counter(); r = f(); return r, time.thread_time() - c0, time.perf_counter() - t0
old, c_old, w_old = cpu(lambda: enroll(b, x, q=0.9, outliers="none", impostors=imp))
cache = PublicOutputs()
_, c_fill, w_fill = cpu(lambda: cache.get(b, imp))
new, c_new, w_new = cpu(lambda: enroll(b, x, q=0.9, outliers="none", impostors=imp, impostor_outputs=cache.get(b, imp)))
print(f"{len(photos)} photos, {len(imp)} impostors")
print(f"enroll, scoring the set itself: {c_old:.2f} s CPU ({w_old:.2f} s wall)")
print(f"filling the shared entry once:  {c_fill:.2f} s CPU ({w_fill:.2f} s wall)")
print(f"enroll from the shared entry:   {c_new:.2f} s CPU ({w_new:.2f} s wall)")
print("same operating point:", old.meta["operating_point"] == new.meta["operating_point"], "same τ:", old.threshold == new.threshold)
