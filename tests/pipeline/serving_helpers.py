"""Helpers for the registry and serving tests: real peft adapters on the tiny
model, round results built the way the trainer builds them, and a config that
points at the test's MLflow and vLLM."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

from pipeline.config import HourglassConfig
from tests.pipeline.round_fakes import evaluation
from trainer.types import CandidateResult, GateDecision, RoundResult

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_adapter(base_dir: Path, out: Path, *, rank: int = 8, seed: int = 0, pickle: bool = False) -> Path:
    """A real, randomly initialised LoRA adapter for the tiny model, saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    )
    peft_model.save_pretrained(out, safe_serialization=not pickle)
    return out


def make_round(
    adapter_dir: Path,
    fingerprint: str,
    *,
    round_id: str,
    model: str = "hourglass",
    candidate: str = "cand-a",
    winner: bool = True,
) -> RoundResult:
    """A RoundResult with one candidate, as the trainer returns it (its evaluation) and as the gate decided it."""
    cand = CandidateResult(
        name=candidate,
        served_model=model,
        recipe={"algorithm": "grpo", "learning_rate": 1e-4, "lora_rank": 8, "kl_coef": 0.05},
        adapter_dir=adapter_dir,
        step_metrics=({"train/loss": 1.5, "train/reward_mean": 0.2}, {"train/loss": 1.2, "train/reward_mean": 0.4}),
        eval_rewards=(0.5, 0.7),
        eval_metrics={"eval/reward_mean": 0.6},
    )
    decision = GateDecision(
        served_model=model,
        winner=candidate if winner else None,
        reason="beats the champion by 0.1 (lower bound 0.02 > margin 0.0)"
        if winner
        else "no candidate beat the champion",
        champion_reward_mean=0.5,
        candidate_reward_means={candidate: 0.6},
        lower_bounds={candidate: 0.02},
    )
    return RoundResult(
        round_id=round_id,
        base_fingerprint=fingerprint,
        window_start=datetime(2026, 1, 1, 10, tzinfo=timezone.utc),
        window_end=datetime(2026, 1, 1, 11, tzinfo=timezone.utc),
        train_rows=40,
        heldout_rows=10,
        eval_prompt_ids=("p1", "p2"),
        candidates=(cand,),
        decisions={model: decision},
        metrics={"round/duration_s": 12.5},
        evaluations={model: evaluation(model, candidate, winner=winner)},
    )


def make_config(
    tmp: Path,
    mlflow_uri: str,
    replicas: list[str],
    *,
    interval_s: float = 0.3,
    drain_s: float = 0.5,
    experiment: str = "hourglass-tests",
) -> HourglassConfig:
    return HourglassConfig(
        state_dir=str(tmp / "state"),
        registry={"tracking_uri": mlflow_uri, "experiment": experiment, "embedded": False},
        serving={
            "replicas": replicas,
            "reconcile_interval_s": interval_s,
            "drain_s": drain_s,
            "staging_dir": str(tmp / "staging"),
            "embedded": False,
            "max_lora_rank": 16,
        },
    )


def wait_for(predicate, timeout_s: float = 30.0, every_s: float = 0.1):
    """Poll ``predicate`` until it returns a truthy value; fail with its last value."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"condition not met within {timeout_s}s; last value {value!r}")


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data))
