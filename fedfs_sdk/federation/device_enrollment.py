"""A device's enrollment after its last round (:meth:`DeviceAgent.enroll`): the do-no-harm
choice of the model it verifies with (:mod:`fedfs_sdk.training.selection`: ξ, the global model or
its personalized one, judged on its held-out photos against the public impostor set as its own
camera would have taken them) and the enrollment with its operating point. Torch-free, as the
agent is."""
from __future__ import annotations

import math

import numpy as np

from ..errors import InputError, ProtocolError
from .wire_format import sha256_hex
from ..training.methods import check_method, check_verification, uses_fedfs, uses_feduv


PUBLIC_CANDIDATES = ("xi", "norm-adapt", "global")
"""Candidates every device holds byte for byte: ξ and the global model as the server serves them,
``norm-adapt`` ξ refitted to the published embedding sum. (The personalized verifier holds ``θ_c``.)"""


def enroll_device(self, after_round: int | None = None):  # self: the DeviceAgent
    """Enroll the owner with the newest global model (and θ_c for FedFS methods).

    Waits for ``after_round`` to close so the model includes this device's last update.
    Writes the encrypted ``enrollment.fedfs`` into the device state (the torch runtime
    also ``verifier.safetensors``, what ``fedfs verify --model`` takes); returns the
    enrollment.
    """
    from ..runtime.enrollment import enroll, save_enrollment
    from ..runtime.impostors import load_impostors

    if after_round is not None:
        t0 = self._clock()
        while self.client.round_status(after_round)["state"] == "open":
            if self._clock() - t0 > self.config.wait_timeout_s:
                raise ProtocolError(f"round {after_round} did not close within {self.config.wait_timeout_s:.0f} s")
            self._sleep(1.0)
    info = self.client.latest_model()
    method = (self.state.info.rounds[-1]["method"] if self.state.info and self.state.info.rounds
              else info.get("method") or ("feduv" if info["config"].get("code_length") else "fedfs"))
    version = int(info["version"])
    score, model = check_verification(check_method(method), self.config.score, self.config.verify)
    mbytes = self.model_bytes(version, info["sha256"])
    impostors, selection, chosen = None, None, "personalized"
    if self.config.select == "off":          # asked for: the method's model, unchecked (the papers' behaviour)
        impostors = load_impostors(self.config.impostors) if self.config.impostors is not None else None
    else:
        fetch_xi(self, info)                 # ξ is a candidate of the check even where the method trains without it
        impostors = public_impostors(self, info)
        if impostors is None and self.config.far is not None and self.config.far_stats is None:
            raise InputError(f"a false-accept target (far={self.config.far:g}) needs a public impostor set: the server "
                             "ships none (fedfs serve --impostors); give the device --impostors FILE")
        fallback = None
        if self.config.stats:                # the defaults' rule: in-domain check, norm-adapt, the federation's verdict
            from .device_stats import StatsUnavailable, stats_choice

            try:
                chosen, selection = stats_choice(self, method, mbytes, version, model, score)
            except StatsUnavailable as e:
                fallback = f"no in-domain check: {e}"
                self._emit("stats_unavailable", {"reason": str(e)[:300]})
        if selection is None and impostors is not None:
            chosen, selection = choose_model(self, method, mbytes, version, score, model, impostors,
                                             code_length=info["config"].get("code_length"))
        elif selection is None:
            chosen, selection = unchecked_choice(self)
        if fallback is not None:
            selection = {**selection, "fallback": fallback}
    backend = self.runtime.verifier(method, mbytes, self, version, model, candidate=chosen)
    mode, template_output = candidate_mode(method, score, model, chosen)
    codeword = device_codeword(self, info["config"].get("code_length")) if mode == "codeword" else None
    from .device_runtime import xi_path

    xi_sha = sha256_hex(xi_path(self).read_bytes()) if has_xi(self) else None    # ξ hashed once per enrollment
    in_domain = None
    if self.config.far is not None:
        # the federation's tail: --far-stats, else the automatic rounds' published xi.tail (.device_tail)
        stats = self.config.far_stats
        if stats is None and self.config.stats and xi_sha is not None:
            from .device_stats import published_far_stats

            stats = published_far_stats(self, xi_sha)
        if stats is not None:
            in_domain = far_evidence(self, backend, stats, impostors or (load_impostors(self.config.impostors)
                                                                         if self.config.impostors else None), xi_sha)
    shared = shared_impostor_outputs(chosen, backend, impostors,
                                     compute=trunk_impostor_outputs(self, backend, impostors, xi_sha))
    enrollment = enroll(backend, self.images, q=self.config.q, codeword=codeword,
                        detect_face=self.config.detect_face, outliers=self.config.outliers,
                        template_output=template_output, far=self.config.far, impostors=impostors, in_domain=in_domain,
                        impostor_outputs=shared,
                        meta={"global_version": version, "method": method, "runtime": self.runtime.name,
                              "score": score, "verify": model, "model_choice": chosen,
                              **({"selection": selection} if selection is not None else {})})
    key = self.config.enrollment_key or self.state.enrollment_key()
    save_enrollment(self.state.file("enrollment.fedfs"), enrollment, key, overwrite=True)
    m = enrollment.meta     # flagged = dropped + kept at the warm-up floor (they may set τ)
    self._emit("enrollment_outliers", {"rule": m["outlier_rule"], "dropped": m["dropped"], "n_given": m["n_given"],
                                       "flagged": m["outliers_flagged"], "kept_at_floor": m["kept_at_floor"],
                                       "min_warmup": m["min_warmup"]})
    self._emit("enrolled", {"mode": enrollment.mode, "threshold": enrollment.threshold,
                            "model_id": backend.model_id, "n_warmup": enrollment.n_warmup, "model_choice": chosen,
                            **({"operating_point": enrollment.meta["operating_point"]}
                               if "operating_point" in enrollment.meta else {})})
    return enrollment


