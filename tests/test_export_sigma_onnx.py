"""The FedUV σ in the ONNX fp32 and int8 exports when ‖W g‖² ≫ 65504 (issue 13, defect 2):
both give torch's accept/reject decisions (``export.parity``: owner codeword, warm-up τ with
each backend's own scores)."""
from __future__ import annotations

import numpy as np
import onnx
import torch

from export.onnx_inference import export_onnx
from export.parity import decide, disagreements, owner_codeword
from export.quantize import quantize_int8
from fedfs_sdk.runtime.onnx_backend import OnnxBackend

from conftest_export import faces
from test_export_coreml_numerics import C, data, huge_head_verifier


def test_onnx_fp32_and_int8_keep_torch_decisions_with_a_huge_head(tmp_path) -> None:
    x, _ = data()
    v = huge_head_verifier()
    with torch.no_grad():
        want = v(torch.from_numpy(x))[1].numpy()
    fp32 = export_onnx(v, tmp_path / "v.onnx")
    ops = {n.op_type for n in onnx.load(str(fp32)).graph.node}
    assert {"Abs", "ReduceSum", "Sqrt", "Div"} <= ops                   # σ from primitives, scaled first
    int8 = tmp_path / "v.int8.onnx"
    quantize_int8(fp32, int8, faces(16, 4, seed=13)[0], calibration_source="test faces")   # same kind of images
    warm, gen, imp = slice(0, 10), slice(10, 30), slice(30, 50)
    code = owner_codeword(want[warm])
    ref = decide(want[warm], want[gen], want[imp], code)
    # int8: the tiny backbone's quantization noise (measured 0.05-0.07), not σ — σ runs in fp32 there
    scores = want @ code / C
    for path, bound in ((fp32, 1e-5), (int8, 0.1)):
        got = OnnxBackend(path).run(x)["uv"]
        assert np.allclose(np.linalg.norm(got, axis=1), np.sqrt(C), rtol=1e-4), path
        change = np.linalg.norm(got - want, axis=1).max() / np.sqrt(C)          # bounds |Δscore|
        assert change < bound, path
        d = decide(got[warm], got[gen], got[imp], code)
        if path == fp32:
            assert disagreements(ref, d) == 0
            continue
        # int8 decides like torch wherever rounding cannot reach τ: a flip is allowed only for a
        # probe whose torch score is within |Δscore| + |Δτ| of τ (measured: 2 probes 0.002 and
        # 0.012 from τ flip when τ moves by 0.01; export.score_bounds)
        flips = np.concatenate([ref.genuine != d.genuine, ref.impostor != d.impostor])
        near = np.abs(np.concatenate([scores[gen], scores[imp]]) - ref.tau) <= change + abs(d.tau - ref.tau)
        assert not (flips & ~near).any(), path
        assert flips.sum() <= 0.1 * flips.size, path
