"""Signed registrations against a real MLflow and a real vLLM (tiny model):
a version without a valid signature is never served, whoever moved the alias,
and the champion keeps serving; key rotation with `resign`; no credentials in
what registration writes to MLflow."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient
from pydantic import SecretStr

from pipeline.registry import aliases
from pipeline.config import HourglassConfig
from pipeline.registry.models import TAG_SHA256, register_round
from pipeline.serving.replica import Replica
from pipeline.serving.controller import ServingController
from connectors.gateway.routes import read_routes
from pipeline.registry.signing import TAG_SIGNATURE, SignatureError, key_id, resign, verify
from tests.pipeline.serving_helpers import make_adapter, make_config, make_round
from trainer.model.store import fingerprint_of

pytestmark = pytest.mark.integration

OLD_KEY, NEW_KEY = "o" * 40, "n" * 40


@pytest.fixture(scope="module")
def fp(tiny_model: Path) -> str:
    return fingerprint_of(tiny_model)


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("signing-adapters")
    return {name: make_adapter(tiny_model, root / name, seed=seed) for name, seed in (("good1", 11), ("good2", 12))}


def _with_keys(cfg: HourglassConfig, key: str | None, previous: list[str] | None = None) -> HourglassConfig:
    registry = cfg.registry.model_copy(
        update={
            "signing_key": SecretStr(key) if key else None,
            "previous_signing_keys": [SecretStr(k) for k in previous or []],
        }
    )
    return cfg.model_copy(update={"registry": registry})


def _served(base_url: str) -> list[str]:
    return Replica(base_url).models()


@pytest.fixture(scope="module")
def served(tmp_path_factory, mlflow_uri, vllm_tiny, fp, adapters):
    """A model whose v1 (signed by the service) is served."""
    model = "sig-bad"
    cfg = make_config(tmp_path_factory.mktemp("sig"), mlflow_uri, [vllm_tiny])
    [v1] = register_round(cfg, make_round(adapters["good1"], fp, round_id="s-1", model=model), promote=True)
    controller = ServingController(cfg, models=[model], base_fingerprint=fp)
    controller.reconcile_once()
    assert read_routes(cfg.state_dir)[model].version == v1.version
    yield cfg, controller, model, v1.version
    controller.close()
    for name in _served(vllm_tiny):
        if name.startswith(f"{model}-v"):
            Replica(vllm_tiny).unload(name)


def _unsigned(cfg, client, model, fp, adapters, round_id):
    [v] = register_round(cfg, make_round(adapters["good2"], fp, round_id=round_id, model=model))
    client.delete_model_version_tag(model, v.version, TAG_SIGNATURE)
    return v.version


def _wrong_key(cfg, client, model, fp, adapters, round_id):
    other = _with_keys(cfg, "x" * 40)  # another "service" (or an attacker) with its own key
    other = other.model_copy(update={"state_dir": str(Path(cfg.state_dir) / "other")})
    [v] = register_round(other, make_round(adapters["good2"], fp, round_id=round_id, model=model))
    return v.version


def _tampered_checksum(cfg, client, model, fp, adapters, round_id):
    [v] = register_round(cfg, make_round(adapters["good2"], fp, round_id=round_id, model=model))
    sums = json.loads(client.get_model_version(model, v.version).tags[TAG_SHA256])
    sums["adapter_model.safetensors"] = "0" * 64
    client.set_model_version_tag(model, v.version, TAG_SHA256, json.dumps(sums))
    return v.version


def _copied_signature(cfg, client, model, fp, adapters, round_id):
    """An MLflow writer registers other artifacts under a copy of a good version's tags and signature."""
    [good] = register_round(cfg, make_round(adapters["good1"], fp, round_id=round_id, model=model))
    [other] = register_round(cfg, make_round(adapters["good2"], fp, round_id=f"{round_id}-src", model="sig-src"))
    source = client.get_model_version("sig-src", other.version).source
    tags = dict(client.get_model_version(model, good.version).tags)
    return str(client.create_model_version(model, source, run_id=other.run_id, tags=tags).version)


