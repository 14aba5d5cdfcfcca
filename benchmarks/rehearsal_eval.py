"""The evaluation side of ``benchmarks/deployment_rehearsal.py``: each deployed device's enrollment
scored by the simulator's own :func:`device_sim.evaluate.evaluate` on the simulator's test photos
and impostor pool, and the paired comparison with the simulator's rows.

Reading a device's enrollment (``STATE/enrollment.fedfs``, decrypted with its key) and verifier
(``STATE/verifier.safetensors``) from its state folder is a **test-bench privilege**: a real device
never shows either to anyone.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

METRICS: tuple[tuple[str, str], ...] = (("template AUROC", "template_auroc"), ("pairwise AUROC", "pairwise_auroc"),
                                        ("TAR@FAR 1e-3", "template_tar"), ("pairwise TAR@FAR 1e-3", "pairwise_tar"))
"""The compared per-client columns (display name, key of :func:`per_client`)."""


class TemplateOutput(nn.Module):
    """A deployed verifier as the simulator's evaluation reads it: ``embedding`` is the output the
    device's enrollment made its template from (``embedding``, or the FedUV head's ``uv``), ``uv``
    the head (for a codeword enrollment)."""

    def __init__(self, net: nn.Module, template_output: str) -> None:
        super().__init__()
        self.net, self.template_output = net, template_output
        names = tuple(net.output_names)
        self.output_names = ("embedding", "uv") if "uv" in names else ("embedding",)
        self._pos = {n: i for i, n in enumerate(names)}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.net(x)
        first = out[self._pos[self.template_output]]
        return (first, out[self._pos["uv"]]) if len(self.output_names) == 2 else (first,)


TRUNK_ATOL = 1e-6
"""Largest trunk deviation from ξ a verifier may have and still be scored on ξ's cached trunk
features. ``scope=top`` freezes the trunk, but secure aggregation averages it in fixed point
(2^-24 steps): the global model's trunk comes back within ~4e-9 of ξ's, not bit-equal (measured
on the tiny backbone after 2 rounds); a verifier further off is scored whole."""


def trunk_deviation(net: nn.Module, xi_backbone: nn.Module) -> float:
    """Max |Δ| between every trunk tensor of the verifier ``net`` (all but ``scope="top"``'s
    layers, in each of its backbones) and ξ's (inf where a tensor has no counterpart)."""
    from fedfs_sdk.training.scope import is_top_key

    xi_sd = xi_backbone.state_dict()
    worst = 0.0
    for k, v in net.state_dict().items():
        if is_top_key(k) or not k.startswith(("backbone.", "global_backbone.")):
            continue
        ref = xi_sd.get(k.split(".", 1)[1])
        if ref is None or ref.shape != v.shape:
            return math.inf
        if v.numel():
            worst = max(worst, float((ref.double() - v.double()).abs().max()))
    return worst


def make_spec(net: nn.Module, output: str, xi_backbone: nn.Module | None, **kw):
    """``(spec, trunk deviation)``: a :class:`~device_sim.methods.base.VerifierSpec` of ``net``
    reading ``output`` as its template output. When its trunk is ξ's (within :data:`TRUNK_ATOL`,
    tensor by tensor) it runs as its top on ξ's cached trunk features (:mod:`device_sim.trunk_cache`),
    as the simulator evaluates ``scope=top`` models: each image's trunk is computed once for all
    devices."""
    from device_sim.methods.base import VerifierSpec
    from device_sim.methods.selection import top_verifier
    from device_sim.trunk_cache import trunk_cache
    from fedfs_sdk.errors import InputError

    wrapped = TemplateOutput(net.eval(), output).eval()
    weights = {k: v.detach() for k, v in wrapped.state_dict().items()}
    trunk = top = None
    dev = trunk_deviation(net, xi_backbone) if xi_backbone is not None else math.inf
    if dev <= TRUNK_ATOL:
        try:
            top = TemplateOutput(top_verifier(net), output).eval()
            trunk = trunk_cache(xi_backbone)
        except InputError:          # a backbone without an embedding layer: run it whole
            top = None
    return VerifierSpec(wrapped, weights, trunk=trunk, top=top, **kw), dev


