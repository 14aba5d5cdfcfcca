"""The HTTP face of the aggregation server (FastAPI). Routes are thin: authenticate, check
what can be checked without the body, read a bounded body (``server_agg.transport``), call
the :class:`~server_agg.rounds.Coordinator`, map its errors to 4xx.

The OpenAPI document is FastAPI's (``/openapi.json``, ``/docs``); ``docs/protocol.md``
describes the protocol in prose.

The response schemas are :mod:`server_agg.api_responses` (re-exported here), the per-request
log line :mod:`server_agg.access_log`.
"""
from __future__ import annotations

import asyncio
import hmac
import hashlib
import io
import json
import logging
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Literal

import anyio.to_thread
from fastapi import FastAPI, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from fedfs_sdk.federation.wire import MEDIA_TYPE
from fedfs_sdk.federation.wire_format import MAX_ID

from .access_log import _AccessLog
from .api_responses import (_BINARY_BODY, ErrorBody, Health, ModelInfo, Receipt, Registration,  # noqa: F401
                            RoundStatus, ServerStatus, Task, _errors)  # (re-exported: the response schemas)
from .errors import ApiError, NotFound, Unauthorized, Unprocessable
from .rounds import Coordinator
from .schema import POLICY_CHANGES_SCHEMA
from .secagg_routes import install_secagg_routes
from .stats_routes import install_stats_routes
from .transport import ClientGone, receive_body, require_media_type

log = logging.getLogger("fedfs.server.http")

API_VERSION = "1"
HEADER_SLACK_BYTES = 1 << 20
"""An update may exceed the model's tensor bytes by at most this (its safetensors header)."""
MAX_CONFIG_BYTES = 64 << 10
"""``PUT /v1/admin/config`` bodies are small JSON objects: bounded far below ``--max-body-mb``,
so parsing one never holds the event loop for long."""


# ---- the app -----------------------------------------------------------------------------

