"""Phase timers: a round's metrics break its wall time down by phase."""

from __future__ import annotations

import time
from pathlib import Path

from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.timers import PHASES, collect, phase
from trainer.round import run_round
from trainer.tasks import reasoning_gym_prompts
from trainer.data import snapshot_table, split_snapshot
from trainer.types import RoundSpec
from trainer.data import round_inputs


def test_phases_add_up_and_do_not_nest() -> None:
    with phase("time/rollout_s"):  # outside collect(): not counted anywhere, no error
        pass
    with collect() as times:
        with phase("time/rollout_s"):
            time.sleep(0.02)
            with phase("time/reference_s"):  # nested: counted in the outer phase only
                time.sleep(0.02)
        with phase("time/rollout_s"):
            time.sleep(0.01)
    assert set(PHASES) <= set(times)
    assert 0.05 <= times["time/rollout_s"] < 1.0
    assert times["time/reference_s"] == 0.0


def test_round_metrics_hold_every_phase(tiny_model: Path, tmp_path: Path) -> None:
    prompts = reasoning_gym_prompts(
        "basic_arithmetic", 12, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    cands = [CandidateConfig(name=n, reward=[RewardTerm(fn="exact_answer")], start="fresh") for n in ("a", "b")]
    rl = RLConfig(
        steps_per_round=2,
        prompts_per_step=2,
        rollout={"group_size": 2, "max_new_tokens": 4, "engine": "hf"},
        gate={"eval_prompts": 2, "max_kl": 100.0},
    )
    result = run_round(
        RoundSpec(ModelConfig(name=str(tiny_model), dtype="float32"), tuple(cands), rl),
        round_inputs(train, heldout),
        tmp_path / "r1",
    )
    m = result.metrics
    assert all(key in m for key in PHASES), sorted(m)
    timed = [key for key in PHASES if key != "time/reward_model_s"]
    assert all(m[key] > 0 for key in timed), {k: m[k] for k in PHASES}
    assert m["time/reward_model_s"] == 0.0  # no candidate and no gate here needs a reward model: none was trained
    assert sum(m[key] for key in PHASES) <= m["round/wall_s"]
