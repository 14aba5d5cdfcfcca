"""The device agent's secure-aggregation part (a mixin of :class:`~fedfs_sdk.federation.agent.DeviceAgent`).

Kept apart from ``agent.py``: whether this device requires secure rounds, its identity for
authenticated rounds (``fedfs-secagg/2``), the transport check, and one secure round from
advertising keys to the published sum (docs/privacy.md, docs/protocol.md).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from ..errors import InputError


class SecureRounds:
    """Mixin of the device agent: uses its client, state, config, runtime and event callback."""

    client: Any
    state: Any
    config: Any
    runtime: Any
    _identity: Any
    _emit: Callable[[str, dict[str, Any]], None]
    _sleep: Callable[[float], None]
    _clock: Callable[[], float]

    def model_bytes(self, version: int, sha: str, task: Any = None) -> bytes:   # the agent's
        raise NotImplementedError

    def _load_identity(self) -> None:
        """With a pinned CA: the device's identity key and certificate (installing
        ``config.identity_certificate`` first), checked against the CA — before registration."""
        ca = self.config.secagg.ca
        if ca is None or self._identity is not None:
            return
        from .device_identity import install_certificate, load_identity
        from .secagg.identity import IdentityError

        cert = self.config.identity_certificate
        ident = install_certificate(self.state, cert, ca) if cert is not None else \
            load_identity(self.state)
        assert ident.certificate is not None
        try:
            ident.certificate.verify(ca)
        except IdentityError as e:     # an installed certificate of another CA, or expired
            raise InputError(f"the device's identity certificate ({self.state.path}/identity.cert) does not "
                             f"verify under the pinned CA: {e}") from None
        self._identity = ident

    def secure_required(self) -> bool:
        """Whether this device takes part only in secure rounds (``config.require_secure_aggregation``;
        automatic: always with a server on another machine — no trust on first use, an on-path
        attacker could strip the first offers — else once its server offered secure
        aggregation, or with a pinned identity CA)."""
        req = self.config.require_secure_aggregation
        if req is not None:
            return bool(req)
        from .secagg.http_device import is_loopback

        if not is_loopback(self.client.base_url):   # no trust on first use: plain rounds off this machine are
            return True                              # refused unless the owner said so up front (False)
        info = self.state.info
        return self.config.secagg.ca is not None or bool(info is not None and info.secure_aggregation)

    def _check_transport(self) -> None:
        from .secagg.http_device import is_loopback

        url = self.client.base_url
        if self.secure_required() and not url.startswith("https://") and not is_loopback(url):
            raise InputError(f"this device takes part only in secure-aggregation rounds and {url} is plain http:// "
                             "to another machine, where anyone on the path can read and rewrite the protocol: "
                             "use https:// (fedfs serve --tls-cert/--tls-key; fedfs device --tls-ca)")

    def _check_dp_floor(self, task: Mapping[str, Any]) -> None:
        """A plain round below the owner's DP floor (``--dp-min-noise``: no DP, or σ below it)
        is refused before anything is trained: :class:`SecAggRoundLost` (``refused``)."""
        if self.config.secagg.min_noise_multiplier is None:
            return
        from .secagg.errors import RefusedError
        from .secagg.http_device import SecAggRoundLost

        dp = None
        if task.get("dp"):
            from .dp import DpParams

            dp = DpParams.from_json(task["dp"])
        try:
            self.config.secagg.check_dp_floor(dp, f"round {task.get('round_id')}")
        except RefusedError as e:
            raise SecAggRoundLost("refused", str(e)) from None

    def _run_secure_round(self, task: Mapping[str, Any]) -> dict[str, Any]:
        """A secure-aggregation round (Bonawitz et al. 2017; docs/privacy.md): advertise keys and
        share them before training, then upload only the masked ``n·w`` (and ``n``) and answer
        the unmask request. The plain update body never leaves the device: it is kept as the
        pending round only so that ``θ_c`` advances once the masked input is accepted, and a
        secure pending round is never uploaded again (:meth:`resume_pending` discards it)."""
        from .secagg.http_device import SecAggSession
        from .secagg.round_log import FILENAME, RoundLog

        round_id, version, method = int(task["round_id"]), int(task["model_version"]), str(task["method"])
        session = SecAggSession(self.client, task, sleep=self._sleep, clock=self._clock,
                                wait_timeout_s=self.config.wait_timeout_s, identity=self._identity,
                                policy=self.config.secagg, round_log=RoundLog(self.state.path / FILENAME))
        self._emit("round_started", {"round_id": round_id, "model_version": version, "method": method,
                                     "runtime": self.runtime.name, "secure_aggregation": True})
        session.advertise()
        session.share_keys()
        global_model = self.model_bytes(version, str(task["model_sha256"]), task)
        update = self.runtime.train(task, global_model, self)
        self._emit("trained", {"round_id": round_id, "num_samples": update.num_samples,
                               **{k: v for k, v in update.metrics.items() if k.endswith("_last")}})
        self.state.save_pending(round_id, version, update.body, update.personal, {
            "round_id": round_id, "model_version": version, "method": method, "num_samples": update.num_samples,
            "runtime": self.runtime.name, "secure_aggregation": True, "at": time.time()})
        try:   # a DP round masks the clipped w_c − w: the global model is the reference
            receipt = session.masked_input(update.body, reference=global_model)
        except BaseException:
            self.state.discard_pending()           # not in the sum: θ_c does not advance
            raise
        self.state.commit_pending(receipt)          # counted (unless the whole round fails)
        self._emit("uploaded", {"round_id": round_id, "bytes": session.bytes_sent, "secure_aggregation": True,
                                "clipped_weights": receipt.get("n_clipped")})
        session.unmask()                            # authenticated rounds: after the consistency check
        done = session.result()
        self._emit("secure_round_done", {"round_id": round_id, "result_version": done.get("result_version"),
                                         "bytes_sent": session.bytes_sent, "bytes_received": session.bytes_received})
        return {**receipt, "round_id": round_id, "result_version": done.get("result_version"),
                "secure_aggregation": True}


__all__ = ["SecureRounds"]
