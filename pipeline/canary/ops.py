"""Operator actions on canaries, shared by the CLI (``hourglass canary``) and the ops API
(``GET /canary``, ``POST /canary/{model}/promote``, ``POST /canary/{model}/abort``, each POST with an
optional ``?reason=`` recorded with the decision)."""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from fastapi import FastAPI, HTTPException, Query

from pipeline.api_errors import registry_call
from pipeline.canary import state
from pipeline.canary.monitor import CanaryMonitor
from pipeline.config import HourglassConfig


class Reconciler(Protocol):
    """The serving controller as the canary endpoints use it: wake its reconcile loop."""

    def trigger(self) -> None: ...


class CanaryHost(Protocol):
    """What the canary endpoints use of the running service (:class:`pipeline.ops_service.OpsService`
    provides it), typed here so that this room does not import the service's Protocol module."""

    @property
    def cfg(self) -> HourglassConfig: ...

    @property
    def canary(self) -> CanaryMonitor | None: ...

    @property
    def controller(self) -> Reconciler | None: ...


Reason = Annotated[str | None, Query(max_length=500, description="Why, recorded with the decision.")]
"""The optional ``?reason=`` of ``POST /canary/{model}/promote|abort`` (module level: FastAPI resolves it by name)."""


def canary_status(cfg: HourglassConfig, models: list[str], monitor: CanaryMonitor | None = None) -> dict[str, Any]:
    """``{model: {"canary": view | None, "guard": view | None}}``, read-only (nothing moves).

    The view has the version, champion, fraction, started_at, per-side counts and
    rates (``challenger`` / ``champion``: n, mean, var), the interval
    (``lower``/``upper`` of challenger minus champion) and the decision so far.

    Raises:
        MlflowException: MLflow unreachable.
    """
    monitor = monitor or CanaryMonitor(cfg, models=models)
    out: dict[str, Any] = {}
    for model in models:
        canary = monitor.check_canary(model, act=False)
        guard = monitor.status().get(model, {}).get("guard")
        out[model] = {"canary": canary, "guard": guard}
    return out


def end_canary(
    cfg: HourglassConfig,
    model: str,
    decision: str,
    *,
    who: str,
    monitor: CanaryMonitor | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """Promote or abort ``model``'s canary by hand, with the live evidence so far attached; the version's
    ``hourglass.canary_result`` reason is ``"<decision> by <who>"``, then ``": <note>"`` when given.

    With no champion (the canary compares the challenger with the base), promote makes the challenger
    the first ``@champion``; abort leaves the base serving everything.

    Raises:
        NoCanaryError: no version is on canary. ValueError: ``decision`` is not promote/abort.
    """
    if decision not in ("promote", "abort"):
        raise ValueError(f"decision must be 'promote' or 'abort', got {decision!r}")
    monitor = monitor or CanaryMonitor(cfg, models=[model])
    evidence = monitor.check_canary(model, act=False)
    if evidence is None:
        raise state.NoCanaryError(
            f"model {model!r} has no version on canary (no @{cfg.serving.canary.alias}); see `hourglass canary status`"
        )
    reason = f"{decision} by {who}" + (f": {note}" if note else "")
    act = state.promote_challenger if decision == "promote" else state.abort_challenger
    out = act(cfg, model, client=monitor.client, reason=reason, evidence=evidence)
    from pipeline.canary.monitor import OUTCOMES

    OUTCOMES.labels(model, f"manual_{decision}").inc()
    return out


def add_canary_routes(app: FastAPI, service: CanaryHost) -> None:
    """``GET /canary`` (a read), ``POST /canary/{model}/promote|abort`` (state changes: the ops API's
    middleware requires the token for every POST before any route runs, see :mod:`pipeline.api`)."""

    def _models() -> list[str]:
        return sorted({c.served_model for c in service.cfg.candidates} | {service.cfg.serving.model_name})

    @app.get("/canary")
    def canary() -> dict[str, Any]:
        return registry_call(lambda: canary_status(service.cfg, _models(), service.canary))

    def _end(model: str, decision: str, reason: str | None) -> dict[str, Any]:
        if model not in _models():
            raise HTTPException(404, f"model {model!r} is not served here; served: {_models()}")
        out = registry_call(
            lambda: end_canary(service.cfg, model, decision, who="ops api", monitor=service.canary, note=reason)
        )
        if service.controller is not None:
            service.controller.trigger()
        return out

    @app.post("/canary/{model}/promote")
    def promote(model: str, reason: Reason = None) -> dict[str, Any]:
        return _end(model, "promote", reason)

    @app.post("/canary/{model}/abort")
    def abort(model: str, reason: Reason = None) -> dict[str, Any]:
        return _end(model, "abort", reason)
