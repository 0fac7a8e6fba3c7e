"""Replica hiccups vs bad adapters (fast: the in-memory registry, replica and staging fakes of
``registry_fakes.py``, plus the real Replica client on a mocked HTTP transport).

A 5xx, timeout or connection error is the replica's problem: nothing is
tagged, the alias stays, the error is counted, the next pass retries. Only a
4xx, an invalid completion, or a 500 that a healthy replica repeats is the
adapter's fault."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from connectors.gateway.routes import read_routes
from pipeline.registry.aliases import TAG_SERVE_ERROR, promote
from pipeline.serving.controller import ServingController
from pipeline.serving.replica import Replica, ReplicaRefusedError, ReplicaServerError, ReplicaUnreachableError
from tests.pipeline.registry_fakes import FakeRegistry, FakeReplica, FakeStager
from tests.pipeline.serving_helpers import make_config

MODEL = "hg"


@pytest.fixture
def setup(tmp_path: Path):
    cfg = make_config(tmp_path, "http://127.0.0.1:9", ["http://replica-a:8000"])
    client = FakeRegistry()
    client.add_versions(MODEL, 2)
    promote(cfg, MODEL, "1", client=client)
    replica = FakeReplica("http://replica-a:8000")
    controller = ServingController(
        cfg, models=[MODEL], base_fingerprint="f" * 64, client=client, replicas=[replica], stage=FakeStager()
    )
    controller.reconcile_once()  # v1 serves
    assert read_routes(cfg.state_dir)[MODEL].version == "1"
    promote(cfg, MODEL, "2", client=client, reason="round r2")  # a round promotes v2
    return cfg, controller, client, replica


def _transient_count() -> float:
    return (
        REGISTRY.get_sample_value("hourglass_serve_transient_errors_total", {"replica": "http://replica-a:8000"}) or 0.0
    )


TRANSIENT = {
    "load 503": ("load", ReplicaServerError("vLLM failed load: HTTP 503", 503)),
    "load 500 unhealthy": ("load", ReplicaServerError("vLLM failed load: HTTP 500", 500)),
    "load timeout": ("load", ReplicaUnreachableError("vLLM did not answer load: ReadTimeout")),
    "probe 502": ("probe", ReplicaServerError("vLLM failed a probe: HTTP 502", 502)),
    "probe connection refused": ("probe", ReplicaUnreachableError("vLLM did not answer a probe: ConnectError")),
}


@pytest.mark.parametrize("case", list(TRANSIENT))
def test_replica_problem_is_retried_not_refused(case, setup) -> None:
    cfg, controller, client, replica = setup
    where, error = TRANSIENT[case]
    replica.fail(where, error)
    before = _transient_count()

    status = controller.reconcile_once()[MODEL]
    assert status["serving"] == "1" and status["transient_errors"] == 1 and str(error) in status["last_transient_error"]
    assert status["last_error_version"] is None
    assert TAG_SERVE_ERROR not in client.tags(MODEL, "2")  # never tagged
    assert client.alias(MODEL, "champion") == "2"  # never reverted
    assert read_routes(cfg.state_dir)[MODEL].version == "1"  # v1 keeps serving
    assert _transient_count() - before == 1

    status = controller.reconcile_once()[MODEL]  # the replica is fine again: the next pass rolls v2 out
    assert status["serving"] == "2" and read_routes(cfg.state_dir)[MODEL].version == "2"
    assert "hg-v2" in replica.loaded


REFUSED = {
    "load 400": ("load", ReplicaRefusedError("vLLM refused load 'hg-v2': HTTP 400: bad adapter")),
    "load 500 from a healthy replica twice": (
        "load",
        ReplicaRefusedError("vLLM refused load 'hg-v2' twice while healthy: HTTP 500"),
    ),
    "probe 404": ("probe", ReplicaRefusedError("vLLM refused a probe: HTTP 404")),
    "probe without a completion": ("probe", ReplicaRefusedError("answered the probe without a completion")),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_adapter_fault_is_refused_and_the_alias_reverted(case, setup) -> None:
    cfg, controller, client, replica = setup
    where, error = REFUSED[case]
    replica.fail(where, error)
    status = controller.reconcile_once()[MODEL]
    assert status["last_error_version"] == "2" and status["transient_errors"] == 0
    assert str(error) in client.tags(MODEL, "2")[TAG_SERVE_ERROR]
    assert client.alias(MODEL, "champion") == "1" and read_routes(cfg.state_dir)[MODEL].version == "1"
    assert "hg-v2" not in replica.loaded


def _replica(handler, health_status: int = 200) -> tuple[Replica, list[str]]:
    calls: list[str] = []

    def route(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/health":
            return httpx.Response(health_status)
        return handler(request, calls)

    replica = Replica("http://vllm:8000")
    replica._http = httpx.Client(base_url="http://vllm:8000", transport=httpx.MockTransport(route))
    return replica, calls


def test_load_500_from_a_healthy_replica_twice_is_the_adapters_fault() -> None:
    replica, calls = _replica(lambda req, calls: httpx.Response(500, json={"error": {"message": "header too large"}}))
    with pytest.raises(ReplicaRefusedError, match="refused load 'a-v1' from /x twice while healthy: HTTP 500"):
        replica.load("a-v1", "/x", retry_pause_s=0)
    assert calls == ["/v1/load_lora_adapter", "/health", "/v1/load_lora_adapter", "/health"]


@pytest.mark.parametrize(("status", "health"), [(503, 200), (502, 200), (500, 503)])
def test_load_5xx_from_an_overloaded_or_unhealthy_replica_is_transient(status, health) -> None:
    replica, _ = _replica(lambda req, calls: httpx.Response(status, text="busy"), health_status=health)
    with pytest.raises(ReplicaServerError) as err:
        replica.load("a-v1", "/x", retry_pause_s=0)
    assert isinstance(err.value, ReplicaUnreachableError) and err.value.status_code == status


def test_load_500_once_then_success_loads() -> None:
    def handler(request, calls):
        return httpx.Response(500 if calls.count("/v1/load_lora_adapter") == 1 else 200, text="ok")

    replica, calls = _replica(handler)
    replica.load("a-v1", "/x", retry_pause_s=0)
    assert calls.count("/v1/load_lora_adapter") == 2


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (httpx.Response(503, text="overloaded"), ReplicaServerError),
        (httpx.Response(404, json={"error": {"message": "model does not exist"}}), ReplicaRefusedError),
        (httpx.Response(200, text="<html>not json"), ReplicaRefusedError),
        (httpx.Response(200, json={"choices": []}), ReplicaRefusedError),
    ],
)
def test_probe_outcomes(response, error) -> None:
    replica, _ = _replica(lambda req, calls: response)
    with pytest.raises(error):
        replica.probe("a-v1")
