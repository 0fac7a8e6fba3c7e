"""The gate: paired bootstrap lower bound, margin and guardrails, reasons in words."""

from __future__ import annotations

import math

import pytest

from trainer.config import CandidateConfig, RLConfig
from trainer.evaluate import EvalResult, gate, paired_bootstrap_lower_bound

RL = RLConfig(gate_margin=0.05, gate_confidence=0.9, bootstrap_samples=500, max_kl=0.5, max_mean_length=20)
CHAMP = tuple([0.0, 1.0] * 10)  # champion mean 0.5 on 20 prompts


def _result(rewards: tuple[float, ...], kl: float = 0.1, length: float = 5.0) -> EvalResult:
    return EvalResult(version="v", samples=(), rewards=rewards, mean_kl=kl, mean_length=length)


def test_bootstrap_bound_is_below_the_mean_and_exact_for_constant_differences() -> None:
    assert paired_bootstrap_lower_bound([0.3] * 10, 0.9, 200) == pytest.approx(0.3)
    diffs = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert paired_bootstrap_lower_bound(diffs, 0.9, 1000) < sum(diffs) / len(diffs)
    assert math.isnan(paired_bootstrap_lower_bound([0.1, float("nan")], 0.9, 200))


def test_gate_promotes_the_clear_winner_and_says_why_others_lost() -> None:
    cands = [CandidateConfig(name=n) for n in ("good", "same", "drift", "long", "broken")]
    results = {
        "good": _result(tuple([1.0] * 20)),
        "same": _result(CHAMP),
        "drift": _result(tuple([1.0] * 20), kl=0.9),
        "long": _result(tuple([1.0] * 20), length=64),
        "broken": _result(tuple([1.0] * 19 + [float("nan")])),
    }
    decision = gate("tenant", cands, results, {c.name: CHAMP for c in cands}, "base", RL)
    assert decision.winner == "good"
    assert decision.lower_bounds["good"] > 0.05 and decision.champion_reward_mean == pytest.approx(0.5)
    assert "promote good" in decision.reason
    assert "drift: mean KL to base 0.900 > max_kl 0.5" in decision.reason
    assert "long: mean length 64.0 tokens > max_mean_length 20" in decision.reason
    assert "broken: NaN" in decision.reason
    assert "same: reward 0.500 vs base 0.500" in decision.reason


def test_gate_keeps_the_champion_when_nobody_passes() -> None:
    cands = [CandidateConfig(name="meh")]
    decision = gate("tenant", cands, {"meh": _result(CHAMP)}, {"meh": CHAMP}, "champion v3", RL)
    assert decision.winner is None and decision.reason.startswith("keep champion v3: no candidate passed")
