"""The fedfs aggregation server: weighted FedAvg rounds over HTTP (``fedfs serve``).

Modules, one job each:

* :mod:`~server_agg.aggregate` — streaming / stacked weighted FedAvg (also used by the simulator)
* :mod:`~server_agg.rounds` — the round state machine (:class:`~server_agg.rounds.Coordinator`)
* :mod:`~server_agg.store` — SQLite + atomic tensor files, the state-directory layout
* :mod:`~server_agg.config` — the round policy
* :mod:`~server_agg.auth` — device / admin tokens
* :mod:`~server_agg.app` — the FastAPI routes (response schemas: :mod:`~server_agg.api_responses`;
  one log line per request: :mod:`~server_agg.access_log`)
* :mod:`~server_agg.cli` — ``fedfs serve`` (its flags: :mod:`~server_agg.serve_flags`; the v1 model and
  a start's refusals: :mod:`~server_agg.serve_start`)
* :mod:`~server_agg.transport` — bounded, deadline-limited bodies and request heads
* :mod:`~server_agg.schema` — the JSON Schema of the admin config body (OpenAPI)
* :mod:`~server_agg.errors`, :mod:`~server_agg.logs` — refusals with reasons, JSON logs

The protocol is described in ``docs/protocol.md``.
"""
