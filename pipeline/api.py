"""The ops HTTP API (FastAPI).

Read-only endpoints are open; anything that changes state needs
``Authorization: Bearer <token>`` (``api.token`` / ``HOURGLASS_API__TOKEN``, or
the token the service wrote to ``<state_dir>/api-token`` at start). The
service binds to loopback by default (``api.host``).

| method | path | what |
| --- | --- | --- |
| GET | /healthz | the process is up |
| GET | /readyz | ingest, scheduler, MLflow and vLLM reachable (503 otherwise) |
| GET | /metrics | Prometheus exposition |
| GET | /status | rounds, champions, ingest, buffer, next scheduled round |
| GET | /rounds, /rounds/{id} | round records |
| POST | /rounds | trigger a retrain: ``{"candidates": [...], "window": "6h"}`` → 202; 409 while one runs |
| POST | /rounds/{id}/cancel | stop the running round at its next boundary (between training steps or phases) |
| POST | /promote | ``{"model": ..., "version": "3"}`` move ``@champion`` |
| POST | /rollback | ``{"model": ..., "to": null}`` back to the previous champion |
| GET | /buffer/stats | rows, partitions, bytes, reward coverage |
| GET | /, /console/panels, /console/data | the status page and its data (:mod:`pipeline.console`; viewing rule there) |
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from pipeline.console import mount_console
from pipeline.console.data import redact
from pipeline.rounds import RoundInProgressError, UnknownRoundError

if TYPE_CHECKING:
    from pipeline.service import HourglassService

_bearer = HTTPBearer(auto_error=False)


class RetrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    candidates: list[str] | None = Field(default=None, description="Subset of configured candidates; all when omitted.")
    window: str | None = Field(default=None, pattern=r"^\d+[smhd]$", description="Data window, e.g. 6h; rl.window when omitted.")


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    version: str = Field(pattern=r"^\d+$")


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    to: str | None = Field(default=None, pattern=r"^\d+$")


def create_api(service: "HourglassService") -> FastAPI:
    """The ops API bound to one running service."""
    app = FastAPI(title="Hourglass ops API", version="1")

    def require_token(credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        expected = service.api_token
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise HTTPException(401, "this call changes state: send Authorization: Bearer <token>", headers={"WWW-Authenticate": "Bearer"})
        if not secrets.compare_digest(credentials.credentials.encode(), expected.encode()):
            raise HTTPException(403, "wrong API token")

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz(response: Response) -> dict[str, Any]:
        checks = service.readiness()
        if not all(checks.values()):
            response.status_code = 503
        return {"ready": all(checks.values()), "checks": checks}

    @app.get("/metrics")
    def metrics() -> Response:
        service.refresh_gauges()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    def status() -> dict[str, Any]:
        return service.status()

    @app.get("/rounds")
    def rounds(limit: int = 20) -> list[dict[str, Any]]:
        return [r.as_dict() for r in service.runner.store.list(limit=max(1, min(limit, 500)))]

    @app.get("/rounds/{round_id}")
    def round_show(round_id: str) -> dict[str, Any]:
        try:
            return service.runner.store.get(round_id).as_dict()
        except UnknownRoundError as err:
            raise HTTPException(404, str(err)) from err

    @app.post("/rounds", status_code=202, dependencies=[Depends(require_token)])
    def retrain(body: RetrainRequest) -> dict[str, Any]:
        try:
            return service.runner.start("api", body.candidates, body.window).as_dict()
        except RoundInProgressError as err:
            raise HTTPException(409, str(err)) from err
        except ValueError as err:
            raise HTTPException(422, str(err)) from err

    @app.post("/rounds/{round_id}/cancel", status_code=202, dependencies=[Depends(require_token)])
    def cancel(round_id: str) -> dict[str, Any]:
        if service.runner.current != round_id:
            raise HTTPException(409, f"round {round_id!r} is not running (running: {service.runner.current})")
        service.runner.cancel()
        return {"round_id": round_id, "cancel_requested": True}

    @app.post("/promote", dependencies=[Depends(require_token)])
    def promote(body: PromoteRequest) -> dict[str, Any]:
        return _registry_call(lambda: service.promote(body.model, body.version))

    @app.post("/rollback", dependencies=[Depends(require_token)])
    def rollback(body: RollbackRequest) -> dict[str, Any]:
        return _registry_call(lambda: service.rollback(body.model, body.to))

    @app.get("/buffer/stats")
    def buffer_stats() -> dict[str, Any]:
        return service.buffer_stats()

    @app.exception_handler(RoundInProgressError)
    def _in_progress(_: Request, err: RoundInProgressError) -> Response:
        return Response(content=str(err), status_code=409)

    mount_console(app, service)  # the status page at / (pipeline.console)
    return app


def _registry_call(call) -> dict[str, Any]:
    """Run a registry call; its errors become 4xx/502 refusals whose detail has URL credentials,
    secret query parameters and bearer tokens replaced by ``***`` (MLflow's messages quote the
    request URL, ``user:password@`` of the tracking URI included)."""
    from mlflow.exceptions import MlflowException

    from pipeline.aliases import UnknownVersionError
    from pipeline.registry import RegistryError

    try:
        return call()
    except UnknownVersionError as err:
        raise HTTPException(404, redact(str(err))) from err
    except LookupError as err:
        raise HTTPException(404, redact(str(err))) from err
    except RegistryError as err:  # e.g. no earlier champion to roll back to
        raise HTTPException(409, redact(str(err))) from err
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":  # e.g. nothing registered yet for this model
            raise HTTPException(404, redact(err.message)) from err
        raise HTTPException(502, f"MLflow: {redact(err.message)}") from err