def far_evidence(self, backend, stats, impostors, xi_sha: str | None):  # self: the DeviceAgent
    """The federation's evidence for ``enroll(far=…)`` from ``stats`` (``config.far_stats``, or the published
    sums of the automatic rounds; issue 29): the torch runtime's verifier, or the ONNX runtime's from its
    export's trunk and top graphs. ``xi_sha``: the sha256 of the device's ξ (None: it has none)."""
    from .device_runtime import TorchRuntime, xi_path

    if not isinstance(self.runtime, TorchRuntime):
        if xi_sha is None:
            raise InputError("a FAR target from the federation's statistics needs ξ (the round's tail was measured "
                             "with it): give the device --xi FILE or join a server that serves ξ")
        return self.runtime.far_evidence(stats, backend, xi_path(self), xi_sha, impostors)
    from ..stats.evidence import evidence_for_backend, xi_verifier

    # ξ loaded directly: runtime.verifier would overwrite the state's verifier.safetensors with it
    xi = xi_verifier(xi_path(self)) if has_xi(self) else backend
    return evidence_for_backend(stats, backend, xi, impostors)


def trunk_impostor_outputs(self, backend, impostors, xi_sha: str | None):  # self: the DeviceAgent
    """A function computing ``backend``'s outputs on the public impostor set from ξ's trunk features
    of it — where the verifier runs on ξ's trunk (``scope="top"``); else None (the full forward runs,
    in ``enroll``). The torch runtime shares the features in the process (:mod:`.public_trunk`); the
    ONNX runtime computes them once with its export's ``trunk.onnx`` (``OrtRuntime.impostor_outputs``).
    ``xi_sha``: the sha256 of the device's ξ (None: it has none)."""
    from .device_runtime import TorchRuntime, xi_path

    if impostors is None or xi_sha is None:
        return None
    if not isinstance(self.runtime, TorchRuntime):
        if not hasattr(self.runtime, "impostor_outputs"):
            return None
        return self.runtime.impostor_outputs(backend, impostors, xi_sha)
    from ..runtime.impostor_outputs import impostor_batch
    from .device_features import has_xi_trunk
    from .device_models import device_xi
    from .public_trunk import PUBLIC_TRUNK, outputs_on_trunk

    xi_net = device_xi(self, xi_path(self))
    if not has_xi_trunk(backend.verifier, xi_net.backbone):
        return None
    return lambda: outputs_on_trunk(backend, PUBLIC_TRUNK.features(
        xi_sha, xi_net, f"{impostors.digest()}@{backend.input_size}", lambda: impostor_batch(backend, impostors)))


def shared_impostor_outputs(candidate: str, backend, impostors, cache=None, compute=None):
    """``backend``'s outputs on the public impostor set when they need not come from its full
    forward: a *public* candidate's from the process's cache
    (:data:`~fedfs_sdk.runtime.impostor_outputs.PUBLIC_OUTPUTS`: computed once — by ``compute`` when given — for every device of the process); the device's own
    model's (``personalized``: θ_c never enters a cache another device reads) by ``compute``; else
    None (``enroll`` runs the full forward), and None without impostors."""
    if impostors is None:
        return None
    if candidate not in PUBLIC_CANDIDATES:
        return compute() if compute is not None else None
    from ..runtime.impostor_outputs import PUBLIC_OUTPUTS

    return (PUBLIC_OUTPUTS if cache is None else cache).get(backend, impostors, compute=compute)