def onnx_verifier_net(path: Path, model_config: Any):
    """A phone's ``STATE/verifier.onnx`` as a torch verifier of the same weights (its initializers carry the
    state-dict names; a ``global_backbone.*`` set makes it the dual verifier), so the simulator's evaluation
    scores it like the torch devices' (the export's ONNX-vs-torch parity is tested apart)."""
    import onnx
    from onnx import numpy_helper

    from fedfs_sdk.nn.checkpoint import verifier_in_memory
    from fedfs_sdk.nn.dual_verifier import dual_verifier_in_memory
    from fedfs_sdk.nn.model import FaceNet, FedUVHead

    w = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in onnx.load(str(path)).graph.initializer
         if i.name.startswith(("backbone.", "global_backbone.", "uv_head."))}
    cfg = model_config.resolved()

    def backbone(prefix: str) -> nn.Module:
        bb = FaceNet(cfg).backbone
        bb.load_state_dict({k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)})
        return bb.eval()
    head = None
    if "uv_head.weight" in w:
        head = FedUVHead(*reversed(w["uv_head.weight"].shape))
        head.load_state_dict({"weight": w["uv_head.weight"]})
    if any(k.startswith("global_backbone.") for k in w):
        return dual_verifier_in_memory(backbone("backbone."), backbone("global_backbone."), head, cfg)
    return verifier_in_memory(backbone("backbone."), cfg, head)


def device_spec(state_dir: Path, key: bytes, xi_backbone: nn.Module | None = None, use_template: bool = True,
                model_config: Any = None):
    """``(VerifierSpec, enrollment meta, trunk deviation from ξ)`` of one deployed device: its verifier (a
    phone's ``verifier.onnx`` read with ``model_config``: :func:`onnx_verifier_net`) and — with
    ``use_template`` — its enrolled template as the fixed reference (else the simulator enrolls the verifier on
    the client's training photos itself)."""
    from fedfs_sdk.nn.checkpoint import load_verifier
    from fedfs_sdk.runtime.enrollment_store import load_enrollment

    enr = load_enrollment(state_dir / "enrollment.fedfs", key)
    if (state_dir / "verifier.onnx").is_file() and not (state_dir / "verifier.safetensors").is_file():
        net, model_id = onnx_verifier_net(state_dir / "verifier.onnx", model_config)
    else:
        net, model_id = load_verifier(state_dir / "verifier.safetensors")
    codeword = None if enr.mode != "codeword" else np.asarray(enr.codeword, dtype=np.float64)
    reference = (torch.as_tensor(enr.template, dtype=torch.float64)
                 if use_template and enr.mode == "template" else None)
    # the features depend on the weights alone (model id): devices with the same model embed the pool once
    spec, dev = make_spec(net, enr.template_output, xi_backbone, codeword=codeword,
                            shared_key=f"{model_id}:{enr.template_output}", reference=reference)
    return spec, enr.meta, dev


def xi_spec(path: Path, xi_backbone: nn.Module | None = None):
    """ξ as the server served it (a device's downloaded ``xi.safetensors``), a shared verifier."""
    from fedfs_sdk.nn.checkpoint import load_verifier

    net, model_id = load_verifier(path)
    return make_spec(net, "embedding", xi_backbone, shared_key=f"xi:{model_id}")[0]


class _NoNewUsers:
    """The population without its new users: the compared columns use the clients' test photos and
    the impostor pool only; new users would need a never-registered device (not rehearsed)."""

    num_new_users = 0

    def __init__(self, pop: Any) -> None:
        self._pop = pop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pop, name)


class DeployedVerifiers:
    """The minimal :class:`~device_sim.methods.base.FederatedMethod` surface that
    :func:`~device_sim.evaluate.evaluate` calls: client ``c`` verifies with ``specs[c]``."""

    label = "deployment"

    def __init__(self, specs: Mapping[int, Any]) -> None:
        self.specs = dict(specs)

    def prepare_evaluation(self, global_weights, private, clients) -> None:
        missing = sorted(set(clients) - set(self.specs))
        if missing:
            raise RuntimeError(f"no deployed enrollment for clients {missing[:10]}")

    def client_state_init(self, c: int) -> int:
        return int(c)

    def verifier(self, state: int, global_weights, private):
        return self.specs[int(state)]