def create_app(coord: Coordinator, *, admin_token: str, registration_token: str | None = None,
               max_body_bytes: int = 256 << 20, tick_interval_s: float = 0.5, body_timeout_s: float = 120.0,
               decode_workers: int = 2, receive_workers: int = 16, request_threads: int = 8) -> FastAPI:
    """Build the FastAPI app around ``coord``. A background task calls ``coord.tick()``
    every ``tick_interval_s`` (deadlines, automatic rounds).

    Memory is O(model), not O(uploads in flight × model): a model-sized body is spooled to
    an anonymous temp file in the state directory while it arrives (``body_timeout_s`` to
    complete, ``receive_workers`` of them at once), and at most ``decode_workers`` spooled
    bodies are decoded, validated and added to the round's float64 sum at once."""
    admin_digest = hashlib.sha256(admin_token.encode()).digest()
    reg_digest = hashlib.sha256(registration_token.encode()).digest() if registration_token else None
    # Decoding, validation and aggregation run on this many dedicated threads (not the shared
    # request thread pool): at most that many update-sized working sets exist at once, and
    # the allocator's per-thread arenas that hold them stay few.
    decoders = ThreadPoolExecutor(max(1, decode_workers), thread_name_prefix="fedfs-decode")
    # Model-sized bodies stream in on at most this many connections at once; the others wait
    # with their bytes in the kernel's socket buffers (uvicorn stops reading a connection
    # whose body nobody consumes). Each event-loop pass then touches few sockets, so /health
    # and new connections are served promptly under hundreds of concurrent uploads.
    receive_slots = asyncio.Semaphore(max(1, receive_workers))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Sync routes and dependencies (token checks, status) run on this many threads: every
        # runnable thread competes with the event loop for the GIL, so fewer of them keep
        # /health and new connections prompt when hundreds of devices arrive at once.
        anyio.to_thread.current_default_thread_limiter().total_tokens = max(1, request_threads)
        task = asyncio.create_task(_ticker())
        try:
            yield
        finally:
            task.cancel()
            decoders.shutdown(wait=True)

    async def _ticker() -> None:
        last = None
        while True:
            await asyncio.sleep(tick_interval_s)
            try:
                await run_in_threadpool(coord.tick)
                last = None
            except ApiError as e:          # e.g. the policy needs more devices: say it once
                if str(e) != last:
                    log.warning("automatic round not opened", extra={"fields": {"reason": str(e)}})
                    last = str(e)
            except Exception:              # pragma: no cover - keep ticking, but say why
                log.exception("tick failed")

    async def _spooled(request: Request, limit: int, work: Any, *args: Any) -> Any:
        """Receive the body into a spool file, then run ``work(*args, body)`` on one of the
        ``decode_workers`` threads."""
        require_media_type(request, MEDIA_TYPE)
        # The spool file is opened once the body's turn comes: a burst of uploads then holds
        # receive_workers files, not one per waiting connection (py-spy: opening 200 at once
        # was a visible share of the event loop's burst work).
        async with receive_slots:             # the body deadline starts when its turn comes
            f = tempfile.TemporaryFile(dir=coord.layout.root, prefix=".spool-")
            try:
                await receive_body(request, limit, body_timeout_s, f)
            except BaseException:
                f.close()
                raise
        with f:
            def _run() -> Any:
                f.seek(0)
                return work(*args, f.read())
            return await asyncio.get_running_loop().run_in_executor(decoders, _run)

    app = FastAPI(title="fedfs aggregation server", version=API_VERSION, lifespan=lifespan,
                  description="FedAvg rounds for FedFS / FedUV devices. Tensors travel as safetensors; "
                              "see docs/protocol.md.")
    app.add_middleware(_AccessLog)
    bearer = HTTPBearer(auto_error=False, description="device token, or the admin token for /v1/admin")

    def _is_admin(token: str | None) -> bool:
        return token is not None and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), admin_digest)

    def device(creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> str:
        return coord.authenticate(creds.credentials if creds else None)

    def admin(creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> str:
        if creds is None:
            raise Unauthorized("missing admin token", code="missing_token")
        if not _is_admin(creds.credentials):
            raise Unauthorized("invalid admin token", code="invalid_token")
        return "admin"

    def device_or_admin(creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> str:
        if creds is not None and _is_admin(creds.credentials):
            return "admin"
        return device(creds)

    def _close_if_unread(request: Request, headers: dict[str, str]) -> dict[str, str]:
        """An answer given before the body was read closes the connection: the unread rest
        of the body (up to 60 MiB from an unauthenticated client) is never drained."""
        has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
        if has_body and not getattr(request.state, "body_complete", False):
            headers["Connection"] = "close"
        return headers

    # errors → JSON {error, reason}; never a 5xx for bad input
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
        if isinstance(e, ClientGone):
            log.info("client disconnected mid-body", extra={"fields": {"path": request.url.path, "reason": e.reason}})
        return JSONResponse(e.to_json(), status_code=e.status, headers=_close_if_unread(request, headers))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, _: ClientDisconnect) -> JSONResponse:
        return await _api_error(request, ClientGone("the client disconnected before its body was complete"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        reason = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors())
        return JSONResponse({"error": "invalid_request", "reason": reason or "invalid request"}, status_code=422,
                            headers=_close_if_unread(request, {}))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        headers = dict(e.headers or {})               # keeps 405's Allow …
        if e.status_code == 405:                      # … listing every route of the path (GET and PUT
            allowed: set[str] = set()                 # /v1/admin/config are two routes)
            for route in app.router.routes:
                if route.matches(request.scope)[0] != Match.NONE:
                    allowed |= set(getattr(route, "methods", None) or ())
            if allowed:
                headers["Allow"] = ", ".join(sorted(allowed))
        return JSONResponse({"error": code, "reason": str(e.detail)}, status_code=e.status_code,
                            headers=_close_if_unread(request, headers))

    # ---- public ----
    @app.get("/health", response_model=Health, tags=["service"])
    async def health() -> dict[str, Any]:
        """Liveness; answered on the event loop without the coordinator's lock, so it stays
        fast while uploads are decoded or a round is aggregated."""
        return {"status": "ok", **coord.health()}

    if reg_digest is None:
        @app.post("/v1/devices", status_code=201, response_model=Registration, tags=["devices"])
        def register() -> dict[str, Any]:
            """Register a device: id, bearer token (shown once) and its unique FedUV base vector ``b_u``.
            Open: this server has no registration token."""
            return coord.register()
    else:
        @app.post("/v1/devices", status_code=201, response_model=Registration, responses=_errors(401),
                  tags=["devices"])
        def register(creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> dict[str, Any]:
            """Register a device: id, bearer token (shown once) and its unique FedUV base vector ``b_u``.
            The bearer token must be the server's registration token."""
            token = creds.credentials if creds else ""
            if not hmac.compare_digest(hashlib.sha256(token.encode()).digest(), reg_digest):
                raise Unauthorized("registration needs the server's registration token", code="registration_token")
            return coord.register()

    # ---- devices ----
    @app.get("/v1/task", response_model=Task, response_model_exclude_none=True, responses=_errors(401), tags=["devices"])
    def task(device_id: str = Security(device)) -> dict[str, Any]:
        """What this device should do now: ``train`` (with the round's task), ``wait`` or ``done``."""
        return coord.task_for(device_id)

    @app.get("/v1/models/latest", response_model=ModelInfo, responses=_errors(401, 404), tags=["models"])
    def latest_model(_: str = Security(device_or_admin)) -> dict[str, Any]:
        return coord.model_info()

    @app.get("/v1/models/{version}", responses={200: {"content": {MEDIA_TYPE: {}}}, **_errors(401, 404, 422)}, tags=["models"],
             response_class=FileResponse)
    def model_file(version: int = Path(ge=1, le=MAX_ID), _: str = Security(device_or_admin)) -> FileResponse:
        """A published global version: a fedfs checkpoint in safetensors (``X-FedFS-SHA256`` header)."""
        path, sha = coord.model_file(version)
        return FileResponse(path, media_type=MEDIA_TYPE, headers={"X-FedFS-SHA256": sha, "ETag": f'"{sha}"'})

    @app.get("/v1/models/{version}/top", responses={200: {"content": {MEDIA_TYPE: {}}}, **_errors(401, 404, 422)},
             tags=["models"], response_class=FileResponse)
    def model_top_file(version: int = Path(ge=1, le=MAX_ID), _: str = Security(device_or_admin)) -> FileResponse:
        """A version's top-only body (``fedfs-model-top/1``) where its trunk is ξ's: a device puts ξ's trunk
        under it (``fedfs_sdk/federation/model_top.py``); the round task names its sha256."""
        path, sha = coord.model_top_file(version)
        return FileResponse(path, media_type=MEDIA_TYPE, headers={"X-FedFS-SHA256": sha, "ETag": f'"{sha}"'})

    @app.get("/v1/xi", responses={200: {"content": {MEDIA_TYPE: {}}}, **_errors(401, 404)}, tags=["models"],
             response_class=FileResponse)
    def xi(_: str = Security(device_or_admin)) -> FileResponse:
        """The frozen pre-trained model ξ for FedFS methods (read-only), if the server has one."""
        sha = coord.xi_sha256()
        if sha is None or not coord.layout.xi.is_file():
            raise NotFound("this server serves no ξ; give the device --xi", code="no_xi")
        return FileResponse(coord.layout.xi, media_type=MEDIA_TYPE, headers={"X-FedFS-SHA256": sha, "ETag": f'"{sha}"'})

    @app.get("/v1/impostors", responses={200: {"content": {"application/octet-stream": {}}}, **_errors(401, 404)},
             tags=["models"], response_class=FileResponse)
    def impostors(_: str = Security(device_or_admin)) -> FileResponse:
        """The public impostor set shipped with the model (``fedfs impostors``; photos of public
        identities), for the devices' do-no-harm check, if the server has one."""
        from .impostor_store import impostors_path, impostors_sha256

        sha = impostors_sha256(coord)
        if sha is None:
            raise NotFound("this server ships no public impostor set", code="no_impostors")
        return FileResponse(impostors_path(coord), media_type="application/octet-stream",
                            headers={"X-FedFS-SHA256": sha, "ETag": f'"{sha}"'})

    @app.put("/v1/rounds/{round_id}/update", response_model=Receipt,
             responses=_errors(400, 401, 403, 404, 408, 409, 410, 413, 415, 422), tags=["rounds"],
             openapi_extra=_BINARY_BODY)
    async def upload(request: Request, round_id: int = Path(ge=1, le=MAX_ID), device_id: str = Security(device)) -> dict[str, Any]:
        """Upload ``w_c`` + ``|D_c|`` (a ``fedfs-update/1`` safetensors body). Idempotent:
        the same body again returns the same receipt with ``duplicate: true``. The token,
        the round and the sampling are checked before the body is read."""
        require_media_type(request, MEDIA_TYPE)
        await run_in_threadpool(coord.check_upload, device_id, round_id)
        model = coord.model
        limit = max_body_bytes if model is None else min(max_body_bytes, model.nbytes + HEADER_SLACK_BYTES)
        return await _spooled(request, limit, coord.submit_update, device_id, round_id)

    @app.get("/v1/rounds/current", response_model=ServerStatus, responses=_errors(401), tags=["rounds"])
    def current_round(_: str = Security(device_or_admin)) -> dict[str, Any]:
        return coord.status()

    @app.get("/v1/rounds/{round_id}", response_model=RoundStatus, responses=_errors(401, 404, 422), tags=["rounds"])
    def round_status(round_id: int = Path(ge=1, le=MAX_ID), _: str = Security(device_or_admin)) -> dict[str, Any]:
        return coord.round_status(round_id)

    # ---- admin ----
    @app.get("/v1/admin/config", tags=["admin"], responses=_errors(401))
    def get_config(_: str = Security(admin)) -> dict[str, Any]:
        return coord.policy.to_json()

    @app.put("/v1/admin/config", tags=["admin"], responses=_errors(400, 401, 408, 409, 413, 415, 422),
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": POLICY_CHANGES_SCHEMA}}}})
    async def put_config(request: Request, _: str = Security(admin)) -> dict[str, Any]:
        """Change round-policy settings (partial object); applies from the next round. A
        ``method`` the global model cannot run is refused (409 ``model_method_mismatch``).
        The admin token is checked before the body (at most 64 KiB) is read."""
        require_media_type(request, "application/json")
        buf = io.BytesIO()
        await receive_body(request, MAX_CONFIG_BYTES, body_timeout_s, buf)
        try:
            changes = json.loads(buf.getvalue())
        except (ValueError, RecursionError) as e:
            raise Unprocessable(f"the body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
        if not isinstance(changes, dict):
            raise Unprocessable(f"the body must be a JSON object of policy settings, got {type(changes).__name__}",
                                code="invalid_policy")
        return await run_in_threadpool(coord.set_policy, changes)

    @app.post("/v1/admin/model", response_model=ModelInfo, responses=_errors(400, 401, 408, 409, 413, 415, 422),
              tags=["admin"], openapi_extra=_BINARY_BODY)
    async def install_model(request: Request, method: Literal["feduv", "fedfs", "fedfs+feduv"] | None = Query(
            None, description="also switch the policy's method to this one, in the same step"),
            _: str = Security(admin)) -> dict[str, Any]:
        """Publish a fedfs checkpoint (safetensors) as the next global version (no round open).
        It must fit the policy's method (or ``method``): else 409 ``model_method_mismatch``."""
        return await _spooled(request, max_body_bytes, lambda body: coord.install_model(body, method))

    @app.post("/v1/admin/rounds", status_code=201, response_model=RoundStatus, responses=_errors(401, 409), tags=["admin"])
    def open_round(_: str = Security(admin)) -> dict[str, Any]:
        return coord.open_round()

    @app.post("/v1/admin/rounds/{round_id}/close", response_model=RoundStatus,
              responses=_errors(401, 404, 409, 422), tags=["admin"])
    def close_round(round_id: int = Path(ge=1, le=MAX_ID), _: str = Security(admin)) -> dict[str, Any]:
        """Close an open round now: aggregate if it has ``min_updates``, else mark it failed."""
        return coord.close_round(round_id)

    install_secagg_routes(app, coord, device, _errors, body_timeout_s, receive_slots)
    install_stats_routes(app, coord, device, admin, _errors, body_timeout_s, receive_slots)   # statistics (issue 29)
    return app


__all__ = ["create_app", "ErrorBody", "Health", "Registration", "Task", "Receipt", "RoundStatus", "ServerStatus",
           "ModelInfo"]
