"""A vLLM hiccup on the real server (tiny model, real MLflow): the first load
answer is replaced by a 503 (an overloaded replica or a proxy in front of it).
The version is not refused, not tagged, the alias stays, and the next
reconcile pass serves it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from pipeline.registry import aliases
from pipeline.registry.models import register_round
from pipeline.serving.replica import Replica
from pipeline.serving.controller import ServingController
from connectors.gateway.routes import read_routes
from tests.pipeline.serving_helpers import make_adapter, make_config, make_round
from trainer.model.store import fingerprint_of

pytestmark = pytest.mark.integration


def test_503_on_load_is_retried_on_the_next_pass(
    tmp_path: Path, mlflow_uri: str, vllm_tiny: str, tiny_model: Path
) -> None:
    model, fp = "srv-hiccup", fingerprint_of(tiny_model)
    cfg = make_config(tmp_path, mlflow_uri, [vllm_tiny])
    [v1] = register_round(
        cfg, make_round(make_adapter(tiny_model, tmp_path / "a", seed=5), fp, round_id="h-1", model=model), promote=True
    )
    controller = ServingController(cfg, models=[model], base_fingerprint=fp)
    real = httpx.Client(base_url=vllm_tiny, timeout=60)
    hiccups = [503]

    def forward(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load_lora_adapter" and hiccups:
            return httpx.Response(hiccups.pop(), text="Service Unavailable: engine busy")
        upstream = real.request(
            request.method, request.url.path, content=request.content, headers={"content-type": "application/json"}
        )
        return httpx.Response(
            upstream.status_code,
            content=upstream.content,
            headers={"content-type": upstream.headers.get("content-type", "")},
        )

    controller.replicas[0]._http = httpx.Client(base_url=vllm_tiny, transport=httpx.MockTransport(forward), timeout=60)
    client = MlflowClient(mlflow_uri)
    name = f"{model}-v{v1.version}"
    try:
        status = controller.reconcile_once()[model]
        assert (
            status["serving"] is None
            and status["transient_errors"] == 1
            and "HTTP 503" in status["last_transient_error"]
        )
        assert status["last_error_version"] is None
        assert aliases.TAG_SERVE_ERROR not in client.get_model_version(model, v1.version).tags
        assert aliases.champion_version(client, model, "champion") == v1.version
        assert model not in read_routes(cfg.state_dir) and name not in Replica(vllm_tiny).models()

        status = controller.reconcile_once()[model]  # the replica answers again
        assert status["serving"] == v1.version and read_routes(cfg.state_dir)[model].served_name == name
        assert name in Replica(vllm_tiny).models()
    finally:
        controller.close()
        real.close()
        Replica(vllm_tiny).unload(name)
