"""Learning: GRPO raises a verifiable reward on a tiny model (HF rollouts),
and offline importance-weighted PG learns from logged rewards. Fixed seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer import rewards
from trainer.adapters.store import make_store
from trainer.model.base import load_base
from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.round import run_round
from trainer.types import Prompt
from trainer.tasks import reasoning_gym_prompts
from trainer.data import snapshot_table, split_snapshot
from trainer.types import RoundSpec
from trainer.data import round_inputs
from trainer.evaluation.gate import gate_round


def _newline_share(prompt_messages, completion: str, metadata) -> float:
    """Toy verifiable reward: newlines per completion token slot (4 tokens)."""
    return completion.count("\n") / 4


def test_grpo_raises_reward_on_a_toy_task(peaked_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(rewards.BUILTINS, "newline_share", _newline_share)
    prompts = reasoning_gym_prompts(
        "basic_arithmetic", 24, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    candidate = CandidateConfig(
        name="nl", learning_rate=2e-3, kl_coef=0.0, reward=[RewardTerm(fn="newline_share")], start="fresh"
    )
    rl = RLConfig(
        steps_per_round=16,
        prompts_per_step=2,
        rollout={"group_size": 8, "max_new_tokens": 4, "engine": "hf"},
        adapter_store="offload",
        gate={"eval_prompts": 4, "max_kl": 100.0},
        seed=0,
    )
    result = gate_round(
        run_round(
            RoundSpec(ModelConfig(name=str(peaked_model)), (candidate,), rl),
            round_inputs(train, heldout),
            tmp_path / "r1",
        ),
        rl,
    )

    curve = [m["train/reward_mean"] for m in result.candidates[0].step_metrics]
    first, last = sum(curve[:4]) / 4, sum(curve[-4:]) / 4
    assert last > first + 0.1, f"reward did not rise: {curve}"
    metrics = result.candidates[0].step_metrics[-1]
    for key in (
        "train/loss",
        "train/reward_std",
        "train/kl",
        "train/clip_frac",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/swap_s",
    ):
        assert key in metrics
    assert (result.candidates[0].adapter_dir / "adapter_model.safetensors").is_file()
    assert (tmp_path / "last" / "nl" / "adapter_config.json").is_file()  # where start="self" resumes
    assert result.decisions["hourglass"].served_model == "hourglass"


@torch.no_grad()
def _logprob_of(base, prompts: list[Prompt], text: str) -> float:
    completion = base.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = [base.chat_token_ids(p.messages) for p in prompts]
    lp_BT, mask_BT = base.completion_logprobs(ids, [completion] * len(ids))
    return float((lp_BT * mask_BT).sum() / len(ids))


def test_offline_is_learns_from_logged_rewards(tiny_model: Path, tmp_path: Path) -> None:
    rows = []
    for i in range(24):
        good = i % 2 == 0
        rows.append(
            Prompt(
                prompt_id=f"row{i:02d}",
                messages=[{"role": "user", "content": f"Is {i} fine?"}],
                metadata={"reference_answer": "yes"},
                logged_completion="yes" if good else "no",
                logged_reward=1.0 if good else 0.0,
                logged_adapter_version="base",
            )
        )
    train, heldout = split_snapshot(snapshot_table(rows), 0.25)
    candidate = CandidateConfig(
        name="off",
        algorithm="offline_is",
        learning_rate=5e-3,
        kl_coef=0.0,
        reward=[RewardTerm(fn="logged")],
        start="fresh",
    )
    rl = RLConfig(
        steps_per_round=8,
        prompts_per_step=2,
        rollout={"group_size": 4, "max_new_tokens": 4, "engine": "hf"},
        gate={"eval_prompts": 2, "max_kl": 100.0},
    )
    result = gate_round(
        run_round(
            RoundSpec(ModelConfig(name=str(tiny_model)), (candidate,), rl),
            round_inputs(train, heldout),
            tmp_path / "r1",
        ),
        rl,
    )
    assert all(m["train/behaviour_from_reference"] == 1.0 for m in result.candidates[0].step_metrics)

    base = load_base(ModelConfig(name=str(tiny_model)))
    held = rows[18:]
    yes0, no0 = _logprob_of(base, held, "yes"), _logprob_of(base, held, "no")
    store = make_store("offload", base)
    store.create("off", candidate, init_dir=result.candidates[0].adapter_dir)
    store.activate("off")
    yes1, no1 = _logprob_of(base, held, "yes"), _logprob_of(base, held, "no")
    assert yes1 - no1 > (yes0 - no0) + 1.0, (yes0, no0, yes1, no1)


def test_offline_batch_cuts_logged_completions_to_max_seq_len(tiny_model: Path) -> None:
    """A logged completion from traffic can be ~250k tokens within kafka.max_record_bytes; the offline
    update must not run the model over all of it (logits of [T, vocab] per row: an OOM of the service)."""
    from trainer.rewards import build_reward
    from trainer.algorithms.offline_is import offline_batch

    base = load_base(ModelConfig(name=str(tiny_model), max_seq_len=64))
    prompts = [
        Prompt(
            prompt_id="long",
            messages=[{"role": "user", "content": "hi"}],
            logged_completion="x",
            logged_token_ids=[7] * 5000,
            logged_logprobs=[-0.5] * 5000,
            logged_reward=1.0,
        ),
        Prompt(
            prompt_id="text",
            messages=[{"role": "user", "content": "hi"}],
            logged_completion="word " * 3000,
            logged_reward=-1.0,
        ),
        Prompt(
            prompt_id="short",
            messages=[{"role": "user", "content": "hi"}],
            logged_completion="ok",
            logged_token_ids=[5, 6],
            logged_logprobs=[-0.1, -0.2],
            logged_reward=0.5,
        ),
    ]
    prompt_ids = [base.chat_token_ids(p.messages) for p in prompts]
    batch, _ = offline_batch(prompts, prompt_ids, base, build_reward([RewardTerm(fn="logged")]))
    for p, c, b in zip(batch.prompt_ids, batch.completion_ids, batch.behaviour_logprobs):
        assert 1 <= len(c) and len(p) + len(c) <= 64 and len(b) == len(c)
    assert batch.completion_ids[0] == [7] * (64 - len(prompt_ids[0])) and batch.behaviour_logprobs[0][0] == -0.5
    assert batch.completion_ids[2] == [5, 6] and batch.behaviour_logprobs[2] == pytest.approx([-0.1, -0.2])
