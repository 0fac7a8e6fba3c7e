"""The reward model in a real MLflow: its own registered model and ``@champion``
(moved only within ``reward_model.auc_margin``), and a crash in the middle of
reward-model training that registers nothing and leaves the reward champion as it was."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import safetensors.torch
import torch
from mlflow.tracking import MlflowClient

from pipeline.registry.aliases import champion_version
from pipeline.config import HourglassConfig
from pipeline.registry.client import TAG_ROUND, TAG_SHA256, adapter_checksums
from pipeline.registry.reward_registry import (
    TAG_AUC,
    TAG_DECISION,
    TAG_ROLE,
    pending_reward_dir,
    register_reward_model,
    reward_model_name,
)
from pipeline.rounds.steps import reward_champion
from tests.pipeline.round_fakes import FixedSnapshot
from tests.pipeline.serving_helpers import make_adapter, make_round
from trainer.model.store import fingerprint_of
from trainer.reward_model.model import HEAD_FILE
from trainer.types import RewardModelReport, RewardModelResult

pytestmark = pytest.mark.integration


def _reward_folder(tiny_model: Path, out: Path) -> Path:
    """A reward model folder for the tiny model (hidden 64): a PEFT adapter plus a zero head."""
    make_adapter(tiny_model, out, seed=3)
    safetensors.torch.save_file({"weight": torch.zeros(1, 64), "bias": torch.zeros(1)}, str(out / HEAD_FILE))
    return out


def _config(tmp_path: Path, mlflow_uri: str, **extra) -> dict:
    name = f"rm-{uuid.uuid4().hex[:8]}"
    return {
        "state_dir": str(tmp_path / "state"),
        "registry": {"tracking_uri": mlflow_uri, "experiment": name, "embedded": False},
        "serving": {
            "model_name": name,
            "replicas": ["http://127.0.0.1:1"],
            "embedded": False,
            "staging_dir": str(tmp_path / "staging"),
        },
        **{k: v for k, v in extra.items() if k != "rl"},
        "rl": {"reward_model": {"auc_margin": 0.05}, **extra.get("rl", {})},
    }


def _report(auc: float) -> RewardModelReport:
    return RewardModelReport(
        auc=auc,
        auc_lower_bound=auc - 0.1,
        accuracy=0.7,
        ece=0.1,
        pair_accuracy=None,
        heldout_examples=20,
        heldout_pairs=0,
    )


def _round(cfg: HourglassConfig, folder: Path, fp: str, round_id: str, auc: float, champion_auc: float | None = None):
    result = make_round(folder, fp, round_id=round_id, model=cfg.serving.model_name, winner=False)
    rm = RewardModelResult(
        name="reward-model",
        adapter_dir=folder,
        report=_report(auc),
        champion_report=_report(champion_auc) if champion_auc is not None else None,
        step_metrics=({"reward_model/loss": 0.9}, {"reward_model/loss": 0.5}),
        train_examples=40,
        train_pairs=3,
    )
    return dataclasses.replace(result, reward_model=rm)


def test_reward_champion_moves_only_within_the_auc_margin(tmp_path: Path, mlflow_uri: str, tiny_model: Path) -> None:
    cfg = HourglassConfig(**_config(tmp_path, mlflow_uri))
    folder, fp = _reward_folder(tiny_model, tmp_path / "rm"), fingerprint_of(tiny_model)
    client, name = MlflowClient(mlflow_uri), reward_model_name(cfg)

    first = register_reward_model(cfg, _round(cfg, folder, fp, "rr-1", auc=0.80))
    assert (first.model, first.version, first.promoted) == (name, "1", True)
    mv = client.get_model_version(name, "1")
    assert mv.tags[TAG_ROLE] == "reward_model" and mv.tags[TAG_ROUND] == "rr-1" and float(mv.tags[TAG_AUC]) == 0.80
    assert json.loads(mv.tags[TAG_SHA256]) == adapter_checksums(folder) and HEAD_FILE in json.loads(mv.tags[TAG_SHA256])
    assert client.get_registered_model(name).tags[TAG_ROLE] == "reward_model"
    run = client.get_run(mv.run_id)
    assert run.data.metrics["reward_model/auc"] == pytest.approx(0.80)
    assert [
        m.value for m in sorted(client.get_metric_history(mv.run_id, "reward_model/loss"), key=lambda m: m.step)
    ] == [0.9, 0.5]

    # 0.70 < 0.80 (recorded on v1) - 0.05: registered, champion kept
    second = register_reward_model(cfg, _round(cfg, folder, fp, "rr-2", auc=0.70))
    assert (second.version, second.promoted, second.champion_before) == ("2", False, "1")
    assert champion_version(client, name, "champion") == "1"
    assert "champion kept" in client.get_model_version(name, "2").tags[TAG_DECISION]

    # 0.78 >= 0.80 - 0.05: promoted
    third = register_reward_model(cfg, _round(cfg, folder, fp, "rr-3", auc=0.78))
    assert third.promoted and champion_version(client, name, "champion") == "3"

    # the champion re-measured on this round's held-out rows (0.72) wins over its recorded AUC (0.78)
    fourth = register_reward_model(cfg, _round(cfg, folder, fp, "rr-4", auc=0.70, champion_auc=0.72))
    assert fourth.promoted and champion_version(client, name, "champion") == "4"
    again = register_reward_model(
        cfg, _round(cfg, folder, fp, "rr-4", auc=0.70, champion_auc=0.72)
    )  # idempotent by round id
    assert again.version == "4" and len(client.search_model_versions(f"name = '{name}'")) == 4
    assert not any(pending_reward_dir(cfg).iterdir())

    # an undefined AUC (held-out rows of one label) never takes the champion
    nan = register_reward_model(cfg, _round(cfg, folder, fp, "rr-5", auc=float("nan")))
    assert not nan.promoted and champion_version(client, name, "champion") == "4"

    staged = reward_champion(cfg, fp)
    assert staged is not None and (staged / HEAD_FILE).is_file() and staged.name == "v4"
    assert reward_champion(cfg, "another-base") is None  # staging refuses a champion of another base


CRASH_SCRIPT = """
import json, os, signal, sys
import pyarrow as pa
from pipeline.config import HourglassConfig
from pipeline.rounds import job as round_job
from tests.pipeline.round_fakes import FixedSnapshot
from trainer.reward_model import phase as reward_round
from trainer.model.store import fingerprint_of

