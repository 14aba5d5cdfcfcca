"""The in-domain do-no-harm check on the ONNX runtime (:mod:`fedfs_sdk.federation.ort_check`): each
candidate (ξ, norm-adapt ξ, the global model through the head-template projection, the personalized
model through the dual verifier) scored from the export's trunk and top graphs gives the torch device's
check (:func:`fedfs_sdk.federation.device_stats.in_domain_check`) on the same photos, model, θ_c and
drawn impostor features — and a candidate whose trunk is not ξ's is refused, not scored.

Tolerance: scores agree to float32 rounding (≤ 1e-5), so AUROC, margin and threshold within 1e-4 and
the TAR within one genuine photo's weight only where a score sits on the threshold (never here)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest_export import TINY, TMP, checkpoints, tiny_weights, top_export
from conftest_server import write_images
from fedfs_sdk.errors import InputError
from fedfs_sdk.nn.checkpoint import load_checkpoint, save_checkpoint
from fedfs_sdk.nn.model import FaceNet
from fedfs_sdk.training.top_keys import is_top_key

METHOD, VERIFY, SCORE = "fedfs+feduv", "both", "head-template"     # the method's defaults


def _trained_like(weights: dict, seed: int, scale: float = 0.05) -> dict:
    """``weights`` with the top moved as a round of scope=top training moves it (the trunk kept)."""
    g = torch.Generator().manual_seed(seed)
    return {k: (v + scale * torch.randn(v.shape, generator=g) * v.abs().mean().clamp_min(1e-3)
                if is_top_key(k) and v.is_floating_point() else v.clone()) for k, v in weights.items()}


def _agents(tmp_path, personal: dict):
    from fedfs_sdk.federation.agent import DeviceAgent
    from fedfs_sdk.federation.device_config import DeviceConfig
    from fedfs_sdk.federation.device_runtime import TorchRuntime
    from fedfs_sdk.federation.ort_runtime import OrtRuntime
    from fedfs_sdk.federation.device_state import DeviceState
    from fedfs_sdk.federation.server_client import ServerClient
    from fedfs_sdk.federation.wire import encode_weights

    out, _ = top_export()
    images = [str(p) for p in write_images(tmp_path / "img", 10, seed=11)]
    agents = {}
    for name, runtime in (("torch", TorchRuntime("cpu")), ("ort", OrtRuntime(out))):
        state = DeviceState(tmp_path / name)
        state.save_weights_bytes("personal", encode_weights(personal))
        cfg = DeviceConfig(xi_path=checkpoints()["xi"], enroll=True, artifacts=out if name == "ort" else None)
        agents[name] = DeviceAgent(ServerClient("http://127.0.0.1:9"), state, images, cfg, runtime=runtime)
    return agents


def test_ort_candidates_check_like_the_torch_device(tmp_path) -> None:
    from fedfs_sdk.federation.device_stats import in_domain_check
    from fedfs_sdk.federation.wire_format import sha256_hex
    from fedfs_sdk.stats import embedding_moments

    g = FaceNet(TINY)
    g.load_state_dict(_trained_like(tiny_weights(), 1))
    model_file = TMP / "in-domain-global.safetensors"
    save_checkpoint(model_file, g, TINY, {"round": 3})
    model = model_file.read_bytes()
    personal = _trained_like({k: v for k, v in g.state_dict().items() if not k.startswith("uv_head.")}, 2, 0.2)
    agents = _agents(tmp_path, personal)
    xi_file = checkpoints()["xi"]
    xi_net = load_checkpoint(xi_file)[0].eval()
    rng = np.random.default_rng(5)
    embedding_sum = embedding_moments(rng.normal(0.1, 0.8, (40, 64)).astype(np.float32))
    drawn = rng.normal(0, 1, (600, 64)).astype(np.float32) * np.float32(0.5)
    train, hold = agents["torch"].holdout_split()
    assert len(hold) >= 2
    for a in agents.values():
        a.stats_embedding_sum = embedding_sum
    xi_sha = sha256_hex(xi_file.read_bytes())
    for name in ("xi", "norm-adapt", "global", "personalized"):
        ref = in_domain_check(agents["torch"], name, METHOD, model, 3, VERIFY, drawn, xi_net, train, hold, SCORE)
        got = agents["ort"].runtime.in_domain_check(agents["ort"], name, METHOD, model, VERIFY, SCORE, drawn, train,
                                                    hold, xi_file, xi_sha, embedding_sum)
        assert (got.name, got.n_genuine, got.n_impostor) == (ref.name, ref.n_genuine, ref.n_impostor) == \
            (name, len(hold), len(drawn))
        for field in ("auroc", "margin", "threshold", "tar"):
            assert getattr(got, field) == pytest.approx(getattr(ref, field), abs=1e-4), (name, field)
    # … and in a process that cannot import torch, as on a phone (norm-adapt and the dual verifier)
    import json as _json

    from conftest_export import run_device_script

    np.savez(tmp_path / "inputs.npz", drawn=drawn, train=train, hold=hold, embedding_sum=embedding_sum)
    code = f"""
