"""Faults of a round on the ``ray`` executor, on a real local Ray cluster and a real MLflow:
a trainer actor SIGKILLed mid-round fails the round with the reason, registers nothing, leaves
the champion in place and leaves no actor or placement group behind; the next round runs."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.rounds import job as round_job
from pipeline.registry.aliases import champion_version
from pipeline.config import HourglassConfig
from pipeline.registry.models import register_round
from tests.pipeline.round_fakes import FixedSnapshot
from tests.pipeline.serving_helpers import make_adapter, make_round
from tests.trainer.ray_helpers import until_clean
from trainer.executors import ray_pool
from trainer.model.store import fingerprint_of
from trainer.tasks import reasoning_gym_prompts
from trainer.data import snapshot_table

pytestmark = pytest.mark.integration


def test_an_actor_killed_mid_round_fails_it_cleanly_and_the_next_round_runs(
    ray_cluster, tmp_path: Path, mlflow_uri: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    name = f"ray-{uuid.uuid4().hex[:8]}"
    cfg = HourglassConfig(
        state_dir=str(tmp_path / "state"),
        registry={"tracking_uri": mlflow_uri, "experiment": name, "embedded": False},
        serving={
            "model_name": name,
            "replicas": ["http://127.0.0.1:1"],
            "embedded": False,
            "staging_dir": str(tmp_path / "staging"),
            "canary": {"enabled": False},
        },
        model={"name": str(tiny_model)},
        candidates=[
            {"name": "from-champion", "start": "champion", "reward": [{"fn": "format"}]},
            {"name": "fresh", "start": "fresh", "learning_rate": 1e-3, "reward": [{"fn": "format"}]},
        ],
        rl={
            "steps_per_round": 3,
            "prompts_per_step": 2,
            "rollout": {"group_size": 2, "max_new_tokens": 4, "engine": "hf"},
            "gate": {"eval_prompts": 4, "max_kl": 100.0, "bootstrap_samples": 100},
            "executor": "ray",
            "ray": {"actors": 2, "storage_uri": f"file://{tmp_path / 'exchange'}"},
        },
        schedule={"enabled": False},
    )
    fp, client = fingerprint_of(tiny_model), MlflowClient(mlflow_uri)
    [champion] = register_round(
        cfg,
        make_round(make_adapter(tiny_model, tmp_path / "champion"), fp, round_id="before", model=name),
        promote=True,
    )
    assert champion_version(client, name, "champion") == champion.version == "1"
    prompts = reasoning_gym_prompts(
        "basic_arithmetic", 12, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    table = snapshot_table(prompts)

    spawned, killed = [], {}
    real_spawn = ray_pool._spawn
    monkeypatch.setattr(ray_pool, "_spawn", lambda *a: spawned.append(real_spawn(*a)) or spawned[-1])

    def kill_mid_round() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:  # an actor still loading its base answers only once started (slow on a loaded host): ask again
                progress = ray.get(spawned[0].progress.remote(), timeout=60) if spawned else None
            except ray.exceptions.GetTimeoutError:
                continue
            if progress in ("train:1", "train:2"):  # a step done, more to go
                killed["pid"] = ray.get(spawned[0].pid.remote(), timeout=60)
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_mid_round, daemon=True)
    killer.start()
    record = round_job.RoundRunner(cfg, fp, steps=FixedSnapshot(cfg, fp, table)).run("manual")
    killer.join(5)

    assert "pid" in killed, "the actor was never seen mid-training"
    assert record.state == "failed", record.reason
    assert "trainer actor 0" in record.reason and "died mid-round" in record.reason and "keeps nothing" in record.reason
    assert [v.version for v in client.search_model_versions(f"name = '{name}'")] == ["1"]  # nothing registered
    assert champion_version(client, name, "champion") == "1"
    assert until_clean() == ([], [])
    assert not (tmp_path / "exchange" / record.round_id).exists()

    monkeypatch.setattr(ray_pool, "_spawn", real_spawn)
    again = round_job.RoundRunner(cfg, fp, steps=FixedSnapshot(cfg, fp, table)).run("manual")
    assert again.state in ("done", "no_winner"), again.reason
    assert again.metrics["executor/actors"] == 2.0
    assert until_clean() == ([], [])
