"""The executor seam's pure parts: the cost rule, the longest-first assignment, actor sizing,
the pyarrow.fs exchange, and the config fields (no Ray cluster needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from trainer.config import RayConfig, CandidateConfig, RewardTerm, RLConfig
from trainer.errors import TrainerConfigError
from trainer.executors.executor import make_executor
from trainer.executors.exchange import Exchange
from trainer.executors.local import LocalExecutor
from trainer.executors.ray_executor import assign, estimate_cost
from trainer.executors.ray_pool import actor_count


def _cand(name: str, algorithm: str = "grpo") -> CandidateConfig:
    reward = [RewardTerm(fn="logged")] if algorithm in ("kto", "offline_is") else [RewardTerm(fn="exact_answer")]
    return CandidateConfig(name=name, algorithm=algorithm, reward=reward, start="fresh")


def test_cost_counts_rollout_tokens_twice_for_online_candidates() -> None:
    rl = RLConfig(steps_per_round=3, prompts_per_step=2, rollout={"group_size": 4, "max_new_tokens": 10})
    assert estimate_cost(_cand("a"), rl) == 2 * 3 * 2 * 4 * 10
    assert estimate_cost(_cand("b", "kto"), rl) == 3 * 2 * 4 * 10


def test_assignment_is_greedy_longest_first_and_keeps_the_configured_order() -> None:
    rl = RLConfig()
    cands = [_cand("k1", "kto"), _cand("g1"), _cand("k2", "kto"), _cand("g2"), _cand("g3")]
    shares = assign(cands, rl, 2)
    # costliest first (grpo 2 units, kto 1): g1 -> 0, g2 -> 1, g3 -> 0 (loads 4, 2), k1 -> 1, k2 -> 1 (4, 4)
    assert [[c.name for c in s] for s in shares] == [["g1", "g3"], ["k1", "k2", "g2"]]
    assert sum(estimate_cost(c, rl) for c in shares[0]) == sum(estimate_cost(c, rl) for c in shares[1])
    assert [[c.name for c in s] for s in assign(cands[:1], rl, 3)] == [["k1"], [], []]
    with pytest.raises(TrainerConfigError, match="at least one trainer actor"):
        assign(cands, rl, 0)


def test_actor_count_is_one_per_gpu_or_as_configured_never_more_than_candidates() -> None:
    assert actor_count(RLConfig(), 4, {"CPU": 16.0, "GPU": 3.0}) == (3, 1)
    assert actor_count(RLConfig(), 2, {"CPU": 16.0, "GPU": 3.0}) == (2, 1)
    assert actor_count(RLConfig(), 4, {"CPU": 2.0}) == (1, 0)
    assert actor_count(RLConfig(ray={"actors": 2}), 4, {"CPU": 2.0}) == (2, 0)
    assert actor_count(RLConfig(ray={"actors": 8, "actor_gpus": 0}), 4, {"CPU": 2.0, "GPU": 2.0}) == (4, 0)


def test_exchange_round_trips_folders_and_text_by_uri(tmp_path: Path) -> None:
    src = tmp_path / "adapter"
    src.mkdir()
    (src / "adapter_model.safetensors").write_bytes(b"\x00weights")
    (src / "adapter_config.json").write_text('{"r": 8}')
    for uri in (str(tmp_path / "shared"), f"file://{tmp_path / 'shared2'}"):
        ex = Exchange(uri, "r1")
        ex.put_dir(src, "adapters", "a")
        ex.put_text('{"ok": true}', "results", "actor-0.json")
        back = ex.get_dir(tmp_path / "back" / uri[-7:], "adapters", "a")
        assert (back / "adapter_model.safetensors").read_bytes() == b"\x00weights"
        assert ex.get_text("results", "actor-0.json") == '{"ok": true}'
        ex.remove()
        assert not (Path(uri.removeprefix("file://")) / "r1").exists()
    with pytest.raises(TrainerConfigError, match="not a pyarrow.fs URI"):
        Exchange("nosuch://bucket/x", "r1")


def test_executor_settings_are_validated_and_local_is_the_default() -> None:
    assert isinstance(make_executor(RLConfig()), LocalExecutor)
    from trainer.executors.ray_executor import RayExecutor

    assert isinstance(make_executor(RLConfig(executor="ray")), RayExecutor)
    assert RLConfig().executor == "local" and RLConfig().ray.address == "auto"
    for bad in (
        {"executor": "spark"},
        {"ray": {"actors": 0}},
        {"ray": {"actor_cpus": 0}},
        {"ray": {"actor_gpus": 2}},
        {"ray": {"connect_timeout_s": 0}},
    ):
        with pytest.raises(ValidationError):
            RLConfig(**bad)
    assert RLConfig.model_fields["executor"].description
    for name in (
        "address",
        "actors",
        "actor_cpus",
        "actor_gpus",
        "connect_timeout_s",
        "placement_timeout_s",
        "keep_actors",
        "storage_uri",
    ):
        assert RayConfig.model_fields[name].description
