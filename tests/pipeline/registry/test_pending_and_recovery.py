"""Stranded registrations and leaked adapters, on a real MLflow and a real vLLM:

- a registration an MLflow outage left pending is retried by the running
  service (no restart needed), registered, and not promoted over the newer
  champion (tagged with the reason; the round record says so);
- recovery after a crash mid-round unloads the versions the dead round had
  published into vLLM, and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.registry import aliases
from pipeline.registry.client import find_round_version
from pipeline.registry.models import (
    TAG_NOT_PROMOTED,
    RegistryUnavailableError,
    list_pending,
    register_round,
)
from pipeline.serving.replica import Replica
from pipeline.rounds.job import recover
from pipeline.rounds.records import RoundStore
from pipeline.service import HourglassService
from pipeline.stack import free_port
from tests.pipeline.serving_helpers import make_adapter, make_config, make_round, wait_for
from trainer.model.store import fingerprint_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model, tmp_path_factory.mktemp("adapters") / "a", seed=1)


def test_stranded_registration_is_retried_and_never_promoted_over_a_newer_champion(
    tmp_path, mlflow_uri, tiny_model, adapter
):
    model, fp = "pend-stale", fingerprint_of(tiny_model)
    old = make_round(adapter, fp, round_id="r20260101T000000-aaaaaa", model=model)
    down = make_config(tmp_path, f"http://127.0.0.1:{free_port()}", ["http://127.0.0.1:1"], experiment="pend-stale")
    with pytest.raises(RegistryUnavailableError):
        register_round(down, old, promote=True)  # MLflow is down at register: the round fails, its folder stays
    store = RoundStore(down.resolve(down.state_dir))
    record = store.create("schedule", ["cand-a"], "1h", round_id=old.round_id)
    store.transition(record, "failed", "register: RegistryUnavailableError: MLflow unreachable")

    up = make_config(tmp_path, mlflow_uri, ["http://127.0.0.1:1"], experiment="pend-stale")  # same state_dir
    up = up.model_copy(
        update={"schedule": up.schedule.model_copy(update={"enabled": False, "pending_retry_interval_s": 0.5})}
    )
    [newer] = register_round(up, make_round(adapter, fp, round_id="r20260102T000000-bbbbbb", model=model), promote=True)
    client = MlflowClient(mlflow_uri)
    assert aliases.champion_version(client, model, "champion") == newer.version
    assert list_pending(up) == [old.round_id]

    service = HourglassService(up, base_fingerprint=fp, ingest=False, reconcile=False)
    service.start()
    try:
        wait_for(lambda: list_pending(up) == [], timeout_s=60)  # retried by the running service
    finally:
        service.shutdown(round_grace_s=1)
    late = find_round_version(client, model, old.round_id)
    assert late is not None and int(late.version) > int(newer.version)
    assert aliases.champion_version(client, model, "champion") == newer.version  # the alias did not move
    assert "older than the champion" in client.get_model_version(model, late.version).tags[TAG_NOT_PROMOTED]
    settled = store.get(old.round_id)
    assert settled.state == "failed" and settled.versions == {model: str(late.version)}
    assert f"registered later from the pending folder: {model} v{late.version}" in settled.reason


def test_recovery_unloads_what_a_dead_round_published(tmp_path, mlflow_uri, vllm_tiny, adapter):
    cfg = make_config(tmp_path, mlflow_uri, [vllm_tiny])
    store = RoundStore(cfg.resolve(cfg.state_dir))
    dead = store.create("schedule", ["default"], "1h")
    store.transition(dead, "train")
    replica = Replica(vllm_tiny)
    leaked = ["default-s3", f"champion-0-{dead.round_id}"]
    kept = ["champion-0-r20000101T000000-other", "defaults-s2"]  # not names this round publishes
    for name in leaked + kept:
        replica.load(name, str(adapter))
    try:
        [settled] = recover(cfg, store)
        served = set(replica.models())
        assert not served & set(leaked) and served >= set(kept)
        assert settled.state == "failed" and "died during train" in settled.reason
        assert "unloaded 2 adapter(s)" in store.get(dead.round_id).reason
    finally:
        for name in leaked + kept:
            replica.unload(name)
        replica.close()
