"""The compiled folded trunk (device_sim/executors/compiled.py, issue 32 item 1): inductor gives the
eager updates within float rounding on CPU, a failed compilation falls back to eager and says why,
and ``auto`` chooses as documented. The GPU form of the equality is in test_sim_executor_paths.py's
gpu tests' neighbour below (marked ``gpu``)."""
from __future__ import annotations

import pytest
import torch

from conftest_sim import RandomClients, make_tasks, max_diff, setup_method, xi  # noqa: F401
from device_sim.executors import BatchedExecutor, LocalConfig, SequentialExecutor, make_executor
from device_sim.executors.compiled import TrunkCall, compile_choice
from device_sim.executors.folding import fold_module
from fedfs_sdk.errors import InputError

SPEC = "fedfs+feduv:scope=all"      # every layer trained: the trunk is what the folded path compiles


def test_compile_choice_says_why() -> None:
    assert compile_choice("off", torch.device("cpu")) == (False, "compile=off")
    assert compile_choice("on", torch.device("cpu"))[0] is True
    on, why = compile_choice("auto", torch.device("cpu"))
    assert on is False and "CPU" in why
    with pytest.raises(InputError, match="compile must be one of"):
        compile_choice("yes", torch.device("cpu"))
    with pytest.raises(InputError, match="needs the batched executor"):
        make_executor("sequential", "cpu", compile="on")
    assert make_executor("sequential", "cpu", compile="off").name == "sequential"


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no compiler here")


def test_failed_compilation_falls_back_to_eager_and_says_why(xi) -> None:
    folded = fold_module(xi.backbone, "conv")
    k, b = 2, 3
    params = {n: (v.detach().unsqueeze(0).repeat(k, *[1] * v.dim())
                  + 0.01 * torch.randn((k,) + tuple(v.shape))).requires_grad_(True)
              for n, v in xi.backbone.state_dict().items()}
    x = torch.randn(k, b, 3, 32, 32)
    call = TrunkCall(folded, compile=True, backend=_failing_backend)
    out = call(params, x)
    assert call.compiled is False and call.note.startswith("compile failed (")
    assert "no compiler here" in call.note
    assert torch.equal(out, call.eager(params, x))


def test_inductor_trunk_gives_the_eager_updates(xi) -> None:
    """Inductor (C++ on CPU) reorders float sums inside fused kernels, so the bound is float
    rounding carried through the local steps: ≤ 1e-5 absolute on weights of order 1 (the folded
    and sequential paths already agree to that bound, test_sim_executor_paths.py), while the
    updates themselves are > 1e-3 — the equality is not trivial."""
    m = setup_method(SPEC, xi)
    data = RandomClients(num_clients=2, sizes=(8, 8))
    plan, tasks = make_tasks(m, data, [0, 1])            # one shape: a single compilation
    cfg = LocalConfig(batch_size=4)
    eager_ex = BatchedExecutor("cpu", compile="off")
    eager = eager_ex.train(m, plan, tasks, cfg)
    comp_ex = BatchedExecutor("cpu", compile="on")
    comp = comp_ex.train(m, plan, tasks, cfg)
    assert comp_ex.path == "folded", comp_ex.path_note
    assert "compile=on" in comp_ex.path_note and "failed" not in comp_ex.path_note, comp_ex.path_note
    assert comp_ex.compile_s > 0 and eager_ex.compile_s == 0
    seq = SequentialExecutor().train(m, plan, tasks, cfg)
    start = {g: {k: torch.stack([t.params[g][k] for t in tasks]) for k in w} for g, w in tasks[0].params.items()}
    assert max_diff(eager.params, start) > 1e-3
    assert max_diff(comp.params, eager.params) < 1e-5
    assert max_diff(comp.params, seq.params) < 1e-5
    # a second chunk of the same shape reuses the compiled code: no further compilation time
    before = comp_ex.compile_s
    comp_ex.train(m, plan, tasks, cfg)
    assert comp_ex.compile_s == before


@pytest.mark.gpu
def test_inductor_trunk_gives_the_eager_updates_on_cuda(xi) -> None:
    """The same on CUDA (Triton kernels), float32 (no autocast): TF32 off so both sides round alike."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        m = setup_method(SPEC, xi, device="cuda")
        data = RandomClients(num_clients=2, sizes=(8, 8))
        plan, tasks = make_tasks(m, data, [0, 1])
        cfg = LocalConfig(batch_size=4)
        eager = BatchedExecutor("cuda", chunk_size=2, compile="off").train(m, plan, tasks, cfg)
        comp_ex = BatchedExecutor("cuda", chunk_size=2, compile="on")
        comp = comp_ex.train(m, plan, tasks, cfg)
        assert "failed" not in comp_ex.path_note, comp_ex.path_note
        assert max_diff(comp.params, eager.params) < 1e-4
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
