"""The TRL peer of bench/multilora.py: the recipe mapped onto GRPOConfig (bench/trl_grpo.py), the data handed to
each TRL process (bench/peer_trl.py), and the learning lines (bench/multilora_report.py). No TRL needed."""

from __future__ import annotations

import pytest

from bench.multilora_report import Learned, learning_lines, paired_difference
from bench.peer_trl import experiment_spec
from bench.trl_grpo import grpo_settings
from trainer.config import CandidateConfig, RewardTerm, RLConfig
from trainer.plan import draw_prompts
from trainer.types import Prompt, Sample
from trainer.config import ModelConfig
from trainer.model import store as model_store
from trainer.data import prompts_from_table, snapshot_table

MIX = [RewardTerm(fn="first_number_answer"), RewardTerm(fn="format", weight=0.5)]


def _spec(**workload: object) -> dict:
    w = {"steps": 3, "prompts": 4, "group": 6, "max_new_tokens": 12, "temperature": 1.0, "clip_eps": 0.2}
    return {
        "seed": 7,
        "candidate": {"learning_rate": 5e-4, "kl_coef": 0.01},
        "workload": w | {"max_grad_norm": 1.0} | workload,
    }


def test_the_six_trl_defaults_that_change_the_recipe_are_set_to_ours() -> None:
    s = grpo_settings(_spec(), "/tmp/x", use_cpu=True)
    assert s["bf16"] is False and s["fp16"] is False  # TRL default bf16 autocast
    assert s["gradient_checkpointing"] is False  # TRL default True
    assert s["lr_scheduler_type"] == "constant" and s["warmup_steps"] == 0  # transformers default linear decay
    assert s["learning_rate"] == 5e-4  # TRL default 1e-6
    assert s["beta"] == 0.01  # TRL default 0: no KL, no reference
    assert s["optim"] == "adamw_torch" and s["weight_decay"] == 0.0  # default fused AdamW


def test_one_trl_step_is_one_round_step() -> None:
    s = grpo_settings(_spec(), "/tmp/x", use_cpu=True)
    assert s["max_steps"] == 3
    assert s["per_device_train_batch_size"] == 4 * 6 and s["gradient_accumulation_steps"] == 1
    assert s["num_generations"] == 6 and s["num_iterations"] == 1
    assert s["max_completion_length"] == 12 and s["temperature"] == 1.0 and s["top_k"] == 0 and s["top_p"] == 1.0
    assert s["epsilon"] == 0.2 and s["loss_type"] == "dapo" and s["max_grad_norm"] == 1.0
    assert s["shuffle_dataset"] is False and s["seed"] == 7 and s["use_vllm"] is False


def _table(n: int):
    prompts = [
        Prompt(f"p{i}", [{"role": "user", "content": f"{i} + 1 ="}], {"reference_answer": str(i + 1)}) for i in range(n)
    ]
    return snapshot_table(prompts)


def test_trl_gets_the_rounds_prompts_in_the_rounds_order() -> None:
    cand = CandidateConfig(name="c0", reward=MIX)
    rl = RLConfig(
        steps_per_round=3,
        prompts_per_step=4,
        rollout={"group_size": 2},
        gate={"eval_prompts": 5, "reward": MIX[:1]},
        seed=3,
    )
    train, heldout = _table(30), _table(8)
    spec = experiment_spec(cand, rl, train, heldout, "/m", MIX[:1])
    pool = prompts_from_table(train)
    expected = [p.prompt_id for step in range(3) for p in draw_prompts(pool, 4, 3 * 7919 + step)]
    assert [r["prompt_id"] for r in spec["train_rows"]] == expected  # trainer.plan.draw_prompts' draw
    assert [r["prompt_id"] for r in spec["eval_rows"]] == [f"p{i}" for i in range(5)]
    assert spec["train_rows"][0]["metadata"]["reference_answer"] == str(int(expected[0][1:]) + 1)
    assert spec["candidate"]["name"] == "c0" and spec["seed"] == 3


def test_paired_difference_is_mean_and_standard_error_over_shared_candidates() -> None:
    diff, se = paired_difference({"c0": 0.3, "c1": 0.2, "c2": 0.9}, {"c0": 0.1, "c1": 0.2})
    assert diff == pytest.approx(0.1) and se == pytest.approx(0.1)
    assert paired_difference({"c0": 1.0}, {"c1": 1.0})[0] != paired_difference({"c0": 1.0}, {"c1": 1.0})[0]  # NaN


def test_learning_lines_report_gain_per_side_and_difference_against_b() -> None:
    trl = Learned.from_reports(
        [
            {"eval_base": 0.1, "eval_reward": {"c0": 0.2}, "train_reward": {"c0": [0.1, 0.3]}},
            {"eval_base": 0.1, "eval_reward": {"c1": 0.3}, "train_reward": {"c1": [0.2, 0.4]}},
        ]
    )
    b = Learned(base=0.1, after={"c0": 0.15, "c1": 0.25}, train={"c0": [0.1, 0.2], "c1": [0.1, 0.2]})
    assert trl.gain == pytest.approx(0.15)
    lines = learning_lines({"TRL": trl, "(b)": b}, 32)
    assert "TRL 0.100 -> 0.250 (+0.150) [0.200, 0.300]" in lines[0]
    assert "(b) 0.100 -> 0.200 (+0.100) [0.150, 0.250]" in lines[0]
    assert "TRL - (b) +0.050 ± 0.000 (largest |per-candidate| 0.050)" in lines[1]
    assert lines[2].endswith("TRL 0.150 -> 0.350, (b) 0.100 -> 0.200")


