"""Method registry, options, codewords and ℓ_neg negatives, verifier specs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest_sim import setup_method, xi  # noqa: F401
from device_sim.methods import REGISTRY, parse_method, register
from fedfs_sdk.runtime.codes import DESIGN_DISTANCE
from fedfs_sdk.errors import InputError


def test_parse_specs_and_errors() -> None:
    m = parse_method("feduv:c=511,neg=early,neg_rounds=3,lambda_neg=0.5")
    assert (m.code_length, m.neg, m.neg_rounds, m.lambda_neg) == (511, "early", 3, 0.5)
    assert m.label == "feduv (c=511, ℓ_neg≤r3)"
    assert [m.lambda_neg_at(r) for r in (1, 3, 4)] == [0.5, 0.5, 0.0]
    assert parse_method("fedfs").label == "fedfs"
    with pytest.raises(InputError, match="unknown method"):
        parse_method("fedprox")
    with pytest.raises(InputError, match="no option"):
        parse_method("feduv:k=3")
    with pytest.raises(InputError, match="unknown preset 'c'"):    # a bare word names a preset
        parse_method("feduv:c")
    with pytest.raises(InputError, match="key=value"):
        parse_method("oracle:c")
    with pytest.raises(InputError, match="code_length"):
        parse_method("feduv:c=100")
    with pytest.raises(InputError, match="FedUV term"):
        parse_method("fedfs:neg=all")
    with pytest.raises(InputError, match="already registered"):
        register("fedfs", REGISTRY["fedfs"])


def test_codewords_are_deterministic_unique_and_far_apart(xi) -> None:
    m = setup_method("feduv:c=127", xi, num_clients=20)
    v = np.stack([m.codeword(c) for c in range(20)])
    again = setup_method("feduv:c=127", xi, num_clients=20)
    assert np.array_equal(v, np.stack([again.codeword(c) for c in range(20)]))
    assert set(np.unique(v).tolist()) == {-1, 1}
    ham = (v[:, None, :] != v[None, :, :]).sum(-1)
    assert ham[~np.eye(20, dtype=bool)].min() >= DESIGN_DISTANCE[127]     # BCH d_min (FedUV Table 1)
    other_seed = setup_method("feduv:c=127", xi, num_clients=20, seed=1)
    assert not np.array_equal(v[0], other_seed.codeword(0))                 # r_u differs


def test_neg_codewords_are_other_participants(xi) -> None:
    m = setup_method("feduv:neg=all,neg_samples=3", xi, num_clients=10)
    plan = m.configure_round(1, np.array([1, 4, 6, 8, 9]))
    c = m.client_consts(plan, m.client_state_init(4))
    neg = c["neg_codewords"].numpy().astype(np.int8)
    assert neg.shape == (3, 127)
    own = m.codeword(4)
    others = {tuple(m.codeword(u)) for u in (1, 6, 8, 9)}
    assert all(tuple(row) in others for row in neg) and tuple(own) not in {tuple(r) for r in neg}
    lone = m.client_consts(m.configure_round(1, np.array([4])), m.client_state_init(4))
    assert lone["neg_codewords"].shape == (3, 127)                          # random codewords instead
    no_neg = setup_method("feduv:neg=early,neg_rounds=1", xi)
    assert "neg_codewords" not in no_neg.client_consts(no_neg.configure_round(2, np.array([0, 1])),
                                                      no_neg.client_state_init(0))


def test_verifier_specs(xi) -> None:
    gw = {}
    for spec, mode, shared, head in [("pretrained", "template", "xi", False), ("fedfs", "template", None, False),
                                     ("feduv", "codeword", "global", True),
                                     ("fedfs+feduv:paper", "codeword", None, True),
                                     ("fedfs+feduv:paper,verify=global", "codeword", "global", True),
                                     ("fedfs+feduv", "template", None, True)]:    # default: head-space, both models
        m = setup_method(spec, xi)
        gw = m.init_global()
        priv = m.init_private(gw) or None
        v = m.verifier(m.client_state_init(3), gw, priv)
        assert (v.mode, v.shared_key, v.net.uv_head is not None) == (mode, shared, head), spec
        v.net.load_state_dict(v.weights, strict=True)                        # names match the skeleton
        out = v.net(torch.zeros(2, 3, 32, 32))
        assert out[0].shape == ((2, 2 * 127) if spec == "fedfs+feduv" else (2, 16))   # unit(W q') ⊕ unit(W r')
        nu = m.new_user_verifier(m.client_state_init(99), gw)
        assert nu.shared_key in ("global", "xi")
        if spec in ("fedfs", "fedfs+feduv:paper"):
            # never trained: the current global backbone (the θ_c it would start from), not θ_0
            later = {k: t + 0.5 for k, t in gw.items()}
            nt, nu_later = m.verifier(m.client_state_init(3), later, None), m.new_user_verifier(m.client_state_init(3), later)
            assert nt.shared_key == "global" and nt.net is nu_later.net and nt.mode == mode
            assert set(nt.weights) == set(nu_later.weights)
            assert all(torch.equal(nt.weights[k], later[k]) for k in nt.weights)
    # verify=global scores σ(W r') with the shared model only: θ_c does not enter.
    m = setup_method("fedfs+feduv:verify=global", xi)
    gw = m.init_global()
    priv = {g: {k: t + 1.0 for k, t in ws.items()} for g, ws in (m.init_private(gw) or {}).items()}
    v = m.verifier(m.client_state_init(3), gw, priv)
    assert all(torch.equal(v.weights[k], gw[k]) for k in v.weights) and "uv_head.weight" in v.weights
    assert m.label == "fedfs+feduv (c=127, verify=global)"
    with pytest.raises(InputError, match=r"fedfs\+feduv option"):
        parse_method("feduv:verify=global")
    with pytest.raises(InputError, match="'personal', 'global' or 'both'"):
        parse_method("fedfs+feduv:verify=all")


def test_fedfs_projection_matches_xi(xi) -> None:
    m = setup_method("fedfs", xi)
    assert m.model_config.proj_dim == 8 and m.model_config.code_length is None      # z = r ⊕ q has dim v = 16
    assert m.private_groups == ("personal",) and setup_method("feduv", xi).private_groups == ()
