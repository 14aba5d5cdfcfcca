"""A phone's enrollment on the ONNX runtime from its export's trunk and top graphs
(:meth:`fedfs_sdk.federation.ort_runtime.OrtRuntime.impostor_outputs`, ``.far_evidence``):

* the public impostor set's outputs of every verifier a device can enroll (ξ, the global model with its
  FedUV head, the dual verifier of θ_c) computed as ξ's trunk features once + each verifier's top equal
  the full ONNX forward — so ``enroll`` no longer runs the whole verifier (twice the trunk for the dual)
  over the set; a verifier off ξ's trunk gets None (the full forward runs);
* ``enroll(far=…)`` from a published statistics sum (``xi.features`` + ``xi.tail``) on the ONNX runtime
  gives the torch device's evidence and τ for the same weights — before this, the ONNX runtime refused.

Tolerance: ORT and torch agree to float32 rounding (scores ≤ 1e-5), so draws' outputs within 1e-4,
thresholds within 1e-4 and ``z*`` within one histogram bin's worth (it is read from the same bins)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest_export import TINY, TMP, checkpoints, tiny_weights
from fedfs_sdk.nn.checkpoint import save_checkpoint
from fedfs_sdk.nn.model import FaceNet
from fedfs_sdk.training.top_keys import is_top_key
from test_ort_in_domain import _agents, _trained_like

METHOD, VERIFY = "fedfs+feduv", "both"


def _model_and_agents(tmp_path, off_trunk: bool = False):
    g = FaceNet(TINY)
    g.load_state_dict(_trained_like(tiny_weights(), 1))
    model_file = TMP / "enroll-far-global.safetensors"
    save_checkpoint(model_file, g, TINY, {"round": 3})
    personal = _trained_like({k: v for k, v in g.state_dict().items() if not k.startswith("uv_head.")}, 2, 0.2)
    if off_trunk:        # θ_c whose trunk trained (scope=all): not on ξ's trunk
        key = next(k for k in personal if k.startswith("backbone.") and not is_top_key(k) and personal[k].is_floating_point())
        personal[key] = personal[key] + 0.01
    return model_file.read_bytes(), _agents(tmp_path, personal)


def _public(input_size: int):
    from test_operating_point import _impostor_set

    return _impostor_set(input_size, 20, 4)          # 80 photos of 20 public people


def _xi_sha() -> str:
    from fedfs_sdk.federation.wire_format import sha256_hex

    return sha256_hex(checkpoints()["xi"].read_bytes())


@pytest.mark.parametrize("candidate", ["xi", "global", "personalized"])
def test_public_set_outputs_from_the_trunk_equal_the_full_forward(tmp_path, candidate) -> None:
    from fedfs_sdk.runtime.impostor_outputs import impostor_outputs

    model, agents = _model_and_agents(tmp_path)
    agent = agents["ort"]
    backend = agent.runtime.verifier(METHOD, model, agent, 3, VERIFY, candidate=candidate)
    pub = _public(backend.input_size)
    compute = agent.runtime.impostor_outputs(backend, pub, _xi_sha())
    assert compute is not None
    fast, full = compute(), impostor_outputs(backend, pub)
    assert len(fast) == len(full) >= 2                                   # the same chunks (64 photos each)
    for a, b in zip(fast, full):
        assert set(a) == set(b) == set(backend.outputs)
        for k in a:
            assert a[k].shape == b[k].shape and not a[k].flags.writeable
            np.testing.assert_allclose(a[k], b[k], atol=1e-4, rtol=0, err_msg=f"{candidate}: {k}")
    # the dual verifier's two halves and every candidate share one trunk pass of the set
    assert len([k for k in agent.runtime._features if k[0] == agent.runtime.artifacts()[0].trunk["sha256"]]) == 1


def test_a_verifier_off_xis_trunk_runs_the_full_forward(tmp_path) -> None:
    model, agents = _model_and_agents(tmp_path, off_trunk=True)
    agent = agents["ort"]
    backend = agent.runtime.verifier(METHOD, model, agent, 3, VERIFY, candidate="personalized")
    assert agent.runtime.impostor_outputs(backend, _public(backend.input_size), _xi_sha()) is None


def _stats_file(tmp_path, xi_file, pub) -> str:
    """A published sum of 12 devices' ``xi.features`` and ``xi.tail`` (ξ's trunk and top, torch)."""
    from fedfs_sdk.stats.evidence import xi_verifier
    from test_stats_tail import write_tail_stats

    write_tail_stats(tmp_path / "stats.json", xi_verifier(xi_file), pub, photos=30)
    return str(tmp_path / "stats.json")


@pytest.mark.parametrize("candidate", ["xi", "personalized"])
def test_far_evidence_on_the_onnx_runtime_is_the_torch_devices(tmp_path, candidate) -> None:
    from fedfs_sdk.federation.device_enrollment import far_evidence
    from fedfs_sdk.runtime.enrollment import enroll

    model, agents = _model_and_agents(tmp_path)
    xi_file = checkpoints()["xi"]
    backends = {n: a.runtime.verifier(METHOD, model, a, 3, VERIFY, candidate=candidate) for n, a in agents.items()}
    pub = _public(backends["ort"].input_size)
    stats = _stats_file(tmp_path, xi_file, pub)
    evidence = {}
    for name, agent in agents.items():
        agent.config = replace(agent.config, far=1e-2, far_stats=Path(stats))
        evidence[name] = far_evidence(agent, backends[name], agent.config.far_stats, pub, _xi_sha())
    t, o = evidence["torch"], evidence["ort"]
    assert set(o.draws) == set(backends["ort"].outputs) and set(t.draws) == set(backends["torch"].outputs)
    # (ξ on the ONNX runtime runs in the global model's verifier graph: it keeps the head's uv output)
    assert "embedding" in set(o.draws) & set(t.draws)
    for k in set(o.draws) & set(t.draws):
        np.testing.assert_allclose(o.draws[k], t.draws[k], atol=1e-4, rtol=0)
    np.testing.assert_allclose(o.tail_loc, t.tail_loc, atol=1e-4)
    np.testing.assert_allclose(o.tail_scale, t.tail_scale, atol=1e-4)
    assert o.z(1e-2) == pytest.approx(t.z(1e-2), abs=0.02)
    assert o.record["contributors"] == t.record["contributors"] == 12
    # enroll(far=1e-2) from it: the 80-photo public set cannot set 1e-2 by itself; the statistics do
    owner = [str(p) for p in agents["ort"].images]
    got = {n: enroll(backends[n], owner, q=0.5, far=1e-2, impostors=pub, in_domain=evidence[n]) for n in agents}
    assert got["ort"].meta["operating_point"]["far_evidence"] == "federation-statistics"
    assert got["ort"].threshold == pytest.approx(got["torch"].threshold, abs=1e-3)


def test_far_evidence_refuses_a_verifier_off_xis_trunk(tmp_path) -> None:
    from fedfs_sdk.errors import InputError

    model, agents = _model_and_agents(tmp_path, off_trunk=True)
    agent = agents["ort"]
    backend = agent.runtime.verifier(METHOD, model, agent, 3, VERIFY, candidate="personalized")
    pub = _public(backend.input_size)
    with pytest.raises(InputError, match="trunk is not ξ's"):
        agent.runtime.far_evidence(_stats_file(tmp_path, checkpoints()["xi"], pub), backend, checkpoints()["xi"],
                                   _xi_sha(), pub)
