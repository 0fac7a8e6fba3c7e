"""A GRPO candidate on ``reward = [{fn = "reward_model"}]`` learns from the round's
reward model: over one round (HF rollouts, tiny model, fixed seeds) the reward
model's mean score of its greedy answers rises above the base's."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from trainer.adapters.store import make_store
from trainer.model.base import load_base
from trainer.config import CandidateConfig, ModelConfig, RewardModelConfig, RewardTerm, RLConfig
from trainer.evaluation.measure import greedy_answers
from trainer.reward_model.model import create_reward_model
from trainer.types import BASE_VERSION
from trainer.rollout.hf import HFEngine
from trainer.round import run_round
from trainer.types import Prompt
from trainer.data import prompts_from_table, snapshot_table, split_snapshot
from trainer.types import RoundSpec
from trainer.data import round_inputs


def _feedback_rows(n: int) -> list[Prompt]:
    """Served completions with thumbs: those ending in ' banana' were liked."""
    rng = random.Random(1)
    words = "apple river stone cloud green seven table music light paper".split()
    rows = []
    for i in range(n):
        good = i % 2 == 0
        text = " ".join(rng.sample(words, 3) + (["banana"] if good else [rng.choice(words)]))
        rows.append(
            Prompt(
                prompt_id=f"f{i:03d}",
                messages=[{"role": "user", "content": f"Say a few words about thing {i}."}],
                metadata={"reference_answer": "banana"},
                logged_completion=text,
                logged_reward=1.0 if good else -1.0,
            )
        )
    return rows


def test_grpo_on_the_reward_model_raises_its_score(peaked_model: Path, tmp_path: Path) -> None:
    train, heldout = split_snapshot(snapshot_table(_feedback_rows(48)), 0.25)
    reward_cfg = RewardModelConfig(steps=12, batch_size=16, learning_rate=5e-3, start="fresh")
    candidate = CandidateConfig(
        name="rm-grpo",
        learning_rate=3e-3,
        kl_coef=0.0,
        start="fresh",
        reward=[RewardTerm(fn="reward_model", kwargs={"probability": False})],
    )
    rl = RLConfig(
        steps_per_round=12,
        prompts_per_step=2,
        rollout={"group_size": 8, "max_new_tokens": 4, "engine": "hf"},
        adapter_store="offload",
        gate={"eval_prompts": 6, "max_kl": 100.0},
        seed=0,
    )
    result = run_round(
        RoundSpec(
            ModelConfig(name=str(peaked_model)), (candidate,), rl.model_copy(update={"reward_model": reward_cfg})
        ),
        round_inputs(train, heldout),
        tmp_path / "r1",
    )

    rm = result.reward_model
    assert rm is not None and rm.train_examples == 36 and rm.report.heldout_examples == 12
    assert result.metrics["reward_model/auc"] == rm.report.auc and "reward_model/ece" in result.metrics
    steps = result.candidates[0].step_metrics
    assert all("train/reward_model_score_s" in m for m in steps)
    assert (tmp_path / "last" / "reward-model" / "reward_head.safetensors").is_file()  # the next round's start

    # the same reward model scores the greedy answers of the base and of the trained candidate
    base = load_base(ModelConfig(name=str(peaked_model)))
    store = make_store("offload", base)
    model = create_reward_model(base, store, reward_cfg, rm.adapter_dir)
    store.create("rm-grpo", candidate, init_dir=result.candidates[0].adapter_dir)
    engine = HFEngine(base, store)
    engine.load("rm-grpo", "trained", result.candidates[0].adapter_dir)
    prompts = prompts_from_table(train)[:16]
    ids = [base.chat_token_ids(p.messages) for p in prompts]
    answers = greedy_answers(engine, [BASE_VERSION, "trained"], prompts, ids, rl)
    with torch.no_grad():
        before = model.score(ids, [list(s.token_ids) for s in answers[BASE_VERSION]])
        after = model.score(ids, [list(s.token_ids) for s in answers["trained"]])
    mean_before, mean_after = sum(before) / len(before), sum(after) / len(after)
    curve = [m["train/reward_mean"] for m in steps]
    assert mean_after > mean_before + 1.0, (mean_before, mean_after, curve)
    store.close()
