"""Reconcile repairs replica drift: a replica that comes up late (added) gets
the champion, and a vLLM restart (runtime adapters lost) is reloaded.

Starts its own vLLM (tiny model) on a fixed port so it can be restarted on
the same address; the session's ``vllm_tiny`` is the replica that stays up.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pipeline.registry.models import register_round
from pipeline.serving.replica import Replica
from pipeline.serving.controller import ServingController
from connectors.gateway.routes import read_routes
from pipeline.stack import free_port, vllm_service
from tests.pipeline.serving_helpers import make_adapter, make_config, make_round, wait_for
from trainer.model.store import fingerprint_of

pytestmark = pytest.mark.integration


def _serves(url: str, name: str) -> bool:
    try:
        return name in Replica(url).models()
    except Exception:
        return False


def test_replica_added_and_restarted_gets_the_champion(tmp_path, mlflow_uri, vllm_tiny, tiny_model: Path):
    port = free_port()
    extra_url = f"http://127.0.0.1:{port}"
    service = vllm_service(tiny_model, "127.0.0.1", port, tmp_path / "logs", max_model_len=512, max_lora_rank=16)
    model = "srv-restart"
    fp = fingerprint_of(tiny_model)
    cfg = make_config(tmp_path, mlflow_uri, [vllm_tiny, extra_url])
    [v1] = register_round(
        cfg, make_round(make_adapter(tiny_model, tmp_path / "a", seed=5), fp, round_id="r-1", model=model), promote=True
    )
    name = f"{model}-v{v1.version}"
    controller = ServingController(cfg, models=[model], base_fingerprint=fp)
    controller.start()
    try:
        # the extra replica is down: the champion is served by the other one, the status says so
        wait_for(lambda: model in read_routes(cfg.state_dir))
        assert _serves(vllm_tiny, name)
        assert str(controller.status()[model]["replicas"][extra_url]).startswith("unreachable")

        service.start()  # a replica is added
        wait_for(lambda: _serves(extra_url, name), timeout_s=60)

        service.stop()  # restart on the same port: runtime adapters are lost
        service.start()
        wait_for(lambda: _serves(extra_url, name), timeout_s=60)
        body = {"model": name, "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(f"{extra_url}/v1/completions", json=body, timeout=30).json()["model"] == name
    finally:
        controller.close()
        service.stop()
        Replica(vllm_tiny).unload(name)