import json, numpy as np
from pathlib import Path
from fedfs_sdk.federation.agent import DeviceAgent
from fedfs_sdk.federation.device_config import DeviceConfig
from fedfs_sdk.federation.device_state import DeviceState
from fedfs_sdk.federation.ort_runtime import OrtRuntime
from fedfs_sdk.federation.server_client import ServerClient
z = np.load({str(tmp_path / 'inputs.npz')!r})
rt = OrtRuntime({str(top_export()[0])!r})
state = DeviceState(Path({str(tmp_path / 'phone')!r}))        # the same θ_c, in a state of its own
state.save_weights_bytes("personal", Path({str(tmp_path / 'ort' / 'personal.safetensors')!r}).read_bytes())
agent = DeviceAgent(ServerClient("http://127.0.0.1:9"), state,
                    {[str(p) for p in agents['ort'].images]!r},
                    DeviceConfig(xi_path=Path({str(xi_file)!r}), enroll=True, artifacts=rt.root), runtime=rt)
out = {{}}
for name in ("norm-adapt", "personalized"):
    c = rt.in_domain_check(agent, name, {METHOD!r}, Path({str(model_file)!r}).read_bytes(), {VERIFY!r}, {SCORE!r},
                           z["drawn"], z["train"], z["hold"], Path({str(xi_file)!r}), {xi_sha!r}, z["embedding_sum"])
    out[name] = c.to_dict()
print(json.dumps(out))
"""
    no_torch = _json.loads(run_device_script(code).strip().splitlines()[-1])
    for name, ck in no_torch.items():
        ref = agents["ort"].runtime.in_domain_check(agents["ort"], name, METHOD, model, VERIFY, SCORE, drawn, train,
                                                    hold, xi_file, xi_sha, embedding_sum)
        assert ck == pytest.approx(ref.to_dict(), abs=1e-6), name
    # the candidates differ (the comparison is not between four copies of one verifier)
    aurocs = {n: agents["ort"].runtime.in_domain_check(agents["ort"], n, METHOD, model, VERIFY, SCORE, drawn, train,
                                                       hold, xi_file, xi_sha, embedding_sum).threshold
              for n in ("xi", "global", "personalized")}
    assert len({round(v, 6) for v in aurocs.values()}) == 3, aurocs


def test_a_candidate_off_xis_trunk_is_refused(tmp_path) -> None:
    from fedfs_sdk.federation.wire_format import sha256_hex

    weights = dict(tiny_weights())
    key = next(k for k in weights if k.startswith("backbone.") and not is_top_key(k))
    weights[key] = weights[key] + 0.01                      # a global model whose trunk trained (scope=all)
    g = FaceNet(TINY)
    g.load_state_dict(weights)
    model_file = TMP / "off-trunk.safetensors"
    save_checkpoint(model_file, g, TINY, {"round": 3})
    agents = _agents(tmp_path, {k: v for k, v in weights.items() if not k.startswith("uv_head.")})
    xi_file = checkpoints()["xi"]
    train, hold = agents["ort"].holdout_split()
    with pytest.raises(InputError, match="does not run on ξ's trunk"):
        agents["ort"].runtime.in_domain_check(agents["ort"], "global", METHOD, model_file.read_bytes(), VERIFY, SCORE,
                                              np.zeros((10, 64), np.float32), train, hold, xi_file,
                                              sha256_hex(xi_file.read_bytes()), None)
