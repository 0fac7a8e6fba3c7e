"""Replica hiccups vs bad adapters (fast: fake MLflow client and fake replicas,
plus the real Replica client on a mocked HTTP transport).

A 5xx, timeout or connection error is the replica's problem: nothing is
tagged, the alias stays, the error is counted, the next pass retries. Only a
4xx, an invalid completion, or a 500 that a healthy replica repeats is the
adapter's fault."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from mlflow.exceptions import MlflowException
from prometheus_client import REGISTRY

import pipeline.serving.controller as serving
from pipeline.registry.aliases import TAG_SERVE_ERROR
from pipeline.serving.replica import Replica, ReplicaRefusedError, ReplicaServerError, ReplicaUnreachableError
from pipeline.serving.controller import ServingController
from connectors.gateway.routes import read_routes
from serving_helpers import make_config

MODEL = "hg"


class FakeClient:
    """The few MlflowClient calls the controller and aliases make, in memory."""

    def __init__(self, champion: str) -> None:
        self.alias: str | None = champion
        self.version_tags: dict[str, dict[str, str]] = {"1": {}, "2": {"hourglass.promoted_reason": "round r2"}}
        self.model_tags: dict[str, str] = {"hourglass.champion_history": '["1", "2"]'}

    def get_model_version_by_alias(self, model, alias):
        if self.alias is None:
            raise MlflowException("no alias", error_code="RESOURCE_DOES_NOT_EXIST")
        return SimpleNamespace(version=self.alias)

    def get_model_version(self, model, version):
        return SimpleNamespace(version=version, tags=dict(self.version_tags[str(version)]))

    def set_model_version_tag(self, model, version, key, value):
        self.version_tags[str(version)][key] = value

    def get_registered_model(self, model):
        return SimpleNamespace(tags=dict(self.model_tags))

    def set_registered_model_tag(self, model, key, value):
        self.model_tags[key] = value

    def set_registered_model_alias(self, model, alias, version):
        if alias == "champion":
            self.alias = str(version)

    def delete_registered_model_alias(self, model, alias):
        if alias == "champion":
            self.alias = None


class FakeReplica:
    """A vLLM replica whose next load / probe outcomes are scripted (None = success)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.loaded: set[str] = {"base"}
        self.load_errors: list[Exception | None] = []
        self.probe_errors: list[Exception | None] = []

    def models(self) -> list[str]:
        return sorted(self.loaded)

    def load(self, name: str, path: str) -> None:
        error = self.load_errors.pop(0) if self.load_errors else None
        if error is not None:
            raise error
        self.loaded.add(name)

    def probe(self, name: str) -> str:
        error = self.probe_errors.pop(0) if self.probe_errors else None
        if error is not None:
            raise error
        return "ok"

    def unload(self, name: str) -> None:
        self.loaded.discard(name)

    def close(self) -> None:
        pass


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = make_config(tmp_path, "http://127.0.0.1:9", ["http://replica-a:8000"])
    monkeypatch.setattr(serving, "stage_version", lambda client, model, version, staging, **kw: SimpleNamespace(
        served_name=f"{model}-v{version}", path=tmp_path / f"v{version}"))  # fmt: skip
    client = FakeClient(champion="1")
    controller = ServingController(cfg, models=[MODEL], base_fingerprint="f" * 64, client=client)
    replica = FakeReplica("http://replica-a:8000")
    controller.replicas = [replica]
    controller.reconcile_once()  # v1 serves
    assert read_routes(cfg.state_dir)[MODEL].version == "1"
    client.alias = "2"  # a round promotes v2
    return cfg, controller, client, replica


def _transient_count() -> float:
    return REGISTRY.get_sample_value("hourglass_serve_transient_errors_total", {"replica": "http://replica-a:8000"}) or 0.0


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
    getattr(replica, f"{where}_errors").append(error)
    before = _transient_count()

    status = controller.reconcile_once()[MODEL]
    assert status["serving"] == "1" and status["transient_errors"] == 1 and str(error) in status["last_transient_error"]
    assert status["last_error_version"] is None
    assert TAG_SERVE_ERROR not in client.version_tags["2"]  # never tagged
    assert client.alias == "2"  # never reverted
    assert read_routes(cfg.state_dir)[MODEL].version == "1"  # v1 keeps serving
    assert _transient_count() - before == 1

    status = controller.reconcile_once()[MODEL]  # the replica is fine again: the next pass rolls v2 out
    assert status["serving"] == "2" and read_routes(cfg.state_dir)[MODEL].version == "2"
    assert "hg-v2" in replica.loaded


REFUSED = {
    "load 400": ("load", ReplicaRefusedError("vLLM refused load 'hg-v2': HTTP 400: bad adapter")),
    "load 500 from a healthy replica twice": ("load", ReplicaRefusedError("vLLM refused load 'hg-v2' twice while healthy: HTTP 500")),
    "probe 404": ("probe", ReplicaRefusedError("vLLM refused a probe: HTTP 404")),
    "probe without a completion": ("probe", ReplicaRefusedError("answered the probe without a completion")),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_adapter_fault_is_refused_and_the_alias_reverted(case, setup) -> None:
    cfg, controller, client, replica = setup
    where, error = REFUSED[case]
    getattr(replica, f"{where}_errors").append(error)
    status = controller.reconcile_once()[MODEL]
    assert status["last_error_version"] == "2" and status["transient_errors"] == 0
    assert str(error) in client.version_tags["2"][TAG_SERVE_ERROR]
    assert client.alias == "1" and read_routes(cfg.state_dir)[MODEL].version == "1"
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


@pytest.mark.parametrize(("response", "error"), [
    (httpx.Response(503, text="overloaded"), ReplicaServerError),
    (httpx.Response(404, json={"error": {"message": "model does not exist"}}), ReplicaRefusedError),
    (httpx.Response(200, text="<html>not json"), ReplicaRefusedError),
    (httpx.Response(200, json={"choices": []}), ReplicaRefusedError),
])  # fmt: skip
def test_probe_outcomes(response, error) -> None:
    replica, _ = _replica(lambda req, calls: response)
    with pytest.raises(error):
        replica.probe("a-v1")