def test_a_smaller_check_or_another_seed_never_replaces_the_headline_section() -> None:
    import argparse

    from bench.multilora import variant_name

    assert variant_name("round", argparse.Namespace(k=8, seed=0)) == "round"
    assert variant_name("round", argparse.Namespace(k=2, seed=0)) == "round-k2"
    assert variant_name("learn", argparse.Namespace(k=8, seed=1)) == "learn-seed1"


def test_the_section_shows_the_steady_state_round_beside_the_cold_one() -> None:
    import argparse

    from bench.multilora import write_section

    written: dict = {}

    class Recorder:
        def write(self, name, **section):
            written.update(section, name=name)

    phases = {"time/rollout_s": 10.0}
    trl = {
        "wall_s": 400.0,
        "peak_rss": 2**30,
        "reports": [{"phases": {p: 1.0 for p in ("imports", "load", "train", "evaluate")}}],
    }
    b = {"wall_s": 200.0, "peak_rss": 2**30, "report": {"vllm_startup_s": 50.0, "phases": phases, "steady_s": 80.0}}
    args = argparse.Namespace(
        recorder=Recorder(),
        k=8,
        seed=0,
        steps=6,
        prompts=4,
        group=6,
        max_new_tokens=12,
        eval_prompts=96,
        update_mode="one_pass",
        learning_rates=(2.5e-4, 5e-4),
    )
    write_section("learn", args, {"trl": trl, "b": b}, {"TRL/(b)": 2.0, "TRL/(b) steady": 5.0}, [])
    rows = {row[0]: row[1:] for row in written["rows"]}
    assert written["columns"][-2:] == ["TRL/(b)", "TRL/(b) steady"]
    assert rows["wall time"] == ["400.0 s", "200.0 s", "**2.00x**", ""]  # the cold ratio only
    assert rows["steady-state round (base kept, vLLM up)"] == ["", "80.0 s", "", "**5.00x**"]
    assert "TRL/(b) steady at workload `learn`: **5.00x**" in written["result"]
    assert "learning rates 0.00025, 0.0005;" in written["title"]


class _Engine:
    """Answers each adapter version with a fixed text per prompt; records loads and unloads."""

    def __init__(self, texts: dict[str, list[str]], fail: bool = False) -> None:
        self.texts, self.fail, self.loaded, self.unloaded = texts, fail, {}, []

    def load(self, candidate: str, version: str, adapter_dir) -> None:
        self.loaded[version] = (candidate, str(adapter_dir))

    def unload(self, version: str) -> None:
        self.unloaded.append(version)

    def generate(self, requests):
        if self.fail:
            raise RuntimeError("engine down")
        seen: dict[str, int] = {}
        out = []
        for r in requests:
            i = seen.get(r.version, 0)
            seen[r.version] = i + 1
            assert r.temperature == 0.0 and r.max_new_tokens == 12
            out.append([Sample(r.prompt_id, self.texts[r.version][i], (1,), (0.0,), adapter_version=r.version)])
        return out


def _judged(engine: _Engine):
    from transformers import AutoTokenizer

    from bench.peer_trl import judge

    rows = [
        {
            "prompt_id": f"p{i}",
            "messages": [{"role": "user", "content": f"{i} + 1 ="}],
            "metadata": {"reference_answer": str(i + 1)},
        }
        for i in range(4)
    ]
    reports = [
        {"eval_reward": {"c0": 0.0}, "adapter_dir": "/x/c0"},
        {"eval_reward": {"c1": 0.9}, "adapter_dir": "/x/c1"},
    ]
    tok = AutoTokenizer.from_pretrained(model_store.resolve("smollm2-135m-instruct", ModelConfig().cache_dir))
    rl = RLConfig(rollout={"max_new_tokens": 12})
    return judge(engine, reports, rows, tok, rl, [RewardTerm(fn="first_number_answer")])


def test_trl_adapters_are_judged_by_the_rounds_evaluator_and_unloaded_after() -> None:
    engine = _Engine({"trl-c0": ["1", "2", "3", "9"], "trl-c1": ["0", "0", "0", "4"]})
    scores = _judged(engine)
    # the round's scorer on the engine's greedy answers, not the TRL process's own figure (0.0 / 0.9)
    assert scores == {"c0": pytest.approx(0.75), "c1": pytest.approx(0.25)}
    assert engine.loaded == {"trl-c0": ("c0", "/x/c0"), "trl-c1": ("c1", "/x/c1")}
    assert sorted(engine.unloaded) == ["trl-c0", "trl-c1"]


def test_a_failed_judge_still_unloads_the_trl_adapters() -> None:
    engine = _Engine({}, fail=True)
    with pytest.raises(RuntimeError, match="engine down"):
        _judged(engine)
    assert sorted(engine.unloaded) == ["trl-c0", "trl-c1"]


def test_the_candidates_cycle_over_the_learning_rates_they_are_given() -> None:
    from bench.multilora import LEARNING_RATES, WORKLOADS, candidates

    assert [c.learning_rate for c in candidates(3, (1e-3, 4e-3))] == [1e-3, 4e-3, 1e-3]
    assert [c.learning_rate for c in candidates(5)] == [*LEARNING_RATES, LEARNING_RATES[0]]
    assert all(w["learning_rates"] == LEARNING_RATES for w in WORKLOADS.values())  # --learning-rates overrides
