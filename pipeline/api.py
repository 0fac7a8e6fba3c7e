"""The ops HTTP API (FastAPI).

Access rules, enforced by one middleware before any route runs (so before a
body is parsed: malformed JSON without a token is a 401, never a 422):

- the token is ``Authorization: Bearer <token>`` (``api.token`` /
  ``HOURGLASS_API__TOKEN``, or the token the service wrote to
  ``<state_dir>/api-token`` at start); missing → 401, wrong → 403;
- every state-changing call (any method but GET/HEAD) needs it;
- when ``api.host`` is not a loopback address, every read needs it too,
  except ``/healthz``, ``/metrics`` and ``/readyz``, which then answers only
  ``{"ready": bool}`` (its per-check details need the token);
- the Host header must name the API (DNS-rebinding defence): an IP literal,
  127.0.0.1, localhost, ::1, ``api.host`` or one of ``api.allowed_hosts``;
  any other name gets 421, more than one Host header 400. A rebinding attack always sends the attacker's
  domain name, never an IP, so probes addressing the pod IP keep working.

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
| POST | /rounds | trigger a retrain: ``{"candidates": [...], "window": "6h"}`` → 202; 409 while one runs |
| POST | /rounds/{id}/cancel | stop the running round at its next boundary (training steps, evaluation batches, phases); 409 once it registers |
| POST | /promote | ``{"model": ..., "version": "3"}`` move ``@champion`` |
| POST | /rollback | ``{"model": ..., "to": null}`` back to the previous champion |
| GET | /buffer/stats | rows, partitions, bytes, reward coverage |
| GET | /, /console/panels, /console/data | the status page and its data (:mod:`pipeline.console`; viewing rule there) |
| GET | /canary | each model's canary: version, fraction, live counts and rates, bound, decision so far |
| POST | /canary/{model}/promote, /canary/{model}/abort | end a canary by hand (the evidence is attached; optional `?reason=` is recorded with it) |
"""

from __future__ import annotations

import ipaddress
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from pipeline.api_errors import registry_call as _registry_call
from pipeline.console import mount_console, presented_token
from pipeline.redact import redact_data
from pipeline.rounds.job import RoundNotCancellableError
from pipeline.rounds.records import RoundInProgressError, UnknownRoundError

if TYPE_CHECKING:
    from pipeline.ops_service import OpsService

CACHE_S = 2.0
STATIC_PREFIX = "/console/static/"  # the status page's script and style sheet: no data, no secrets
OPEN_PATHS = frozenset({"/healthz", "/metrics", "/readyz"})  # readable without a token, whatever the bind address


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


def host_allowed(host_header: str | None, names: set[str]) -> bool:
    """True when the Host header (``name[:port]``) is an IP literal or one of ``names``."""
    if not host_header:
        return False
    host = host_header.strip(" \t").lower()  # HTTP whitespace only: "localhost\xa0" is another name
    if host.startswith("["):  # [::1]:8080; brackets hold an IPv6 literal only (RFC 3986 section 3.2.2)
        end = host.find("]")
        rest = host[end + 1 :] if end > 0 else ""
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isascii() and rest[1:].isdigit())):
            return False  # "[::1]evil" is no address: only a port may follow the bracket
        try:
            ipaddress.IPv6Address(host[1:end])
            return True
        except ValueError:
            return False  # "[localhost]" is no IPv6 literal
    if host.count(":") == 1:
        host, _, port = host.partition(":")
        if port and not (port.isascii() and port.isdigit()):
            return False  # "localhost:x": a port is digits, as after a bracket
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host in names


class RetrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    candidates: list[str] | None = Field(
        default=None,
        min_length=1,
        description="Subset of configured candidates; all when omitted (an empty list is refused, not read as all).",
    )
    window: str | None = Field(
        default=None, pattern=r"^\d+[smhd]$", description="Data window, e.g. 6h; rl.window when omitted."
    )


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    version: str = Field(pattern=r"^\d+$")


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    to: str | None = Field(default=None, pattern=r"^\d+$")


def create_api(service: OpsService) -> FastAPI:
    """The ops API bound to one running service."""
    api_cfg = service.cfg.api
    loopback = api_cfg.loopback()
    names = api_cfg.host_names()
    cache = TtlCache()
    app = FastAPI(title="Hourglass ops API", version="1")

    def token_state(request: Request) -> str:
        """'ok', 'missing' or 'wrong' for the request's token: ``Authorization: Bearer <token>``, or the
        password of HTTP Basic auth (what a browser sends for the status page; any user name)."""
        presented = presented_token(request)
        if not presented:
            return "missing"
        ok = secrets.compare_digest(presented.encode(), service.api_token.encode())
        return "ok" if ok else "wrong"

    @app.middleware("http")
    async def guard(request: Request, call_next):
        hosts = [value for key, value in request.scope["headers"] if key == b"host"]  # ASGI names are lowercase
        if len(hosts) > 1:  # Starlette reads the first, a proxy or cache may read the last: refuse, never guess
            return JSONResponse(
                {"detail": f"{len(hosts)} Host headers: send exactly one (the name or IP this API is addressed by)"},
                status_code=400,
            )
        if not host_allowed(request.headers.get("host"), names):
            return JSONResponse(
                {
                    "detail": "Host header not allowed: address the API by IP, localhost, api.host or a name in api.allowed_hosts"
                },
                status_code=421,
            )
        mutation = request.method not in ("GET", "HEAD")
        path = request.url.path
        if mutation or (not loopback and path not in OPEN_PATHS and not path.startswith(STATIC_PREFIX)):
            state = token_state(request)
            what = "this call changes state" if mutation else "this API is not on loopback: reads need the token too"
            if not mutation and (path == "/" or path.startswith("/console/")) and state != "ok":
                # the status page in a browser: ask for the token as the Basic-auth password
                return JSONResponse(
                    {"detail": f"{what}: the status page takes the API token as the password (any user name)"},
                    status_code=401,
                    headers={"WWW-Authenticate": 'Basic realm="hourglass console"'},
                )
            if state == "missing":
                return JSONResponse(
                    {"detail": f"{what}: send Authorization: Bearer <token>"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            if state == "wrong":
                return JSONResponse({"detail": "wrong API token"}, status_code=403)
        request.state.authenticated = loopback or token_state(request) == "ok"
        return await call_next(request)

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
            return service.runner.start("api", body.candidates, body.window).as_dict()
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

    @app.exception_handler(RoundInProgressError)
    def _in_progress(_: Request, err: RoundInProgressError) -> Response:
        return Response(content=str(err), status_code=409)

    mount_console(app, service)  # the status page at / (pipeline.console)
    return app
