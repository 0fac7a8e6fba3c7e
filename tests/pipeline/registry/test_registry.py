"""Registry against a real MLflow server: round logging, the winner's model
version, idempotent re-registration, pending registrations while MLflow is
down, and alias moves (promote, rollback, history)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.registry import aliases
from pipeline.registry.client import (
    TAG_FINGERPRINT,
    TAG_ROUND,
    TAG_SHA256,
    TAG_TRACES,
    RegistryError,
    RegistryUnavailableError,
    adapter_checksums,
)
from pipeline.registry.models import list_pending, register_round, retry_pending
from pipeline.stack import free_port
from tests.pipeline.serving_helpers import make_adapter, make_config, make_round
from trainer.model.store import fingerprint_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model, tmp_path_factory.mktemp("adapters") / "a", seed=1)


def test_round_is_logged_and_winner_registered_once(tmp_path, mlflow_uri, tiny_model, adapter):
    cfg = make_config(tmp_path, mlflow_uri, ["http://127.0.0.1:1"], experiment="reg-log")
    fp = fingerprint_of(tiny_model)
    result = make_round(adapter, fp, round_id="round-log-1", model="reg-log")
    result = replace(result, skipped={"cand-rm": "no reward model this round (3 rows with feedback)"})
    [version] = register_round(cfg, result)
    client = MlflowClient(mlflow_uri)

    # nested candidate run: recipe params, per-step metrics by step, eval metrics, adapter artifact, lineage tags
    run = client.get_run(version.run_id)
    assert run.data.params["algorithm"] == "grpo" and run.data.params["learning_rate"] == "0.0001"
    losses = client.get_metric_history(version.run_id, "train/loss")
    assert [(m.step, m.value) for m in sorted(losses, key=lambda m: m.step)] == [(0, 1.5), (1, 1.2)]
    assert run.data.metrics["eval/reward_mean"] == pytest.approx(0.6)
    assert {f.path for f in client.list_artifacts(version.run_id, "adapter")} >= {
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
    }
    assert run.data.tags[TAG_ROUND] == "round-log-1" and run.data.tags[TAG_TRACES] == "50"
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.data.tags[TAG_FINGERPRINT] == fp and parent.data.params["gate/reg-log/winner"] == "cand-a"
    assert parent.data.params["skipped/cand-rm"] == "no reward model this round (3 rows with feedback)"

    # the model version carries the lineage and the adapter checksums
    mv = client.get_model_version("reg-log", version.version)
    assert mv.tags[TAG_ROUND] == "round-log-1" and mv.tags[TAG_FINGERPRINT] == fp
    assert json.loads(mv.tags[TAG_SHA256]) == adapter_checksums(adapter)

    # registering the same round again creates nothing new
    again = register_round(cfg, result)
    assert [v.version for v in again] == [version.version]
    assert len(client.search_model_versions("name = 'reg-log'")) == 1
    assert list_pending(cfg) == []


def test_round_without_winner_registers_no_version(tmp_path, mlflow_uri, tiny_model, adapter):
    cfg = make_config(tmp_path, mlflow_uri, ["http://127.0.0.1:1"], experiment="reg-nowin")
    result = make_round(adapter, fingerprint_of(tiny_model), round_id="round-nowin", model="reg-nowin", winner=False)
    assert register_round(cfg, result) == []
    assert MlflowClient(mlflow_uri).search_model_versions("name = 'reg-nowin'") == []


def test_unreachable_mlflow_keeps_round_pending_until_retry(tmp_path, mlflow_uri, tiny_model, adapter):
    down = make_config(tmp_path, f"http://127.0.0.1:{free_port()}", ["http://127.0.0.1:1"], experiment="reg-pending")
    result = make_round(adapter, fingerprint_of(tiny_model), round_id="round-pending", model="reg-pending")
    with pytest.raises(RegistryUnavailableError, match="retry_pending"):
        register_round(down, result, promote=True)
    assert list_pending(down) == ["round-pending"]
    assert retry_pending(down) == []  # still down: nothing lost, nothing registered
    assert list_pending(down) == ["round-pending"]

    up = make_config(tmp_path, mlflow_uri, ["http://127.0.0.1:1"], experiment="reg-pending")  # same state_dir
    [version] = retry_pending(up)
    assert list_pending(up) == []
    client = MlflowClient(mlflow_uri)
    assert len(client.search_model_versions("name = 'reg-pending'")) == 1
    # promote=True travelled with the pending round; the adapter copy was verified by checksum
    assert aliases.champion_version(client, "reg-pending", "champion") == version.version
    mv = client.get_model_version("reg-pending", version.version)
    assert json.loads(mv.tags[TAG_SHA256]) == adapter_checksums(adapter)
    assert retry_pending(up) == []


def test_promote_rollback_and_history(tmp_path, mlflow_uri, tiny_model, adapter):
    cfg = make_config(tmp_path, mlflow_uri, ["http://127.0.0.1:1"], experiment="reg-alias")
    fp = fingerprint_of(tiny_model)
    versions = [
        register_round(cfg, make_round(adapter, fp, round_id=f"alias-{i}", model="reg-alias"))[0].version
        for i in range(3)
    ]
    client = MlflowClient(mlflow_uri)
    v1, v2, v3 = versions
    for v in versions:
        aliases.promote(cfg, "reg-alias", v)
    assert aliases.champion_version(client, "reg-alias", "champion") == v3
    assert aliases.champion_version(client, "reg-alias", aliases.PREVIOUS_ALIAS) == v2

    assert aliases.rollback(cfg, "reg-alias") == {"model": "reg-alias", "version": v2, "previous": v3}
    assert aliases.champion_version(client, "reg-alias", aliases.PREVIOUS_ALIAS) == v1
    assert aliases.rollback(cfg, "reg-alias")["version"] == v1
    with pytest.raises(RegistryError, match="--to VERSION"):
        aliases.rollback(cfg, "reg-alias")
    assert aliases.rollback(cfg, "reg-alias", to=v3)["version"] == v3
    assert aliases.champion_version(client, "reg-alias", "champion") == v3

    # a version that failed to serve is skipped by a plain rollback
    aliases.promote(cfg, "reg-alias", v2)
    client.set_model_version_tag("reg-alias", v3, aliases.TAG_SERVE_ERROR, "probe failed")
    assert aliases.history(client, "reg-alias") == [v1, v3, v2]
    assert aliases.rollback(cfg, "reg-alias")["version"] == v1  # skips v3

    with pytest.raises(aliases.UnknownVersionError, match="no version '99'"):
        aliases.promote(cfg, "reg-alias", "99")
