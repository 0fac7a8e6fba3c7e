"""``rl.keep_base``: the always-on service keeps its resident base between rounds (trainer.model.base.KeptBase)."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from pipeline.config import HourglassConfig
from pipeline.rounds.records import RoundRecord
from pipeline.rounds.steps import LiveSteps
from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.data import round_inputs, snapshot_table, split_snapshot
from trainer.model.base import BOOT_ADAPTER, KeptBase
from trainer.round import RoundParts, run_round
from trainer.tasks import reasoning_gym_prompts
from trainer.types import PhaseBoundary, RoundPhase, RoundSpec

RL = RLConfig(
    seed=3,
    steps_per_round=1,
    prompts_per_step=2,
    rollout={"group_size": 2, "max_new_tokens": 3, "engine": "hf"},
    gate={"eval_prompts": 2, "max_kl": 100.0},
)
CANDIDATES = (CandidateConfig(name="x", reward=[RewardTerm(fn="format")], start="fresh", learning_rate=1e-2),)


def _inputs():
    prompts = reasoning_gym_prompts("basic_arithmetic", 8, seed=2, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    return round_inputs(*split_snapshot(snapshot_table(prompts), 0.25))


def _weights(result) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(result.candidates[0].adapter_dir / "adapter_model.safetensors"))


def test_the_second_round_reuses_the_base_and_trains_what_a_fresh_base_trains(tiny_model: Path, tmp_path: Path) -> None:
    spec = RoundSpec(ModelConfig(name=str(tiny_model)), CANDIDATES, RL)
    kept = KeptBase()
    first = run_round(spec, _inputs(), tmp_path / "r1", parts=RoundParts(kept_base=kept))
    assert first.metrics["round/base_reused"] == 0.0 and kept.holds(spec.model)
    base = kept.get(spec.model)
    assert set(base.model.peft_config) == {BOOT_ADAPTER}  # the round's adapters left with it
    torch.manual_seed(0)
    second = run_round(spec, _inputs(), tmp_path / "r2", parts=RoundParts(kept_base=kept))
    assert second.metrics["round/base_reused"] == 1.0 and kept.get(spec.model) is base
    torch.manual_seed(0)
    fresh = run_round(spec, _inputs(), tmp_path / "r3")  # the same round on a base loaded for it
    assert fresh.metrics["round/base_reused"] == 0.0
    for key, value in _weights(fresh).items():
        torch.testing.assert_close(_weights(second)[key], value)
    assert second.candidates[0].eval_rewards == fresh.candidates[0].eval_rewards


def test_a_failed_round_drops_the_kept_base_and_the_next_loads_a_clean_one(tiny_model: Path, tmp_path: Path) -> None:
    spec = RoundSpec(ModelConfig(name=str(tiny_model)), CANDIDATES, RL)
    kept = KeptBase()
    run_round(spec, _inputs(), tmp_path / "r1", parts=RoundParts(kept_base=kept))
    before = kept.get(spec.model)

    def cancel(boundary: PhaseBoundary) -> None:
        if boundary.phase is RoundPhase.EVALUATE:
            raise RuntimeError("cancelled by ops")

    with pytest.raises(RuntimeError, match="cancelled by ops"):
        run_round(spec, _inputs(), tmp_path / "r2", on_phase=cancel, parts=RoundParts(kept_base=kept))
    assert not kept.holds(spec.model)
    after = run_round(spec, _inputs(), tmp_path / "r3", parts=RoundParts(kept_base=kept))
    assert after.metrics["round/base_reused"] == 0.0 and kept.get(spec.model) is not before
    assert set(kept.get(spec.model).model.peft_config) == {BOOT_ADAPTER}


def test_a_base_left_with_an_adapter_or_another_config_is_not_reused(tiny_model: Path) -> None:
    model = ModelConfig(name=str(tiny_model))
    kept = KeptBase()
    base = kept.get(model)
    kept.release(ok=True)
    assert kept.get(model) is base  # clean and the same config: kept
    base.model.add_adapter("left-behind", base.model.peft_config[BOOT_ADAPTER])
    kept.release(ok=True)
    assert not kept.holds(model)
    other = ModelConfig(name=str(tiny_model), max_seq_len=model.max_seq_len // 2)
    first = kept.get(model)
    assert kept.get(other) is not first and kept.holds(other) and not kept.holds(model)


def test_the_service_passes_one_kept_base_to_every_round_unless_keep_base_is_off(tmp_path: Path) -> None:
    seen: list[RoundParts] = []

    def fake_run_round(spec, inputs, out_dir, **kwargs):
        seen.append(kwargs["parts"])
        raise RuntimeError("stop after the parts are seen")

    class NoChampions(LiveSteps):
        def champions(self, candidates):
            return {}, None

    table = snapshot_table(reasoning_gym_prompts("basic_arithmetic", 8, seed=2))
    record = RoundRecord(
        round_id="r1",
        state="train",
        trigger="manual",
        candidates=["default"],
        window="1h",
        created_at="",
        updated_at="",
    )
    for keep in (True, False):
        cfg = HourglassConfig(state_dir=str(tmp_path), rl={"keep_base": keep, "rollout": {"engine": "hf"}})
        steps = NoChampions(cfg, "f" * 64, trainer=fake_run_round)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="stop after"):
                steps.train_and_evaluate(record, table, lambda boundary: None)
    kept_on, kept_on_again, off, off_again = seen
    assert kept_on.kept_base is not None and kept_on_again.kept_base is kept_on.kept_base
    assert off.kept_base is None and off_again.kept_base is None and off.base is None