def evaluate_specs(specs: Mapping[int, Any], pop: Any, eval_cfg: Any, device: str = "cpu") -> dict[str, Any]:
    """The simulator's evaluation (same clients sample, impostor pool and seeds as its rows)."""
    from device_sim.evaluate import evaluate

    return evaluate(DeployedVerifiers(specs), {}, lambda c: None, _NoNewUsers(pop), eval_cfg, device,
                    client_state=lambda c: int(c))


def per_client(ev: Mapping[str, Any], keep: Sequence[bool] | None = None) -> dict[str, list[float]]:
    """The compared per-client columns of one evaluation (``results.json``'s ``eval``); ``keep``:
    only the clients marked True (in the evaluation's client order)."""
    cols = {"template_auroc": list(ev["verification"]["per_client_auroc"]),
            "pairwise_auroc": list(ev["pairwise"]["per_client_auroc"]),
            "template_tar": list(ev["verification"]["per_client_tar_at_far"]["0.001"]),
            "pairwise_tar": list(ev["pairwise"]["per_client_tar_at_far"]["0.001"])}
    if keep is None:
        return cols
    return {k: [x for x, ok in zip(v, keep) if ok] for k, v in cols.items()}


def mean(xs: Sequence[float]) -> float:
    a = np.asarray(xs, dtype=np.float64)
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan


def compare(a: Mapping[str, Any], b: Mapping[str, Any], keep: Sequence[bool] | None = None) -> dict[str, Any]:
    """Paired per-client ``a − b`` (mean ± SE) of every compared column; ``a`` and ``b`` are
    evaluations of the same clients (refused otherwise); ``keep``: only those clients."""
    from device_sim.client_metrics import paired_delta

    if list(a["clients"]) != list(b["clients"]):
        raise RuntimeError("the two evaluations are not of the same clients in the same order")
    pa, pb = per_client(a, keep), per_client(b, keep)
    return {k: paired_delta(pa[k], pb[k]) for _, k in METRICS}


def choice_counts(choices: Sequence[str | None]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in choices:
        out[str(c)] = out.get(str(c), 0) + 1
    return out


def fmt_counts(counts: Mapping[str, int]) -> str:
    order = ("xi", "norm-adapt", "global", "personalized")
    return " / ".join(f"{counts.get(k, 0)}" for k in order) + "".join(
        f" ({k} {v})" for k, v in counts.items() if k not in order)


def fmt_delta(d: Mapping[str, Any]) -> str:
    return f"{d['mean']:+.4f} ± {d['se']:.4f}" if np.isfinite(d.get("mean", math.nan)) else "–"


def markdown(rows: Sequence[Mapping[str, Any]], comparisons: Sequence[Mapping[str, Any]]) -> str:
    """Two tables: each row's means and Δ vs the simulator's ξ, then deployment − simulator."""
    head = "| row | " + " | ".join(f"{n} | Δ vs ξ ±SE" for n, _ in METRICS) + " | chose ξ / norm-adapt / global / personalized |"
    lines = [head, "|" + "---|" * (2 + 2 * len(METRICS))]
    for r in rows:
        cells = [f"{mean(r['values'][k]):.4f} | {fmt_delta(r['vs_xi'][k]) if r.get('vs_xi') else 'ref'}"
                 for _, k in METRICS]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {fmt_counts(r['choices']) if r['choices'] else '–'} |")
    lines += ["", "| deployment − simulator (same clients) | " + " | ".join(f"Δ {n} ±SE" for n, _ in METRICS)
              + " | clients | agree within 2·SE |", "|" + "---|" * (3 + len(METRICS))]
    for c in comparisons:
        within = all(abs(c["delta"][k]["mean"]) <= 2 * c["delta"][k]["se"] + 1e-12
                     for _, k in METRICS if np.isfinite(c["delta"][k]["mean"]) and np.isfinite(c["delta"][k]["se"]))
        lines.append(f"| {c['a']} − {c['b']} | " + " | ".join(fmt_delta(c["delta"][k]) for _, k in METRICS)
                     + f" | {c['delta']['template_auroc']['n']} | {'yes' if within else 'no'} |")
    return "\n".join(lines)


__all__ = ["TemplateOutput", "trunk_deviation", "TRUNK_ATOL", "make_spec", "device_spec", "xi_spec", "DeployedVerifiers", "evaluate_specs", "per_client",
           "compare", "choice_counts", "markdown", "METRICS"]
