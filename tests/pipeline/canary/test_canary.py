"""The canary end to end against real MLflow and a real vLLM (tiny model): a challenger users reject
is aborted while the champion keeps serving; a preferred one is promoted (the old champion unloaded
after draining); the guard rolls back a champion whose live rate drops; a restarted monitor resumes
from the buffer without counting anything twice; a model with no champion yet puts its first winner on
canary against the base (with the real gateway and broker: the traces say which side answered)."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from mlflow.tracking import MlflowClient

from connectors.buffer import RewardBuffer
from connectors.config import GatewayConfig, KafkaConfig
from connectors.gateway.app import TRACE_HEADER, create_gateway_app
from connectors.kafka_admin import ensure_topics
from connectors.schema import TraceEvent
from connectors.segments import Coordinates
from pipeline.registry import aliases
from pipeline.canary import state
from pipeline.canary.monitor import CanaryMonitor
from connectors.gateway.routes import RouteResolver
from pipeline.config import HourglassConfig
from pipeline.registry.models import register_round
from pipeline.serving.replica import Replica
from pipeline.serving.controller import ServingController
from connectors.gateway.routes import read_routes
from tests.pipeline.canary.test_canary_gateway import _traces
from tests.pipeline.serving_helpers import make_adapter, make_round, wait_for
from trainer.model.store import fingerprint_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fp(tiny_model: Path) -> str:
    return fingerprint_of(tiny_model)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("canary-adapters")
    return {name: make_adapter(tiny_model, root / name, seed=seed) for name, seed in (("a", 11), ("b", 12))}


def _config(tmp: Path, mlflow_uri: str, vllm: str) -> HourglassConfig:
    return HourglassConfig(
        state_dir=str(tmp / "state"),
        registry={"tracking_uri": mlflow_uri, "experiment": "hourglass-canary-tests", "embedded": False},
        buffer={"root": str(tmp / "buffer"), "dead_letter_root": str(tmp / "dlq")},
        serving={
            "replicas": [vllm],
            "reconcile_interval_s": 0.3,
            "drain_s": 0.3,
            "staging_dir": str(tmp / "staging"),
            "embedded": False,
            "max_lora_rank": 16,
            "canary": {"fraction": 0.5, "min_feedback": 20, "margin": 0.1, "alpha": 0.05, "check_interval_s": 0.2},
            "guard": {"period_s": 600, "alpha": 0.05},
        },
    )


@pytest.fixture
def made(vllm_tiny: str):
    controllers: list[tuple[ServingController, str]] = []
    yield controllers
    for controller, model in controllers:
        controller.close()
        for name in Replica(vllm_tiny).models():
            if name.startswith(f"{model}-v"):
                Replica(vllm_tiny).unload(name)


def _setup(cfg, model: str, fp: str, adapters, made) -> tuple[str, str, ServingController]:
    """v1 = @champion, v2 = @challenger, both served, the route split."""
    [v1] = register_round(cfg, make_round(adapters["a"], fp, round_id=f"{model}-1", model=model), promote=True)
    [v2] = register_round(cfg, make_round(adapters["b"], fp, round_id=f"{model}-2", model=model), promote=False)
    out = state.promote_or_challenge(cfg, model, v2.version, reason="test round")
    assert out["action"] == "challenger", out
    controller = ServingController(cfg, models=[model], base_fingerprint=fp)
    made.append((controller, model))
    controller.reconcile_once()
    controller.reconcile_once()
    route = read_routes(cfg.resolve(cfg.state_dir))[model]
    assert (route.version, route.challenger_version, route.fraction) == (v1.version, v2.version, 0.5)
    assert {route.served_name, route.challenger_served_name} <= set(Replica(cfg.serving.replicas[0]).models())
    return v1.version, v2.version, controller


def _feedback(
    cfg, model: str, version: str | None, ups: int, downs: int, *, trace_ids: list[str] | None = None
) -> list[str]:
    """Traces answered by ``version`` with inline thumbs, written to the buffer as ingestion does."""
    ids = trace_ids or [uuid.uuid4().hex for _ in range(ups + downs)]
    now = datetime.now(timezone.utc)
    events = [
        (
            TraceEvent(
                trace_id=tid,
                ts=now,
                model=model,
                adapter_version=version,
                prompt="hi",
                completion="ok",
                thumbs="up" if i < ups else "down",
            ),
            Coordinates("traces", 0, i),
        )
        for i, tid in enumerate(ids)
    ]
    RewardBuffer(cfg.buffer).append(events, [])
    return ids


def _complete(base_url: str, name: str) -> None:
    body = {"model": name, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).status_code == 200


def test_rejected_challenger_is_aborted_and_champion_keeps_serving(
    tmp_path, mlflow_uri, vllm_tiny, fp, adapters, made
) -> None:
    model = "can-abort"
    cfg = _config(tmp_path, mlflow_uri, vllm_tiny)
    v1, v2, controller = _setup(cfg, model, fp, adapters, made)
    client = MlflowClient(mlflow_uri)
    resolver = RouteResolver(cfg.resolve(cfg.state_dir), model, "base", ttl_s=0.0)
    sides = {resolver.route(model, f"user-{i}").canary for i in range(200)}
    assert sides == {True, False}  # both sides get traffic while the canary runs

    monitor = CanaryMonitor(cfg, models=[model], on_change=lambda _m: controller.trigger())
    view = monitor.check_once()[model]["canary"]
    assert view["decision"] == "continue" and view["challenger"]["n"] == 0
    assert state.TAG_STARTED in client.get_model_version(model, v2).tags

    _feedback(cfg, model, v2, ups=2, downs=18)  # users reject the challenger's answers
    _feedback(cfg, model, v1, ups=18, downs=2)
    monitor.start()  # no operator from here: the loops decide and apply
    controller.start()
    try:
        wait_for(lambda: state.challenger_version(client, cfg, model) is None, 30, 0.2)
        wait_for(lambda: read_routes(cfg.resolve(cfg.state_dir))[model].challenger_served_name is None, 30, 0.2)
    finally:
        monitor.stop()
        controller.stop()
    view = monitor.status()[model]["last_canary"]
    assert view["decision"] == "abort" and view["upper"] < 0, view
    assert (view["challenger"]["n"], view["champion"]["n"]) == (20, 20)

    assert state.challenger_version(client, cfg, model) is None
    assert aliases.champion_version(client, model, "champion") == v1  # @champion never moved
    result = json.loads(client.get_model_version(model, v2).tags[state.TAG_RESULT])
    assert result["decision"] == "abort" and "worse" in result["reason"] and result["evidence"]["challenger"]["n"] == 20
    run = client.get_run(client.get_model_version(model, v2).run_id)
    assert run.data.metrics["canary/challenger_n"] == 20 and run.data.metrics["canary/promoted"] == 0

    controller.reconcile_once()
    route = read_routes(cfg.resolve(cfg.state_dir))[model]
    assert route.challenger_served_name is None and route.version == v1
    assert resolver.route(model, "user-1") == (f"{model}-v{v1}", v1, None)
    _complete(vllm_tiny, f"{model}-v{v1}")  # the champion serves throughout
    wait_for(lambda: (controller.reconcile_once(), f"{model}-v{v2}" not in Replica(vllm_tiny).models())[1], 20, 0.2)
    _complete(vllm_tiny, f"{model}-v{v1}")


def test_preferred_challenger_promoted_resumed_after_restart_then_guard_rolls_back(
    tmp_path, mlflow_uri, vllm_tiny, fp, adapters, made
) -> None:
    model = "can-promote"
    cfg = _config(tmp_path, mlflow_uri, vllm_tiny)
    v1, v2, controller = _setup(cfg, model, fp, adapters, made)
    client = MlflowClient(mlflow_uri)

    first = CanaryMonitor(cfg, models=[model])
    first.check_once()
    redelivered = _feedback(cfg, model, v2, ups=10, downs=0)
    _feedback(cfg, model, v1, ups=5, downs=5)
    view = first.check_once()[model]["canary"]
    assert view["decision"] == "continue" and (view["challenger"]["n"], view["champion"]["n"]) == (10, 10)

    # restart: a new monitor, and the same traces delivered again (at-least-once ingestion)
    second = CanaryMonitor(cfg, models=[model], on_change=lambda _m: controller.trigger())
    _feedback(cfg, model, v2, ups=10, downs=0, trace_ids=redelivered)
    view = second.check_once()[model]["canary"]
    assert view["decision"] == "continue" and (view["challenger"]["n"], view["champion"]["n"]) == (10, 10), view
    assert view["started_at"] == client.get_model_version(model, v2).tags[state.TAG_STARTED]

    _feedback(cfg, model, v2, ups=12, downs=0)
    _feedback(cfg, model, v1, ups=6, downs=6)
    view = second.check_once()[model]["canary"]
    assert view["decision"] == "promote" and (view["challenger"]["n"], view["champion"]["n"]) == (22, 22), view
    assert aliases.champion_version(client, model, "champion") == v2
    assert state.challenger_version(client, cfg, model) is None
    guard = json.loads(client.get_model_version(model, v2).tags[state.TAG_GUARD])
    assert guard["previous"] == v1 and guard["baseline"]["n"] == 22

    controller.reconcile_once()
    assert read_routes(cfg.resolve(cfg.state_dir))[model].served_name == f"{model}-v{v2}"
    _complete(vllm_tiny, f"{model}-v{v2}")
    wait_for(lambda: (controller.reconcile_once(), f"{model}-v{v1}" not in Replica(vllm_tiny).models())[1], 20, 0.2)

    assert second.check_once()[model]["guard"]["decision"] == "watching"
    _feedback(cfg, model, v2, ups=0, downs=40)  # the new champion's live rate drops
    view = second.check_once()[model]["guard"]
    assert view["decision"] == "rollback", view
    assert aliases.champion_version(client, model, "champion") == v1  # rolled back like `hourglass rollback`
    tags = client.get_model_version(model, v2).tags
    assert json.loads(tags[state.TAG_GUARD_RESULT])["decision"] == "rollback"
    controller.reconcile_once()
    assert read_routes(cfg.resolve(cfg.state_dir))[model].served_name == f"{model}-v{v1}"
    _complete(vllm_tiny, f"{model}-v{v1}")


def _ask(gateway, model: str, users: list[str]) -> dict[str, str]:
    """One completion per user through the gateway; ``{trace id: user}``."""
    ids = {}
    for user in users:
        body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0, "user": user}
        response = gateway.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        ids[response.headers[TRACE_HEADER]] = user
    return ids


def test_first_winner_goes_through_a_canary_against_the_base(
    tmp_path, broker, mlflow_uri, vllm_tiny, fp, adapters, made
) -> None:
    """No champion yet: the winner is @challenger, the gateway splits users between the base and it (the
    traces say which answered); rejected, it is aborted without an operator while the base serves on and
    @champion is never set; the next winner, liked, becomes the first champion."""
    model = "can-first"
    cfg = _config(tmp_path, mlflow_uri, vllm_tiny)
    client = MlflowClient(mlflow_uri)
    [v1] = register_round(cfg, make_round(adapters["a"], fp, round_id=f"{model}-1", model=model))
    [v2] = register_round(cfg, make_round(adapters["b"], fp, round_id=f"{model}-2", model=model))
    out = state.promote_or_challenge(cfg, model, v1.version, reason="test round")
    assert (out["action"], out["control"]) == ("challenger", "base"), out
    controller = ServingController(cfg, models=[model], base_fingerprint=fp)
    made.append((controller, model))
    controller.reconcile_once()
    route = read_routes(cfg.resolve(cfg.state_dir))[model]
    assert (route.served_name, route.version, route.challenger_version) == ("base", None, v1.version)

    tag = uuid.uuid4().hex[:8]
    kafka = KafkaConfig(
        bootstrap_servers=[broker], traces_topic=f"cf-traces-{tag}", feedback_topic=f"cf-feedback-{tag}", partitions=1
    )
    ensure_topics(kafka)
    resolver = RouteResolver(cfg.resolve(cfg.state_dir), model, cfg.serving.base_served_name, ttl_s=0.0)
    app = create_gateway_app(kafka, vllm_tiny, resolver, gateway=GatewayConfig(require_api_key=False))
    with TestClient(app) as gateway:
        ids = _ask(gateway, model, [f"user-{i}" for i in range(16)])
        traces = _traces(kafka, set(ids))
        answered = {(t.get("adapter_version"), t["metadata"]["canary"]) for t in traces.values()}  # null: left out
        assert answered == {(None, False), (v1.version, True)}, answered  # the base (null) and the challenger

        monitor = CanaryMonitor(cfg, models=[model], on_change=lambda _m: controller.trigger())
        assert monitor.check_once()[model]["canary"]["control"] == "base"
        _feedback(cfg, model, v1.version, ups=2, downs=18)  # users reject the challenger's answers
        _feedback(cfg, model, None, ups=16, downs=4)  # and like the base's
        monitor.start()  # no operator from here: the loops decide and apply
        controller.start()
        try:
            wait_for(lambda: model not in read_routes(cfg.resolve(cfg.state_dir)), 30, 0.2)
        finally:
            monitor.stop()
            controller.stop()
        view = monitor.status()[model]["last_canary"]
        assert view["decision"] == "abort" and (view["challenger"]["n"], view["champion"]["n"]) == (20, 20), view
        assert aliases.champion_version(client, model, "champion") is None  # never set
        assert state.challenger_version(client, cfg, model) is None
        result = json.loads(client.get_model_version(model, v1.version).tags[state.TAG_RESULT])
        assert result["decision"] == "abort" and "worse" in result["reason"]
        later = _ask(gateway, model, ["user-0", "user-1", "user-2"])  # the base serves everyone again
        got = _traces(kafka, set(later))
        assert {(got[t].get("adapter_version"), got[t]["metadata"].get("canary")) for t in later} == {(None, None)}

        # the next winner, which the users like, becomes the first champion
        state.promote_or_challenge(cfg, model, v2.version, reason="test round 2")
        controller.reconcile_once()
        monitor.check_once()  # the canary starts now: the evidence counts from here
        _feedback(cfg, model, v2.version, ups=20, downs=2)
        _feedback(cfg, model, None, ups=5, downs=17)
        assert monitor.check_once()[model]["last_canary"]["decision"] == "promote"
        assert aliases.champion_version(client, model, "champion") == v2.version
        controller.reconcile_once()
        assert read_routes(cfg.resolve(cfg.state_dir))[model].served_name == f"{model}-v{v2.version}"
        later = _ask(gateway, model, ["user-0", "user-1"])
        got = _traces(kafka, set(later))
        assert {got[t]["adapter_version"] for t in later} == {v2.version}
    assert "base" in Replica(vllm_tiny).models()
