"""The ``ray`` executor on a real local Ray cluster (2 CPUs): the same round as the local
executor, candidate for candidate (also with a candidate scored by the round's reward model,
which the actors load from the exchange), and a round that cannot place its actors fails with the
reason after its timeout and leaves no placement group behind; kept actors serve the next round."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainer.config import CandidateConfig, ModelConfig, RewardModelConfig, RewardTerm, RLConfig
from trainer.errors import PlacementTimeoutError
from trainer.types import TrainJob
from trainer.executors import ray_pool
from trainer.executors.ray_pool import release_kept_actors
from trainer.executors.executor import make_executor
from trainer.round import run_round
from tests.trainer.ray_helpers import leftovers, until_clean
from trainer.types import Prompt
from trainer.tasks import reasoning_gym_prompts
from trainer.data import snapshot_table, split_snapshot
from trainer.types import RoundSpec
from trainer.data import round_inputs
from trainer.evaluation.gate import gate_round

pytestmark = pytest.mark.integration


def _assert_bit_identical(mine: Path, theirs: Path, name: str) -> None:
    """The adapter a Ray actor trained equals the local executor's bit for bit.

    Exact by construction, not by luck: an actor runs the local executor's code (sequential
    ``update_step``, ``HFEngine`` generating each version's requests as their own batches, so a
    candidate's rows, shapes and order do not depend on which candidates share its process) on the same
    weights, in one torch thread as the local run here (``rl.ray_actor_cpus = 1``), with the kernels of
    the same machine: the Ray workers inherit the driver's environment (``ATEN_CPU_CAPABILITY``,
    ``ONEDNN_MAX_CPU_ISA``, ``MKL_CBWR``), so the float32 sums run in the same order. A tolerance would not
    help: any rounding difference grows through AdamW to up to the learning rate on elements with a
    near-zero gradient (``tests/trainer/adamw_tolerance.py``) and then changes the sampled tokens, which
    the exact ``eval_rewards`` / ``train/reward_mean`` comparisons would report anyway.
    """
    a = safetensors.torch.load_file(str(mine / "adapter_model.safetensors"))
    b = safetensors.torch.load_file(str(theirs / "adapter_model.safetensors"))
    assert a.keys() == b.keys(), name
    differ = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not differ, (name, differ)


def test_four_candidates_over_two_actors_match_the_local_executor(
    ray_cluster, peaked_model: Path, tmp_path: Path
) -> None:
    prompts = reasoning_gym_prompts(
        "basic_arithmetic", 12, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    reward = [RewardTerm(fn="tests.trainer.ray_helpers:no_newline")]
    cands = [
        CandidateConfig(name=f"c{i}", learning_rate=lr, kl_coef=0.0, reward=reward, start="fresh")
        for i, lr in enumerate([2e-2, 1e-2, 5e-3, 1e-3])
    ]
    rl = RLConfig(
        steps_per_round=2,
        prompts_per_step=2,
        rollout={"group_size": 4, "max_new_tokens": 4, "engine": "hf"},
        gate={"eval_prompts": 4, "max_kl": 100.0, "reward": reward, "bootstrap_samples": 100},
        adapter_store="offload",
    )
    model = ModelConfig(name=str(peaked_model), dtype="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each actor (rl.ray.actor_cpus = 1): CPU sampling draws depend on the thread count
    try:
        started = time.perf_counter()
        local = gate_round(
            run_round(
                RoundSpec(model, tuple(cands), rl),
                round_inputs(train, heldout),
                tmp_path / "local" / "r1",
                round_id="r1",
            ),
            rl,
        )
        local_s = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    on_ray = gate_round(
        run_round(
            RoundSpec(
                model,
                tuple(cands),
                rl.model_copy(update={"executor": "ray", "ray": rl.ray.model_copy(update={"actors": 2})}),
            ),
            round_inputs(train, heldout),
            tmp_path / "ray" / "r1",
            round_id="r1",
        ),
        rl.model_copy(update={"executor": "ray", "ray": rl.ray.model_copy(update={"actors": 2})}),
    )

    assert local.decisions["hourglass"].winner is not None, local.decisions[
        "hourglass"
    ].reason  # the test needs a winner
    assert on_ray.decisions["hourglass"].winner == local.decisions["hourglass"].winner
    assert on_ray.metrics["executor/actors"] == 2.0
    assert (
        0 < on_ray.metrics["executor/actor0/utilisation"] <= 1
        and 0 < on_ray.metrics["executor/actor1/utilisation"] <= 1
    )
    by_name = {c.name: c for c in on_ray.candidates}
    for mine in local.candidates:
        theirs = by_name[mine.name]
        assert theirs.eval_rewards == mine.eval_rewards, mine.name
        assert [m["train/reward_mean"] for m in theirs.step_metrics] == [
            m["train/reward_mean"] for m in mine.step_metrics
        ]
        _assert_bit_identical(mine.adapter_dir, theirs.adapter_dir, mine.name)
    assert not (tmp_path / "ray" / "r1" / "exchange" / "r1").exists()  # the exchange folder is cleaned up
    assert until_clean() == ([], [])
    print(f"local round {local_s:.1f}s, ray round {on_ray.metrics['round/wall_s']:.1f}s")


def test_a_round_that_cannot_place_its_actors_fails_after_the_timeout(ray_cluster, tmp_path: Path) -> None:
    rl = RLConfig(
        executor="ray", ray={"actors": 2, "actor_cpus": 2, "placement_timeout_s": 1.5}
    )  # 4 CPUs on a 2-CPU cluster
    cands = (CandidateConfig(name="a", start="fresh"), CandidateConfig(name="b", start="fresh"))
    job = TrainJob(ModelConfig(name="unused"), cands, (), rl, {}, tmp_path, "r-wait")
    started = time.monotonic()
    with pytest.raises(
        PlacementTimeoutError,
        match=r"could not reserve 2 trainer actor\(s\) of \{'CPU': 2\.0\} within rl.ray.placement_timeout_s=1.5s",
    ):
        make_executor(rl).train(job, None, None, None)
    assert time.monotonic() - started < 15
    assert until_clean() == ([], [])


def test_kept_actors_serve_the_next_round_until_released(ray_cluster, tiny_model: Path, tmp_path: Path) -> None:
    import ray

    prompts = reasoning_gym_prompts("basic_arithmetic", 8, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    cands = [CandidateConfig(name=n, start="fresh", reward=[RewardTerm(fn="format")]) for n in ("a", "b")]
    rl = RLConfig(
        steps_per_round=1,
        prompts_per_step=1,
        rollout={"group_size": 2, "max_new_tokens": 2, "engine": "hf"},
        gate={"eval_prompts": 2, "bootstrap_samples": 100},
        executor="ray",
        ray={"actors": 1, "keep_actors": True},
    )
    model = ModelConfig(name=str(tiny_model))
    # what the service does at its start: the actors start in the background, before any round
    assert ray_pool.warm(rl, model, len(cands))
    deadline = time.monotonic() + 120  # the actor registers asynchronously (seconds on a loaded host)
    while (left := leftovers())[0] != ["TrainerActor"] and time.monotonic() < deadline:
        time.sleep(0.2)
    actors, [group] = left
    assert actors == ["TrainerActor"] and group.startswith("hourglass-warm-")
    ray.get(ray_pool._KEPT["pool"].ready, timeout=300)  # started: base loaded
    first = run_round(RoundSpec(model, tuple(cands), rl), round_inputs(train, heldout), tmp_path / "r1", round_id="r1")
    assert first.metrics["executor/actors_reused"] == 0.0  # it never trained before, but it had started:
    assert first.metrics["executor/start_wait_s"] < 1.0 and first.metrics["executor/placement_wait_s"] < 1.0
    assert leftovers() == (["TrainerActor"], [group])  # the same actor, kept for the next round
    assert ray_pool.warm(rl, model, len(cands)) and leftovers() == (["TrainerActor"], [group])  # it fits: kept
    second = run_round(RoundSpec(model, tuple(cands), rl), round_inputs(train, heldout), tmp_path / "r2", round_id="r2")
    assert second.metrics["executor/actors_reused"] == 1.0 and second.metrics["executor/placement_wait_s"] == 0.0
    assert [c.name for c in second.candidates] == ["a", "b"]
    release_kept_actors()
    assert until_clean() == ([], [])


def _feedback_rows(n: int) -> list[Prompt]:
    """Served answers with thumbs (those ending in ' banana' were liked): enough for a reward model."""
    words = "apple river stone cloud green seven table music light paper".split()
    return [
        Prompt(
            prompt_id=f"f{i:03d}",
            messages=[{"role": "user", "content": f"Say a few words about thing {i}."}],
            metadata={"reference_answer": "banana"},
            logged_completion=" ".join([words[i % 10], words[(i * 3) % 10], "banana" if i % 2 == 0 else words[i % 7]]),
            logged_reward=1.0 if i % 2 == 0 else -1.0,
        )
        for i in range(n)
    ]


def test_a_reward_model_candidate_on_ray_scores_with_the_rounds_reward_model_like_local(
    ray_cluster, peaked_model: Path, tmp_path: Path
) -> None:
    train, heldout = split_snapshot(snapshot_table(_feedback_rows(32)), 0.25)
    cands = [
        CandidateConfig(
            name="rm",
            learning_rate=2e-2,
            kl_coef=0.0,
            start="fresh",
            reward=[RewardTerm(fn="reward_model", kwargs={"probability": False})],
        ),
        CandidateConfig(name="fmt", learning_rate=2e-2, kl_coef=0.0, start="fresh", reward=[RewardTerm(fn="format")]),
    ]
    rl = RLConfig(
        steps_per_round=2,
        prompts_per_step=2,
        rollout={"group_size": 4, "max_new_tokens": 4, "engine": "hf"},
        gate={"eval_prompts": 4, "max_kl": 100.0, "bootstrap_samples": 100},
        adapter_store="offload",
    )
    reward_cfg = RewardModelConfig(steps=4, batch_size=8, learning_rate=5e-3, start="fresh", min_examples=8)
    model = ModelConfig(name=str(peaked_model), dtype="float32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the driver trains the reward model, with the actors' thread count: the same scores
    try:
        results = {
            executor: gate_round(
                run_round(
                    RoundSpec(
                        model,
                        tuple(cands),
                        rl.model_copy(
                            update={
                                "reward_model": reward_cfg,
                                "executor": executor,
                                "ray": rl.ray.model_copy(update={"actors": 2}),
                            }
                        ),
                    ),
                    round_inputs(train, heldout),
                    tmp_path / executor / "r1",
                    round_id="r1",
                ),
                rl,
            )
            for executor in ("local", "ray")
        }
    finally:
        torch.set_num_threads(threads)
    local, on_ray = results["local"], results["ray"]

    assert on_ray.metrics["executor/actors"] == 2.0  # "fmt" and "rm" trained by different actors
    assert local.reward_model is not None and on_ray.reward_model is not None
    assert (
        on_ray.reward_model.report.auc == local.reward_model.report.auc
    )  # the same reward model, trained by the driver
    theirs = {c.name: c for c in on_ray.candidates}
    for mine in local.candidates:
        steps = theirs[mine.name].step_metrics
        # exact (see _assert_bit_identical): the actor scores the same rollouts with the reward model's weights
        # read back from the exchange (safetensors: bit for bit) in the same batch, since "rm" is the only
        # candidate on the reward model (several, on different actors, would be batched differently)
        assert [m["train/reward_mean"] for m in steps] == [m["train/reward_mean"] for m in mine.step_metrics], mine.name
        # the actor scored its rollouts with the reward model only where the candidate learns from it
        assert all(("train/reward_model_score_s" in m) == (mine.name == "rm") for m in steps), mine.name
        _assert_bit_identical(mine.adapter_dir, theirs[mine.name].adapter_dir, mine.name)
    trained = safetensors.torch.load_file(str(theirs["rm"].adapter_dir / "adapter_model.safetensors"))
    assert any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)  # the scores moved it (B starts at 0)
    rm_rewards = [m["train/reward_mean"] for m in theirs["rm"].step_metrics]
    assert len(set(rm_rewards)) > 1 or rm_rewards[0] != 0.0  # real scores, not a constant stand-in
    assert on_ray.decisions["hourglass"].winner == local.decisions["hourglass"].winner
    assert until_clean() == ([], [])
