"""Serving controller against real MLflow and a real vLLM (tiny model):
promote, external alias moves, rollback, and bad adapters refused while the
champion keeps serving."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from pipeline.registry import aliases
from pipeline.registry.models import TAG_SHA256, register_round
from pipeline.serving.replica import Replica
from pipeline.serving.controller import ServingController
from connectors.gateway.routes import read_routes
from pipeline.registry.signing import TAG_SIGNATURE, sign, signing_keys
from tests.pipeline.serving_helpers import make_adapter, make_config, make_round, wait_for
from trainer.model.store import fingerprint_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fp(tiny_model: Path) -> str:
    return fingerprint_of(tiny_model)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serving-adapters")
    out = {
        "good1": make_adapter(tiny_model, root / "good1", seed=1),
        "good2": make_adapter(tiny_model, root / "good2", seed=2),
        "rank32": make_adapter(tiny_model, root / "rank32", rank=32, seed=3),
        "pickle": make_adapter(tiny_model, root / "pickle", seed=4, pickle=True),
    }
    garbage = root / "garbage"  # passes staging, but vLLM cannot read the weights
    garbage.mkdir()
    shutil.copy(out["good1"] / "adapter_config.json", garbage)
    (garbage / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    out["garbage"] = garbage
    return out


def _complete(base_url: str, name: str) -> dict:
    body = {"model": name, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _served(base_url: str) -> list[str]:
    return Replica(base_url).models()


@pytest.fixture
def controllers(vllm_tiny: str):
    made: list[tuple[ServingController, str]] = []
    yield made
    for controller, model in made:
        controller.close()
        for name in _served(vllm_tiny):
            if name.startswith(f"{model}-v"):
                Replica(vllm_tiny).unload(name)


def _controller(made, cfg, model, fp) -> ServingController:
    controller = ServingController(cfg, models=[model], base_fingerprint=fp)
    made.append((controller, model))
    return controller


def test_promote_hotloads_new_version_and_rollback_restores(tmp_path, mlflow_uri, vllm_tiny, fp, adapters, controllers):
    model = "srv-promote"
    cfg = make_config(tmp_path, mlflow_uri, [vllm_tiny])
    [v1] = register_round(cfg, make_round(adapters["good1"], fp, round_id="p-1", model=model), promote=True)
    controller = _controller(controllers, cfg, model, fp)
    controller.start()
    route = wait_for(lambda: read_routes(cfg.state_dir).get(model) if read_routes(cfg.state_dir).get(model) else None)
    assert (route.served_name, route.version) == (f"{model}-v{v1.version}", v1.version)
    assert _complete(vllm_tiny, route.served_name)["model"] == f"{model}-v{v1.version}"

    [v2] = register_round(cfg, make_round(adapters["good2"], fp, round_id="p-2", model=model), promote=True)
    wait_for(lambda: read_routes(cfg.state_dir)[model].version == v2.version)
    assert _complete(vllm_tiny, f"{model}-v{v2.version}")["choices"]
    wait_for(lambda: f"{model}-v{v1.version}" not in _served(vllm_tiny))  # unloaded after drain_s
    assert f"{model}-v{v2.version}" in _served(vllm_tiny)
    assert controller.status()[model]["serving"] == v2.version

    assert aliases.rollback(cfg, model)["version"] == v1.version
    wait_for(lambda: read_routes(cfg.state_dir)[model].version == v1.version)
    assert _complete(vllm_tiny, f"{model}-v{v1.version}")["choices"]
    wait_for(lambda: f"{model}-v{v2.version}" not in _served(vllm_tiny))


def test_alias_moved_by_another_process_is_hotloaded(tmp_path, mlflow_uri, vllm_tiny, fp, adapters, controllers):
    model = "srv-external"
    cfg = make_config(tmp_path, mlflow_uri, [vllm_tiny])
    [v1] = register_round(cfg, make_round(adapters["good1"], fp, round_id="e-1", model=model), promote=True)
    [v2] = register_round(cfg, make_round(adapters["good2"], fp, round_id="e-2", model=model))
    controller = _controller(controllers, cfg, model, fp)
    controller.start()
    wait_for(lambda: model in read_routes(cfg.state_dir))
    assert read_routes(cfg.state_dir)[model].version == v1.version

    code = (
        "from mlflow import MlflowClient; import sys; "
        "MlflowClient(sys.argv[1]).set_registered_model_alias(sys.argv[2], 'champion', sys.argv[3])"
    )
    subprocess.run([sys.executable, "-c", code, mlflow_uri, model, v2.version], check=True, timeout=120)
    wait_for(lambda: read_routes(cfg.state_dir)[model].version == v2.version)
    assert _complete(vllm_tiny, f"{model}-v{v2.version}")["model"] == f"{model}-v{v2.version}"


@pytest.fixture(scope="module")
def champion_setup(tmp_path_factory, mlflow_uri, vllm_tiny, fp, adapters):
    """A model whose v1 is served; each bad-adapter case promotes a bad version over it."""
    model = "srv-bad"
    cfg = make_config(tmp_path_factory.mktemp("bad"), mlflow_uri, [vllm_tiny])
    [v1] = register_round(cfg, make_round(adapters["good1"], fp, round_id="b-1", model=model), promote=True)
    controller = ServingController(cfg, models=[model], base_fingerprint=fp)
    controller.reconcile_once()
    assert read_routes(cfg.state_dir)[model].version == v1.version
    yield cfg, controller, model, v1.version
    controller.close()
    for name in _served(vllm_tiny):
        if name.startswith(f"{model}-v"):
            Replica(vllm_tiny).unload(name)


BAD_CASES = {
    "wrong-base": ("good2", "trained on base"),
    "rank-too-high": ("rank32", "exceeds the server's --max-lora-rank=16"),
    "pickle": ("pickle", "refusing pickle weights"),
    "checksum": ("good2", "checksum mismatch"),
    "outside-staging": ("good2", "unsafe path"),
    "server-error": ("garbage", "refused load"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_adapter_is_refused_and_champion_keeps_serving(case, champion_setup, mlflow_uri, vllm_tiny, fp, adapters):
    cfg, controller, model, champion = champion_setup
    adapter_key, reason = BAD_CASES[case]
    client = MlflowClient(mlflow_uri)
    base = "0" * 64 if case == "wrong-base" else fp
    [bad] = register_round(cfg, make_round(adapters[adapter_key], base, round_id=f"b-{case}", model=model))
    sums = json.loads(client.get_model_version(model, bad.version).tags[TAG_SHA256])
    if case == "checksum":
        sums["adapter_model.safetensors"] = "0" * 64
    if case == "outside-staging":
        sums["../../outside.safetensors"] = "0" * 64
    client.set_model_version_tag(model, bad.version, TAG_SHA256, json.dumps(sums))
    # Re-signed with the service's key: the checks behind the signature still catch a bad file or path.
    tags = client.get_model_version(model, bad.version).tags
    client.set_model_version_tag(model, bad.version, TAG_SIGNATURE, sign(signing_keys(cfg)[0], model, tags))

    aliases.promote(cfg, model, bad.version)
    status = controller.reconcile_once()[model]

    assert reason in status["last_error"] and status["last_error_version"] == bad.version
    assert reason in client.get_model_version(model, bad.version).tags[aliases.TAG_SERVE_ERROR]
    assert aliases.champion_version(client, model, "champion") == champion  # alias moved back
    assert read_routes(cfg.state_dir)[model].version == champion  # route unchanged
    assert f"{model}-v{bad.version}" not in _served(vllm_tiny)
    assert _complete(vllm_tiny, f"{model}-v{champion}")["choices"]

    # someone points the alias at it again: reverted without another attempt
    staged = cfg.resolve(cfg.serving.staging_dir) / model / f"v{bad.version}"
    shutil.rmtree(staged, ignore_errors=True)
    client.set_registered_model_alias(model, "champion", bad.version)
    controller.reconcile_once()
    assert aliases.champion_version(client, model, "champion") == champion
    assert not staged.exists()
    assert read_routes(cfg.state_dir)[model].version == champion
