"""The ops HTTP API (FastAPI).

Access rules are enforced before any route runs by :class:`pipeline.api_guard.OpsGuard` (so before a
body is parsed: malformed JSON without a token is a 401, never a 422): the Host header must name the
API (DNS-rebinding defence: 421, more than one Host header 400); a state-changing call (any method but
GET/HEAD) from another site or origin (``Sec-Fetch-Site``, ``Origin``) is a 403, needs
``Authorization: Bearer <token>`` (``api.token`` / ``HOURGLASS_API__TOKEN``, or the token the service
wrote to ``<state_dir>/api-token`` at start; missing or Basic credentials 401, wrong 403) and a UTF-8
JSON body or none (form types 415, ``api.max_body_bytes`` 413); when ``api.host`` is not a loopback
address every read needs the token too, except ``/healthz``, ``/metrics`` and ``/readyz``, which then
answers only ``{"ready": bool}``. Request heads are limited by the server (:mod:`connectors.edge`).

Everything served goes through :func:`pipeline.redact.redact_data` (no
credentials in URIs), and the expensive views (``/status``,
``/buffer/stats``, ``/readyz``: buffer listing, replica probes, MLflow calls)
are cached for ``CACHE_S`` seconds.

| method | path | what |
| --- | --- | --- |
| GET | /healthz | the process is up |
| GET | /readyz | per check: each worker (ingest, scheduler, reconcile, canary) running, ingest storage, MLflow and vLLM reachable (503 otherwise) |
| GET | /metrics | Prometheus exposition |
| GET | /status | rounds, champions, ingest, buffer, next scheduled round, workers (state, restarts, last error) |
| GET | /rounds, /rounds/{id} | round records |
| POST | /rounds | trigger a retrain: ``{"candidates": [...], "window": "6h", "until": "<ISO time>"}`` → 202; 409 while one runs |
| POST | /rounds/{id}/cancel | stop the running round at its next boundary (training steps, evaluation batches, phases); 409 once it registers |
| POST | /promote | ``{"model": ..., "version": "3"}`` move ``@champion`` |
| POST | /rollback | ``{"model": ..., "to": null}`` back to the previous champion |
| GET | /buffer/stats | rows, partitions, bytes, reward coverage |
| GET | /, /console/panels, /console/data | the status page and its data (:mod:`pipeline.console`; viewing rule there) |
| GET | /canary | each model's canary: version, fraction, live counts and rates, bound, decision so far |
| POST | /canary/{model}/promote, /canary/{model}/abort | end a canary by hand (the evidence is attached; optional `?reason=` is recorded with it) |
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.api_errors import registry_call as _registry_call
from pipeline.api_guard import OpsGuard, host_allowed  # noqa: F401  (host_allowed: re-exported)
from pipeline.console import mount_console
from pipeline.redact import redact_data
from pipeline.rounds.job import RoundNotCancellableError
from pipeline.rounds.until import parse_until
from pipeline.rounds.records import RoundInProgressError, UnknownRoundError

if TYPE_CHECKING:
    from pipeline.ops_service import OpsService

CACHE_S = 2.0
MAX_DETAIL_CHARS = 500  # an error message quotes what the client sent: at most this much of it


class TtlCache:
    """``get(key, compute)``: the value computed at most ``ttl_s`` seconds ago, else a fresh one (thread-safe)."""

    def __init__(self, ttl_s: float = CACHE_S) -> None:
        self.ttl_s = ttl_s
        self._values: dict[str, tuple[float, Any]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # one computation per key at a time: a burst of calls costs one buffer listing
            if key in self._values and time.monotonic() - self._values[key][0] < self.ttl_s:
                return self._values[key][1]
            value = compute()
            self._values[key] = (time.monotonic(), value)
            return value


def _until(value: object) -> datetime:
    """``until`` as ISO 8601 text only (:func:`~pipeline.rounds.until.parse_until`): pydantic's own datetime parsing
    reads a number, or text of digits like "2026", as seconds since 1970."""
    if not isinstance(value, str):
        raise ValueError("until is ISO 8601 text with a time zone, e.g. 2026-12-06T14:00:00Z")
    return parse_until(value)


class RetrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    candidates: list[str] | None = Field(
        default=None,
        min_length=1,
        description="Subset of configured candidates; all when omitted (an empty list is refused, not read as all).",
    )
    window: str | None = Field(
        default=None,
        pattern=r"^[0-9]{1,6}[smhd]$",  # ASCII digits only: the regex engine's \d also matches "٣"
        description="Data window, e.g. 6h; rl.window when omitted.",
    )
    until: Annotated[datetime, BeforeValidator(_until)] | None = Field(
        default=None,
        description="Replay: train on the window that ended at this past time (ISO 8601 with a time zone, e.g. "
        "2026-12-06T14:00:00Z) instead of the one ending now: nothing dated after it, implicit signals judged then.",
    )


MODEL_NAME = Field(
    default=None,
    min_length=1,
    max_length=256,
    description="Served model name; the default model (serving.model_name) when omitted (an empty name is refused).",
)


def _version(value: str) -> str:
    """A registry version: 1 to 18 ASCII digits ("١" is no version; 19 digits may not fit MLflow's int64)."""
    if not (value.isascii() and value.isdigit() and len(value) <= 18):
        raise ValueError(f"a model version is 1 to 18 ASCII digits (0-9), got {value[:40]!r}")
    return value


Version = Annotated[str, AfterValidator(_version)]


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = MODEL_NAME
    version: Version


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = MODEL_NAME
    to: Version | None = None


def create_api(service: OpsService) -> FastAPI:
    """The ops API bound to one running service."""
    api_cfg = service.cfg.api
    loopback = api_cfg.loopback()
    names = api_cfg.host_names()
    cache = TtlCache()
    app = FastAPI(title="Hourglass ops API", version="1")

    app.add_middleware(
        OpsGuard,  # Host, cross-site, token and body rules before any route (pipeline.api_guard)
        token=lambda: service.api_token,
        loopback=loopback,
        names=names,
        max_body_bytes=api_cfg.max_body_bytes,
        body_timeout_s=api_cfg.body_timeout_s,
    )

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz(request: Request, response: Response) -> dict[str, Any]:
        checks = cache.get("readiness", service.readiness)
        if not all(checks.values()):
            response.status_code = 503
        if not request.state.authenticated:  # details (hosts, URLs) only with the token off loopback
            return {"ready": all(checks.values())}
        return {"ready": all(checks.values()), "checks": redact_data(checks)}

    @app.get("/metrics")
    def metrics() -> Response:
        cache.get("gauges", service.refresh_gauges)  # reads the buffer: at most once per CACHE_S
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    def status() -> dict[str, Any]:
        return cache.get("status", lambda: redact_data(service.status()))

    @app.get("/rounds")
    def rounds(limit: int = 20) -> list[dict[str, Any]]:
        return redact_data([r.as_dict() for r in service.runner.store.list(limit=max(1, min(limit, 500)))])

    @app.get("/rounds/{round_id}")
    def round_show(round_id: str) -> dict[str, Any]:
        try:
            return redact_data(service.runner.store.get(round_id).as_dict())
        except UnknownRoundError as err:
            raise HTTPException(404, str(err)) from err

    @app.post("/rounds", status_code=202)
    def retrain(body: RetrainRequest) -> dict[str, Any]:
        try:
            return service.runner.start("api", body.candidates, body.window, body.until).as_dict()
        except RoundInProgressError as err:
            raise HTTPException(409, str(err)) from err
        except ValueError as err:
            raise HTTPException(422, str(err)) from err

    @app.post("/rounds/{round_id}/cancel", status_code=202)
    def cancel(round_id: str) -> dict[str, Any]:
        if service.runner.current != round_id:
            raise HTTPException(409, f"round {round_id!r} is not running (running: {service.runner.current})")
        try:
            service.runner.cancel()
        except RoundNotCancellableError as err:  # from register on the round runs to its end
            raise HTTPException(409, str(err)) from err
        return {"round_id": round_id, "cancel_requested": True}

    @app.post("/promote")
    def promote(body: PromoteRequest) -> dict[str, Any]:
        return _registry_call(lambda: service.promote(body.model, body.version))

    @app.post("/rollback")
    def rollback(body: RollbackRequest) -> dict[str, Any]:
        return _registry_call(lambda: service.rollback(body.model, body.to))

    @app.get("/buffer/stats")
    def buffer_stats() -> dict[str, Any]:
        return cache.get("buffer", lambda: redact_data(service.buffer_stats()))

    from pipeline.canary.ops import add_canary_routes

    add_canary_routes(app, service)  # GET /canary, POST /canary/{model}/promote|abort (the middleware checks the token)

    @app.exception_handler(RequestValidationError)
    def _invalid(_: Request, err: RequestValidationError) -> Response:
        # FastAPI's own answer echoes each error's input: NaN or Infinity there made it a 500 (not JSON), and a
        # 60 KB field came back whole. The field's path, type and message are what a client needs.
        detail = [
            {"loc": list(e["loc"]), "type": e["type"], "msg": e["msg"][:MAX_DETAIL_CHARS]} for e in err.errors()[:20]
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> Response:
        if isinstance(err.detail, str) and len(err.detail) > MAX_DETAIL_CHARS:  # e.g. a 5,000-character round id
            err = StarletteHTTPException(err.status_code, err.detail[:MAX_DETAIL_CHARS] + "...", err.headers)
        return await http_exception_handler(request, err)

    @app.exception_handler(RoundInProgressError)
    def _in_progress(_: Request, err: RoundInProgressError) -> Response:
        return Response(content=str(err), status_code=409)

    mount_console(app, service)  # the status page at / (pipeline.console)
    return app
