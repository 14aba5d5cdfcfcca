"""fedfs's methods on Flower (https://flower.ai): a ClientApp and a ServerApp/Strategy.

The same local step and the same server aggregation as fedfs's own device client and
aggregation server, run by Flower's engines instead:

* :mod:`fedfs_flower.client_app` — ``app``, a Flower ``ClientApp``: the device's local step of
  ``fedfs`` (FedFS Alg. 1), ``feduv`` (FedUV Alg. 1–2) or ``fedfs+feduv`` with
  :class:`fedfs_sdk.training.trainer.LocalTrainer`. The FedUV codeword ``v_u = C(b_u ‖ r_u)`` and the
  personalized weights ``θ_c`` live in a per-node :class:`fedfs_sdk.federation.device_state.DeviceState`
  folder and never leave it; only ``w_c`` and ``|D_c|`` are sent.
* :mod:`fedfs_flower.strategy` — :class:`FedFSStrategy`, Flower's message-based ``FedAvg``
  with fedfs's float64 weighted average (:class:`server_agg.aggregate.StreamingFedAvg`,
  FedFS Eq. 1) and FedUV's per-node base vectors ``b_u`` (unique 32-bit, as
  ``server_agg.rounds`` issues them at registration).
* :mod:`fedfs_flower.server_app` — ``app``, a Flower ``ServerApp`` running the strategy and
  publishing the global model after each round as a fedfs checkpoint.
* :mod:`fedfs_flower.project` — writes the Flower App project (``pyproject.toml``) that
  ``flwr run`` submits to a SuperLink.

Needs the ``flower`` extra (``pip install 'fedfs[flower]'``); the settings and the local
step (:mod:`fedfs_flower.settings`, :mod:`fedfs_flower.node`) import no Flower code.
See docs/flower.md.
"""
from __future__ import annotations

FLOWER_HINT = "install the Flower extra: pip install 'fedfs[flower]' (flwr[simulation]==1.41.0)"


def require_flwr() -> None:
    """Raise :class:`ImportError` naming the extra to install when Flower is missing."""
    try:
        import flwr  # noqa: F401
    except ImportError as e:
        raise ImportError(f"fedfs_flower needs Flower (flwr), which is not installed: {FLOWER_HINT}") from e


__all__ = ["FLOWER_HINT", "require_flwr"]