def choose_model(self, method: str, model: bytes, version: int, score: str, verify: str,  # self: the DeviceAgent
                 impostors, code_length: int | None = None) -> tuple[str, dict]:
    """Do no harm (:mod:`fedfs_sdk.training.selection`): score the hold-out photos (never trained
    on) and the public impostors with ξ, the global model and the personalized one; keep the
    best, ties to the earlier (ξ first)."""
    from ..runtime.capture_match import match_capture
    from ..training.selection import CHECK_IMPOSTORS, Verdict, candidate_scores, check_scores, choose

    train, hold = self.holdout_split()
    names = (["xi"] if has_xi(self) else []) + ["global"] + (["personalized"] if uses_fedfs(method) else [])
    if hold.size == 0 or len(names) < 2:
        return ("xi" if "xi" in names else "personalized"), {
            "chosen": "xi" if "xi" in names else "personalized",
            "reason": "no hold-out photos (too few photos)" if hold.size == 0 else "nothing to compare with"}
    checks, matched = [], {}
    for name in names:
        backend = self.runtime.verifier(method, model, self, version, verify, candidate=name)
        size = backend.input_size
        x = self.all_images_array(size)
        if size not in matched:   # the public impostors as this phone would have taken them (its photos' statistics)
            impostors.batch(size)             # the set fits this model (or a clear error)
            matched[size] = _from_u8(match_capture(impostors.images[:CHECK_IMPOSTORS], _to_u8(x[train]),
                                                   seed=len(self.images)))
        mode, output = candidate_mode(method, score, verify, name)
        codeword = device_codeword(self, code_length) if mode == "codeword" else None
        g, i = candidate_scores(backend, x[train], x[hold], matched[size], mode, output, codeword)
        checks.append(check_scores(name, g, i, self.config.far or 1e-3))
    verdicts = {n: Verdict(n, True, math.nan, math.nan, math.nan, 0) for n in self.config.helps}
    sel = choose(checks, verdicts)
    self._emit("model_chosen", {"chosen": sel.chosen, "reason": sel.reason})
    return sel.chosen, sel.to_dict()


def public_impostors(self, info: dict):  # self: the DeviceAgent
    """The public impostor set of the do-no-harm check: ``--impostors``, else the one the server
    ships with its model (``impostors_sha256`` in the model info; downloaded once, hash-checked,
    kept in the state), else None."""
    from ..runtime.impostors import load_impostors

    if self.config.impostors is not None:
        return load_impostors(self.config.impostors)
    sha = info.get("impostors_sha256")
    if not sha:
        return None
    from .device_tail import impostors_of

    return impostors_of(self, sha)


def fetch_xi(self, info: dict) -> None:  # self: the DeviceAgent
    """Download the server's ξ (``xi_sha256`` in the model info) when the device has none yet."""
    if not has_xi(self) and info.get("xi_sha256"):
        self.xi_file(info["xi_sha256"])


def unchecked_choice(self) -> tuple[str, dict]:  # self: the DeviceAgent
    """No public impostor set: nothing can show that a trained model does no harm, so the device
    keeps ξ and says so — it never enrolls an unchecked model. Without ξ the global model is the
    only one there is."""
    if has_xi(self):
        sel = {"chosen": "xi", "reason": "no public impostor set (neither --impostors nor one shipped by the server, "
                                         "fedfs serve --impostors): kept ξ, a model it cannot check could do harm"}
    else:
        sel = {"chosen": "personalized", "reason": "no ξ to compare with: the federation's model is the only one"}
    self._emit("model_chosen", sel)
    return sel["chosen"], sel


def has_xi(self) -> bool:
    """Whether the device has ξ to compare with (given with --xi, or downloaded to train)."""
    return self.config.xi_path is not None or self.state.file("xi.safetensors").is_file()


def device_codeword(self, code_length: int | None) -> np.ndarray:  # self: the DeviceAgent
    """The codeword the device enrolls with: the one it trained with, or — a device the server never
    sampled, FedUV's new user — one made now from its base vector and fresh ``r_u`` (FedUV Alg. 2:
    a new user picks its codeword at enrollment). :meth:`DeviceState.codeword` does both."""
    return self.state.codeword(int(code_length)) if code_length else self.state.load_codeword()


def _to_u8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x * 127.5 + 127.5), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1).copy()


def _from_u8(u8: np.ndarray) -> np.ndarray:
    return ((u8.astype(np.float32) - 127.5) / 127.5).transpose(0, 3, 1, 2).copy()


def candidate_mode(method: str, score: str, verify: str, candidate: str) -> tuple[str, str]:
    """``(mode, template_output)`` a candidate verifier enrolls with: ξ — a template of its
    embedding; the global model — its method's scoring (codeword, or a head-space template of
    ``uv``); the personalized one — the method's verification (the dual verifier's embedding is
    already ``unit(W q') ⊕ unit(W r')``; a single model's head-template is the cosine of ``uv``)."""
    if candidate in ("xi", "norm-adapt") or not uses_feduv(method):
        return "template", "embedding"
    if score == "codeword":
        return "codeword", "embedding"
    if candidate == "global":
        return "template", "uv"
    return "template", ("uv" if verify != "both" else "embedding")


__all__ = ["enroll_device", "PUBLIC_CANDIDATES", "shared_impostor_outputs", "trunk_impostor_outputs", "choose_model", "candidate_mode", "has_xi",
           "public_impostors", "fetch_xi", "unchecked_choice"]