FORGERIES = {
    "unsigned": (_unsigned, "has no hourglass.signature tag"),
    "wrong-key": (_wrong_key, "signed with key"),
    "tampered-checksum": (_tampered_checksum, "does not match the version's tags"),
    "copied-signature": (_copied_signature, "checksum mismatch"),
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_version_without_a_valid_signature_is_never_served(case, served, mlflow_uri, vllm_tiny, fp, adapters):
    cfg, controller, model, champion = served
    make, reason = FORGERIES[case]
    client = MlflowClient(mlflow_uri)
    bad = make(cfg, client, model, fp, adapters, f"s-{case}")

    client.set_registered_model_alias(model, "champion", bad)  # moved by someone with MLflow write access
    status = controller.reconcile_once()[model]

    assert reason in status["last_error"] and status["last_error_version"] == bad
    serve_error = client.get_model_version(model, bad).tags[aliases.TAG_SERVE_ERROR]
    assert reason in serve_error
    assert aliases.champion_version(client, model, "champion") == champion  # alias moved back
    assert read_routes(cfg.state_dir)[model].version == champion
    assert f"{model}-v{bad}" not in _served(vllm_tiny)
    if case != "copied-signature":  # refused on its tags alone: nothing was downloaded
        assert not (cfg.resolve(cfg.serving.staging_dir) / model / f"v{bad}").exists()
    body = {"model": f"{model}-v{champion}", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{vllm_tiny}/v1/completions", json=body, timeout=30).json()["choices"]


def test_key_rotation_with_resign(tmp_path, mlflow_uri, fp, adapters):
    model = "sig-rotate"
    client = MlflowClient(mlflow_uri)
    old = _with_keys(make_config(tmp_path, mlflow_uri, ["http://127.0.0.1:1"]), OLD_KEY)
    [v] = register_round(old, make_round(adapters["good1"], fp, round_id="rot-1", model=model))
    tags = client.get_model_version(model, v.version).tags
    assert verify([OLD_KEY.encode()], model, tags) == key_id(OLD_KEY.encode())

    rotating = _with_keys(old, NEW_KEY, [OLD_KEY])
    assert resign(rotating, client, model, v.version) == {
        "model": model,
        "version": v.version,
        "was": key_id(OLD_KEY.encode()),
        "now": key_id(NEW_KEY.encode()),
    }
    tags = client.get_model_version(model, v.version).tags
    assert verify([NEW_KEY.encode()], model, tags) == key_id(NEW_KEY.encode())
    with pytest.raises(SignatureError):
        verify([OLD_KEY.encode()], model, tags)  # the old key can be dropped now

    # resign never blesses what no accepted key signed, unless the operator adopts it
    client.set_model_version_tag(model, v.version, TAG_SIGNATURE, "hmac-sha256:000000000000:00")
    with pytest.raises(SignatureError, match="signed with key 000000000000"):
        resign(_with_keys(old, NEW_KEY), client, model, v.version)
    assert resign(_with_keys(old, NEW_KEY), client, model, v.version, adopt=True)["was"] == "none"
    assert verify([NEW_KEY.encode()], model, client.get_model_version(model, v.version).tags)


def test_registration_writes_no_credentials_to_mlflow(tmp_path, mlflow_uri, fp, adapters):
    model = "sig-creds"
    cfg = make_config(tmp_path, mlflow_uri, ["http://127.0.0.1:1"])
    result = make_round(adapters["good1"], fp, round_id="cred-1", model=model)
    cand = dataclasses.replace(
        result.candidates[0],
        recipe={**result.candidates[0].recipe, "grader": "http://carol:Gr4derPW@grader:80/score?token=T0kenPW"},
    )
    decision = dataclasses.replace(
        result.decisions[model], reason="beats the champion; judged by http://carol:Gr4derPW@grader:80"
    )
    result = dataclasses.replace(result, candidates=(cand,), decisions={model: decision})
    [v] = register_round(cfg, result)

    client = MlflowClient(mlflow_uri)
    mv = client.get_model_version(model, v.version)
    run = client.get_run(v.run_id)
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    written = json.dumps(
        [mv.description, mv.tags, run.data.params, run.data.tags, parent.data.params, parent.data.tags]
    )
    assert "Gr4derPW" not in written and "T0kenPW" not in written
    assert run.data.params["grader"] == "http://***@grader:80/score?token=***"
    assert "http://***@grader:80" in mv.description


def test_cli_resign_moves_a_version_to_the_new_key(tmp_path, mlflow_uri, fp, adapters, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli.main import app

    model = "sig-cli"
    old = _with_keys(make_config(tmp_path, mlflow_uri, ["http://127.0.0.1:1"]), OLD_KEY)
    [v] = register_round(old, make_round(adapters["good2"], fp, round_id="cli-1", model=model))
    config = tmp_path / "hourglass.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[registry]\ntracking_uri = "{mlflow_uri}"\nembedded = false\n'
    )
    monkeypatch.setenv("HOURGLASS_REGISTRY__SIGNING_KEY", NEW_KEY)
    monkeypatch.setenv("HOURGLASS_REGISTRY__PREVIOUS_SIGNING_KEYS", json.dumps([OLD_KEY]))
    result = CliRunner().invoke(
        app, ["models", "resign", v.version, "--model", model, "--config", str(config), "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["now"] == key_id(NEW_KEY.encode())
    assert verify([NEW_KEY.encode()], model, MlflowClient(mlflow_uri).get_model_version(model, v.version).tags)

    monkeypatch.delenv("HOURGLASS_REGISTRY__PREVIOUS_SIGNING_KEYS")
    monkeypatch.setenv("HOURGLASS_REGISTRY__SIGNING_KEY", "z" * 40)  # a key that never signed it: refused, not blessed
    result = CliRunner().invoke(app, ["models", "resign", v.version, "--model", model, "--config", str(config)])
    assert result.exit_code == 1 and "signed with key" in result.output


def test_oversize_adapter_is_refused_before_download(tmp_path, mlflow_uri, fp, adapters):
    from pipeline.serving.staging import StagingError, stage_options, stage_version

    model = "sig-size"
    cfg = make_config(tmp_path, mlflow_uri, ["http://127.0.0.1:1"])
    [v] = register_round(cfg, make_round(adapters["good1"], fp, round_id="size-1", model=model))
    weights = (adapters["good1"] / "adapter_model.safetensors").stat().st_size
    options = {**stage_options(cfg), "max_adapter_bytes": weights - 1}
    staging = tmp_path / "staging-size"
    with pytest.raises(
        StagingError,
        match=rf"'adapter_model.safetensors' is {weights} bytes, over serving.max_adapter_bytes={weights - 1}",
    ):
        stage_version(MlflowClient(mlflow_uri), model, v.version, staging, base_fingerprint=fp, **options)
    assert not [p for p in staging.rglob("*") if p.is_file()]  # refused on the listing: nothing downloaded
    options["max_adapter_bytes"] = sum(f.stat().st_size for f in adapters["good1"].iterdir())  # exactly the total: fits
    staged = stage_version(MlflowClient(mlflow_uri), model, v.version, staging, base_fingerprint=fp, **options)
    assert staged.rank == 8 and (staged.path / "adapter_model.safetensors").stat().st_size == weights