cfg = HourglassConfig(**json.loads(sys.argv[1]))
table = pa.ipc.open_file(sys.argv[2]).read_all()
train = reward_round.train_reward_model

def dying(model, data, rm_cfg, max_grad_norm, seed, on_phase):
    def hook(phase):
        if phase == "reward_model:2":
            print("dying", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # the process dies in the middle of reward-model training
        on_phase(phase)
    return train(model, data, rm_cfg, max_grad_norm, seed, hook)

reward_round.train_reward_model = dying
fp = fingerprint_of(cfg.model.name)
round_job.RoundRunner(cfg, fp, steps=FixedSnapshot(cfg, fp, table)).run("manual")  # the buffer's snapshot, fixed
print("finished", flush=True)
"""


def _feedback_table(path: Path):
    import pyarrow as pa

    from trainer.types import Prompt
    from trainer.data import snapshot_table

    rows = [
        Prompt(
            prompt_id=f"c{i:03d}",
            messages=[{"role": "user", "content": f"Word {i}?"}],
            metadata={"reference_answer": "1"},
            logged_completion="ok banana" if i % 2 == 0 else "ok apple",
            logged_reward=1.0 if i % 2 == 0 else -1.0,
        )
        for i in range(30)
    ]
    table = snapshot_table(rows)
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return table


def test_crash_mid_reward_model_training_registers_nothing(
    tmp_path: Path, mlflow_uri: str, tiny_model: Path, monkeypatch
) -> None:
    from pipeline.rounds import job as round_job
    from pipeline.rounds.records import RoundStore

    raw = _config(
        tmp_path,
        mlflow_uri,
        model={"name": str(tiny_model)},
        candidates=[
            {
                "name": "rm-user",
                "learning_rate": 1e-3,
                "lora_rank": 4,
                "lora_alpha": 8,
                "start": "fresh",
                "reward": [{"fn": "reward_model"}, {"fn": "format", "weight": 0.5}],
            }
        ],
        rl={
            "steps_per_round": 2,
            "prompts_per_step": 2,
            "rollout": {"group_size": 2, "max_new_tokens": 4, "engine": "hf"},
            "gate": {"eval_prompts": 4, "max_kl": 100.0, "bootstrap_samples": 100},
            "adapter_store": "offload",
            "reward_model": {"auc_margin": 0.05, "steps": 4, "batch_size": 8, "min_examples": 8},
        },
        schedule={"enabled": False},
    )
    cfg = HourglassConfig(**raw)
    fp, client, name = fingerprint_of(tiny_model), MlflowClient(mlflow_uri), reward_model_name(cfg)
    champion = register_reward_model(
        cfg, _round(cfg, _reward_folder(tiny_model, tmp_path / "rm"), fp, "before-crash", auc=0.6)
    )
    assert champion.promoted and champion.version == "1"
    table = _feedback_table(tmp_path / "snapshot.arrow")

    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CRASH_SCRIPT), json.dumps(raw), str(tmp_path / "snapshot.arrow")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9 and "dying" in proc.stdout and "finished" not in proc.stdout, proc.stderr[-3000:]

    store = RoundStore(cfg.resolve(cfg.state_dir))
    [interrupted] = store.unfinished()
    assert interrupted.state == "train"
    [settled] = round_job.recover(cfg, store)
    assert settled.state == "failed" and "died during train" in settled.reason
    # nothing registered: one reward version (the champion from before), no policy version, nothing pending or kept as "last"
    assert [v.version for v in client.search_model_versions(f"name = '{name}'")] == ["1"]
    assert champion_version(client, name, "champion") == "1"
    assert client.search_model_versions(f"name = '{cfg.serving.model_name}'") == []
    assert not pending_reward_dir(cfg).exists() or not any(pending_reward_dir(cfg).iterdir())
    assert not (cfg.resolve(cfg.state_dir) / "rounds" / "last" / "reward-model").exists()

    # the next round (no crash) trains from the staged reward champion and registers its reward model as v2
    record = round_job.RoundRunner(cfg, fp, steps=FixedSnapshot(cfg, fp, table)).run("manual")
    assert record.state in ("done", "no_winner"), record.reason
    assert record.metrics["reward_model/version"] == 2.0 and "reward_model/auc" in record.metrics
    assert (
        "reward_model/champion/auc" in record.metrics
    )  # the staged champion (v1) re-measured on this round's held-out rows
    experiment = client.get_experiment_by_name(cfg.registry.experiment).experiment_id
    [parent] = client.search_runs(
        [experiment], f"tags.`{TAG_ROUND}` = '{record.round_id}' and tags.`hourglass.run_kind` = 'round'"
    )
    assert parent.data.metrics["reward_model/auc"] == pytest.approx(
        record.metrics["reward_model/auc"]
    )  # on the round's run
    mv = client.get_model_version(name, "2")
    assert mv.tags[TAG_ROUND] == record.round_id
    promoted = champion_version(client, name, "champion") == "2"
    assert promoted == bool(record.metrics["reward_model/promoted"])
    assert (cfg.resolve(cfg.state_dir) / "rounds" / "last" / "reward-model" / HEAD_FILE).is_file()
