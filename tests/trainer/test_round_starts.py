"""Start points across rounds (champion / self / fresh), tenants, and bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.errors import TrainerConfigError
from trainer.round import run_round
from trainer.tasks import reasoning_gym_prompts
from trainer.data import snapshot_table, split_snapshot
from trainer.types import RoundSpec
from trainer.data import round_inputs
from trainer.evaluation.gate import gate_round
from trainer.round import RoundParts

RL = RLConfig(
    steps_per_round=1,
    prompts_per_step=2,
    rollout={"group_size": 2, "max_new_tokens": 3, "engine": "hf"},
    gate={"eval_prompts": 2, "max_kl": 100.0},
)
MIX = [RewardTerm(fn="format")]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(folder / "adapter_model.safetensors"))


def test_champion_self_and_tenants_across_two_rounds(tiny_model: Path, tmp_path: Path) -> None:
    prompts = reasoning_gym_prompts("basic_arithmetic", 8, seed=2, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    model = ModelConfig(name=str(tiny_model))
    first = run_round(
        RoundSpec(model, (CandidateConfig(name="x", reward=MIX, start="fresh", learning_rate=1e-2),), RL),
        round_inputs(train, heldout),
        tmp_path / "r1",
    )
    champion = first.candidates[0].adapter_dir
    # t1's champion: those weights moved off the base (one step of the tiny model may leave lora_B at 0)
    moved = tmp_path / "moved"
    shutil.copytree(champion, moved)
    g = torch.Generator().manual_seed(0)
    safetensors.torch.save_file(
        {
            k: v + 0.05 * torch.randn(v.shape, generator=g) if "lora_B" in k else v
            for k, v in _weights(champion).items()
        },
        str(moved / "adapter_model.safetensors"),
    )

    candidates = [
        CandidateConfig(name="from-champ", reward=MIX, start="champion", served_model="t1"),
        CandidateConfig(name="x", reward=MIX, start="self", served_model="t2"),
        CandidateConfig(name="new", reward=MIX, start="fresh", served_model="t2", lora_rank=4),
        CandidateConfig(name="own-ref", reward=MIX, start="champion", served_model="t1", reference="start"),
    ]
    second = gate_round(
        run_round(
            RoundSpec(model, tuple(candidates), RL),
            round_inputs(train, heldout, {"t1": moved, "t2": None}),
            tmp_path / "r2",
        ),
        RL,
    )
    start_champ = _weights(tmp_path / "r2" / "from-champ" / "versions" / "s0")
    start_self = _weights(tmp_path / "r2" / "x" / "versions" / "s0")
    for key, value in _weights(champion).items():
        assert torch.equal(start_self[key], value)
    for key, value in _weights(moved).items():
        assert torch.equal(start_champ[key], value)
    start_new = _weights(tmp_path / "r2" / "new" / "versions" / "s0")
    assert all(v.abs().sum() == 0 for k, v in start_new.items() if "lora_B" in k)  # fresh: B = 0
    by_name = {c.name: c for c in second.candidates}
    # the champion's weights are off the base: their first step's KL is 0 only to their own start
    assert by_name["from-champ"].step_metrics[0]["train/kl"] > 1e-4
    assert by_name["own-ref"].step_metrics[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)
    assert set(second.decisions) == {"t1", "t2"}
    assert "champion" in second.decisions["t1"].reason and "base" in second.decisions["t2"].reason
    assert set(second.decisions["t2"].candidate_reward_means) == {"x", "new"}
    assert len(second.eval_prompt_ids) == 2 and second.train_rows == 6 and second.heldout_rows == 2


def test_duplicate_names_are_refused_before_any_work(tiny_model: Path, tmp_path: Path) -> None:
    prompts = reasoning_gym_prompts("basic_arithmetic", 4, seed=2)
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    twice = [CandidateConfig(name="a", reward=MIX), CandidateConfig(name="a", reward=MIX)]
    with pytest.raises(TrainerConfigError, match=r"duplicate candidate names \['a'\]"):
        run_round(
            RoundSpec(ModelConfig(name=str(tiny_model)), tuple(twice), RL), round_inputs(train, heldout), tmp_path
        )
    taken = [CandidateConfig(name="reward-model-champion", reward=MIX)]
    with pytest.raises(TrainerConfigError, match=r"candidate names \['reward-model-champion'\] are the reward model"):
        RoundSpec(ModelConfig(name=str(tiny_model)), tuple(taken), RL)
    with pytest.raises(TrainerConfigError, match="rl.rollout.url"):
        run_round(
            RoundSpec(
                ModelConfig(name=str(tiny_model)),
                tuple(twice[:1]),
                RL.model_copy(update={"rollout": RL.rollout.model_copy(update={"engine": "vllm"})}),
            ),
            round_inputs(train, heldout),
            tmp_path,
        )


class _Stop(Exception):
    pass


def test_checkpoint_sees_every_phase_and_can_stop_the_round(tiny_model: Path, tmp_path: Path) -> None:
    """The service cancels through this hook: a raise mid-training ends the round cleanly."""
    from trainer.model.base import load_base
    from trainer.rollout.hf import HFEngine

    prompts = reasoning_gym_prompts("basic_arithmetic", 8, seed=2, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    model, rl = ModelConfig(name=str(tiny_model)), RL.model_copy(update={"steps_per_round": 3})
    cands = [
        CandidateConfig(name="a", reward=MIX, start="fresh"),
        CandidateConfig(name="b", reward=MIX, start="fresh", lora_rank=4),
    ]

    phases: list[str] = []
    run_round(RoundSpec(model, tuple(cands), rl), round_inputs(train, heldout), tmp_path / "r1", on_phase=phases.append)
    assert phases == [
        "train:0",
        "train:1",
        "train:2",
        "evaluate",
        "evaluate:greedy",
        "evaluate:score:a",
        "evaluate:score:b",
    ]

    base = load_base(model)
    adapters_before = set(getattr(base.model, "peft_config", {}))
    engines: list[HFEngine] = []

    def stop_at_step_1(phase: str) -> None:
        phases.append(phase)
        if phase == "train:1":
            raise _Stop

    from trainer.round import RoundRecipe

    class SpyRecipe(RoundRecipe):  # the round as it is, remembering the engine it made
        def _setup_engine(self, base, store):
            engines.append(super()._setup_engine(base, store))
            return engines[-1]

    phases.clear()
    with pytest.raises(_Stop):
        SpyRecipe(
            RoundSpec(model, tuple(cands), rl),
            round_inputs(train, heldout),
            tmp_path / "r2",
            on_phase=stop_at_step_1,
            parts=RoundParts(base=base),
        ).run()
    assert phases == ["train:0", "train:1"]
    assert engines and engines[0].versions == {}, "versions published before the stop are unloaded"
    assert set(getattr(base.model, "peft_config", {})) == adapters_before, (
        "the candidates' adapters are removed from the base"
    )
    assert not (tmp_path / "r2" / "a" / "adapter").exists()


def test_rows_without_a_reference_are_left_out_of_exact_answer_candidates(tiny_model: Path, tmp_path: Path) -> None:
    """Gateway traffic carries no reference answer: such rows are skipped, not fatal."""
    from trainer.errors import DataError
    from trainer.types import Prompt

    graded = reasoning_gym_prompts("basic_arithmetic", 8, seed=2, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    plain = [
        Prompt(
            prompt_id=f"chat-{i}", messages=[{"role": "user", "content": f"hello {i}"}], metadata={"endpoint": "chat"}
        )
        for i in range(8)
    ]
    mixed = [x for pair in zip(graded, plain) for x in pair]
    train, heldout = split_snapshot(snapshot_table(mixed), 0.5)
    exact = [CandidateConfig(name="exact", reward=[RewardTerm(fn="exact_answer")], start="fresh")]
    result = run_round(
        RoundSpec(ModelConfig(name=str(tiny_model)), tuple(exact), RL), round_inputs(train, heldout), tmp_path / "r1"
    )
    assert result.eval_prompt_ids and all(not pid.startswith("chat-") for pid in result.eval_prompt_ids)
    assert len(result.candidates[0].step_metrics) == 1

    only_plain_train, only_plain_heldout = split_snapshot(snapshot_table(plain), 0.5)
    with pytest.raises(DataError, match="reference_answer"):
        run_round(
            RoundSpec(ModelConfig(name=str(tiny_model)), tuple(exact), RL),
            round_inputs(only_plain_train, only_plain_heldout),
            tmp_path / "r2",
        )
