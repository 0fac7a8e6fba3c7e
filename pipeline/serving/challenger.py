"""The serving controller's canary step: load ``@challenger`` beside the champion and route a share to it.

Called by :meth:`pipeline.serving.controller.ServingController.reconcile_once` after the
champion's own step, for each served model. The challenger goes through the
same checks as a champion (stage: checksums, safetensors, base fingerprint,
rank; load under ``<model>-v<version>``; probe on every replica) before the
route gains it: ``Route.challenger_served_name``, ``challenger_version`` and
``fraction``. If staging, load or probe fail for the adapter, the version is
tagged ``hourglass.serve_error`` and ``hourglass.canary_result``,
``@challenger`` is dropped and the champion keeps all traffic. When the alias
goes away (promoted, aborted, moved by hand) the route loses the challenger
and its copy is unloaded after ``serving.drain_s``.

A model with no ``@champion`` yet is served by the base model (the gateway
sends its public name to ``serving.base_served_name`` when it has no route).
Its challenger is then compared with the base: the route written names the
base (``served_name`` = ``serving.base_served_name``, ``version`` None) and the
challenger beside it, so the base keeps ``1 - fraction`` of the users and its
traces record ``adapter_version`` null. When that canary ends by an abort the
route is removed again (the base serves everything, as before); a promotion
makes the challenger the champion, whose own step replaces the route.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from mlflow.entities.model_registry import ModelVersion
from mlflow.tracking import MlflowClient

from connectors.gateway.routes import Route, read_routes, remove_route, write_route
from pipeline.registry.aliases import TAG_SERVE_ERROR
from pipeline.canary import state
from pipeline.config import HourglassConfig
from pipeline.serving.common import AdapterFailure, ModelStatus, utc_now
from pipeline.serving.replica import ReplicaControl, ReplicaRefusedError
from pipeline.serving.staging import served_name

log = logging.getLogger(__name__)


class ServingHost(Protocol):
    """What this step uses of the serving controller (:class:`pipeline.serving.controller.ServingController`,
    which calls it): typed here so that the step does not import the controller."""

    cfg: HourglassConfig
    client: MlflowClient
    state_dir: Path
    _status: dict[str, ModelStatus]
    _draining: dict[str, float]  # served name -> monotonic deadline for its unload

    def _observe(self, st: ModelStatus) -> dict[ReplicaControl, set[str]]: ...

    def _load_on(
        self, model: str, version: str, replicas: list[ReplicaControl], mv: ModelVersion | None = None
    ) -> list[ReplicaControl]: ...


def reconcile_challenger(ctrl: "ServingHost", model: str) -> None:
    """One pass of the canary for ``model`` (see the module doc). Raises what MLflow raises when unreachable."""
    cfg = ctrl.cfg
    st = ctrl._status[model]
    route = read_routes(ctrl.state_dir, strict=True).get(model)
    want = state.challenger_version(ctrl.client, cfg, model)
    if want is not None and route is not None and want == route.version:
        state._drop_alias(ctrl.client, cfg, model)  # it became the champion by other means: nothing to compare
        want = None
    if want is not None and st.desired is None and (route is None or route.version is None):
        route = route or base_route(ctrl)  # no champion: the base, as served without a route, is the other side
    if want is None or route is None or route.version != st.desired:
        # no canary, or no champion served yet, or the champion itself is changing: champion only for now
        if route is not None and route.challenger_served_name is not None and want != route.challenger_version:
            _drop_from_route(ctrl, model, route)
        st.challenger = None if want is None else {"version": want, "state": "waiting for the champion to be served"}
        return
    name = served_name(model, want)
    mv = ctrl.client.get_model_version(model, want)
    if TAG_SERVE_ERROR in mv.tags:
        _refuse(ctrl, model, want, mv.tags[TAG_SERVE_ERROR], route)
        return
    seen = ctrl._observe(st)
    if not seen:
        return
    fraction = cfg.serving.canary.fraction
    if route.challenger_version != want:
        started = time.monotonic()
        need = [r for r, names in seen.items() if name not in names]
        try:
            ready = ctrl._load_on(model, want, need, mv)
            for replica in [r for r in seen if r not in need]:
                replica.probe(name)
                ready.append(replica)
        except (AdapterFailure, ReplicaRefusedError) as err:
            _refuse(ctrl, model, want, str(err), route)
            return
        if not ready:
            return
        old = route.challenger_served_name
        write_route(
            ctrl.state_dir,
            model,
            replace(
                route, updated_at=utc_now(), challenger_served_name=name, challenger_version=want, fraction=fraction
            ),
        )
        if old is not None and old != name:
            ctrl._draining[old] = time.monotonic() + cfg.serving.drain_s
        log.info(
            "canary: %s v%s serves %.0f%% of %s's traffic as %s (%.2fs)",
            model,
            want,
            100 * fraction,
            model,
            name,
            time.monotonic() - started,
        )
    else:
        missing = [r for r, names in seen.items() if name not in names]
        if missing:  # a replica restarted or was added
            try:
                ctrl._load_on(model, want, missing, mv)
            except AdapterFailure as err:
                st.last_error, st.last_error_version = str(err), want
        if route.fraction != fraction:
            write_route(ctrl.state_dir, model, replace(route, updated_at=utc_now(), fraction=fraction))
    st.challenger = {"version": want, "served_name": name, "fraction": fraction}


def base_route(ctrl: "ServingHost") -> Route:
    """The route of a model served by the base (no champion): what the gateway does without a route."""
    return Route(served_name=ctrl.cfg.serving.base_served_name, version=None, updated_at=utc_now())


def _drop_from_route(ctrl: "ServingHost", model: str, route: Route) -> None:
    if route.version is None:  # the base's side of a first canary: back to no route, the base serves all
        remove_route(ctrl.state_dir, model)
    else:
        write_route(
            ctrl.state_dir,
            model,
            replace(route, updated_at=utc_now(), challenger_served_name=None, challenger_version=None, fraction=0.0),
        )
    if route.challenger_served_name is not None and route.challenger_served_name != route.served_name:
        ctrl._draining[route.challenger_served_name] = time.monotonic() + ctrl.cfg.serving.drain_s
    log.info("canary: %s v%s no longer routed", model, route.challenger_version)


def _refuse(ctrl: "ServingHost", model: str, version: str, reason: str, route: Route) -> None:
    """The challenger cannot be served: tag it, drop ``@challenger``, keep the champion serving."""
    st = ctrl._status[model]
    log.error("canary: not serving %s v%s: %s", model, version, reason)
    st.last_error, st.last_error_version, st.challenger = f"challenger v{version}: {reason}", version, None
    ctrl.client.set_model_version_tag(model, version, TAG_SERVE_ERROR, reason[:4900])
    if state.challenger_version(ctrl.client, ctrl.cfg, model) == version:
        state.abort_challenger(ctrl.cfg, model, client=ctrl.client, reason=f"could not be served: {reason}")
    if route.challenger_version == version:
        _drop_from_route(ctrl, model, route)
