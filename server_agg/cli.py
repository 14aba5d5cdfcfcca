"""``fedfs serve``: run the aggregation server.

    fedfs serve --state ./server --init-backbone tiny --code-length 127 --method feduv \\
                --rounds 5 --min-participants 3

Policy flags (``--method`` … ``--device-ttl``) are stored in the state directory; flags
given on a later start override the stored values, omitted ones keep them.

Start-up order: flags are checked (including that the method can run on the model), the
port is bound, the state directory is locked (one server per state), and only then is
anything written to the state — so a refused start leaves a new state directory absent.

The flags are :mod:`server_agg.serve_flags`; the model to publish and the refusals of a start
that could not run are :mod:`server_agg.serve_start` (both re-exported here). This module runs
the start-up in that order (:func:`run`) and then serves (:func:`_serve`).
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from fedfs_sdk.errors import InputError

from .serve_flags import add_arguments, policy_overrides  # noqa: F401 (re-exported: the command line)
from .serve_start import (check_plain_bind, check_proj_dim, check_start, initial_checkpoint,  # noqa: F401
                          model_config_of, xi_config_of)  # (re-exported: the v1 model, a start's refusals)

log = logging.getLogger("fedfs.server")


def _read_impostors(args: argparse.Namespace) -> bytes | None:
    """The bytes of --impostors, checked to be a fedfs impostor set (None without the flag)."""
    path = getattr(args, "impostors", None)
    if path is None:
        return None
    from fedfs_sdk.runtime.impostors import load_impostors

    load_impostors(path)                      # a clear one-line error for anything else
    return Path(path).read_bytes()


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, bound before the state is touched so a busy
    port fails the start without writing anything (uvicorn then serves on it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise InputError(f"--host {host!r} cannot be resolved: {e.strerror}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)      # "localhost": IPv4 first, as devices dial it
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # not SO_REUSEPORT: a busy port stays busy
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    from .config import RoundPolicy
    from .logs import setup_logging
    from .rounds import validate_xi
    from .store import Layout, StateLock
    from .transport import http_parser

    setup_logging(args.log_level)
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout", "limit_concurrency", "decode_workers",
                 "receive_workers"):
        v = getattr(args, flag)
        if not v > 0 or v != v or v == float("inf"):
            raise InputError(f"--{flag.replace('_', '-')} must be a positive finite number, got {v}")
    installed = http_parser()
    if args.http_parser == "httptools" and installed != "httptools":
        raise InputError("--http-parser httptools: httptools is not installed (pip install 'fedfs[server]')")
    if args.http_parser == "auto":
        args.http_parser = installed             # _serve builds the protocol and logs this one
    xi = None
    if args.xi is not None:
        from .model_source import read_model_spec

        xi = read_model_spec(args.xi, "--xi")
        validate_xi(xi)
    impostors = _read_impostors(args)
    overrides = policy_overrides(args)
    from .transport import tls_files

    tls = tls_files(getattr(args, "tls_cert", None), getattr(args, "tls_key", None))
    check_plain_bind(args.host, tls is not None, bool(getattr(args, "insecure_plain_http", False)))
    if overrides.get("dp_noise_multiplier") is not None:
        from .dp import require_accountant

        require_accountant()                   # DP without its accountant: say so now, not at round 1
    layout = Layout(args.state.resolve())
    if layout.root.exists() and not layout.root.is_dir():
        raise InputError(f"--state {args.state} exists and is not a directory")
    new_state = not layout.db.exists()
    if new_state and "method" not in overrides:
        from .model_source import default_method

        overrides["method"] = default_method(xi is not None)   # the simulator's default where ξ is given
    if new_state and xi is not None and "scope" not in dict(overrides.get("train") or {}):
        # … and its scope, named in the task: the trunk then stays ξ's bit for bit (frozen_trunk.py),
        # a secure round masks only the top, and devices train on ξ's cached trunk features. ORT
        # artifacts train every layer and refuse it: their federation names --train '{"scope": "all"}'.
        from fedfs_sdk.training.methods import DEFAULT_SCOPE

        method = str(overrides.get("method") or RoundPolicy().method)
        if method in DEFAULT_SCOPE:
            overrides["train"] = {**dict(overrides.get("train") or {}), "scope": DEFAULT_SCOPE[method]}
    try:
        start_policy = RoundPolicy().updated(overrides)
    except InputError as e:
        raise InputError(f"invalid round policy: {e}") from None
    # bad flags fail before the state is touched; an existing state's model is not replaced
    init = initial_checkpoint(args, xi, start_policy.method, dict(start_policy.train)) \
        if new_state or args.init_model is not None or args.init_backbone is not None else None
    init_config = model_config_of(init) if init is not None else None
    if new_state:                              # a new state: its policy is the defaults + flags
        try:
            policy = RoundPolicy().updated(overrides)
        except InputError as e:
            raise InputError(f"invalid round policy: {e}") from None
        check_start(args, policy.method, init_config, installs_initial=init is not None)
        check_proj_dim(policy.method, init_config, xi_config_of(xi), dict(policy.train))
    sock = bind_listener(args.host, args.port)
    try:
        with StateLock(layout.root):
            return _serve(args, layout, sock, overrides, init, init_config, xi, tls, impostors)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, layout: Any, sock: socket.socket, overrides: dict[str, Any],
           init: bytes | None, init_config: dict[str, Any] | None, xi: bytes | None,
           tls: tuple[str, str] | None = None, impostors: bytes | None = None) -> int:
    """Everything after the port is bound and the state locked."""
    import uvicorn

    from .app import create_app
    from .auth import load_admin_token
    from .transport import deadline_protocol
    from .rounds import Coordinator

    coord = Coordinator(layout, keep_updates=args.keep_updates, poll_interval_s=args.poll_interval)
    try:
        method = coord.policy.updated(overrides).method
        installs = init is not None and coord.model is None
        where = "the initial model" if installs or coord.model is None else f"the state's model v{coord.model.version}"
        model_config = init_config if installs else (coord.model.model_config if coord.model else None)
        check_start(args, method, model_config, installs_initial=installs, where=where)
        stored_xi = layout.xi.read_bytes() if xi is None and layout.xi.is_file() else None
        check_proj_dim(method, model_config, xi_config_of(xi if xi is not None else stored_xi),
                       dict(coord.policy.updated(overrides).train), where=where)
        if not coord.configure(overrides, init) and init is not None:
            log.info("initial model ignored: the state already has one",
                     extra={"fields": {"model_version": coord.model.version}})
        if xi is not None:
            coord.install_xi(xi)
        if impostors is not None:
            from .impostor_store import install_impostors

            install_impostors(coord, impostors)
        admin_token, generated = load_admin_token(layout.admin_token, args.admin_token)
        if generated:
            log.info("admin token generated", extra={"fields": {"path": str(layout.admin_token)}})
        app = create_app(coord, admin_token=admin_token, registration_token=args.registration_token,
                         max_body_bytes=int(args.max_body_mb * (1 << 20)), tick_interval_s=args.tick_interval,
                         body_timeout_s=args.body_timeout, decode_workers=args.decode_workers,
                         receive_workers=args.receive_workers)
        port = sock.getsockname()[1]
        scheme = "https" if tls else "http"
        log.info("serving", extra={"fields": {"url": f"{scheme}://{args.host}:{port}", "state": str(layout.root),
                                              "pid": os.getpid(), "http_parser": args.http_parser,
                                              "model_version": coord.model.version if coord.model else None,
                                              "policy": coord.policy.to_json()}})
        # A thread holding the GIL keeps it up to the switch interval (5 ms by default) each
        # time the event loop wants it back — for every socket call. 1 ms bounds that wait
        # while decode threads run Python code (measured in benchmarks/server_http_load.py).
        sys.setswitchinterval(0.001)
        config = uvicorn.Config(app, log_config=None, access_log=False, log_level=args.log_level,
                                timeout_graceful_shutdown=5, http=deadline_protocol(args.header_timeout, args.http_parser),
                                timeout_keep_alive=args.keep_alive_timeout,  # type: ignore[arg-type]
                                limit_concurrency=args.limit_concurrency,
                                ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
        server = uvicorn.Server(config)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:   # pragma: no cover - uvicorn handles SIGINT itself
            pass
        return 0 if server.started else 3
    finally:
        coord.close()


__all__ = ["add_arguments", "run", "policy_overrides", "initial_checkpoint", "check_start", "check_proj_dim",
           "xi_config_of", "bind_listener", "model_config_of", "check_plain_bind"]
