"""The canary's sequential decision, by simulation: error rates under repeated looks
stay at or below alpha, and clear differences are decided the right way."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.canary.sequential import ArmStats, decide, half_width

ALPHA = 0.05
MARGIN = 0.05
RUNS = 600
EVENTS = 2000
LOOK_EVERY = 20
FRACTION = 0.2  # the challenger's share of the events
SLACK = 3 * math.sqrt(ALPHA * (1 - ALPHA) / RUNS)  # Monte Carlo error of the estimated rate


def _simulate(
    p_challenger: float,
    p_champion: float,
    *,
    seed: int,
    runs: int = RUNS,
    min_feedback: int = 50,
    lift: float | None = None,
    promoted_diffs: list[float] | None = None,
    margin: float = MARGIN,
    alpha: float = ALPHA,
) -> dict[str, int]:
    """Outcome counts of ``runs`` canaries, each looked at every LOOK_EVERY events until a decision
    (``lift``: ``min_observed_lift``; ``promoted_diffs`` collects the observed difference of each promotion)."""
    rng = np.random.default_rng(seed)
    outcomes = {"promote": 0, "abort": 0, "continue": 0}
    for _ in range(runs):
        to_challenger = rng.random(EVENTS) < FRACTION
        success = rng.random(EVENTS) < np.where(to_challenger, p_challenger, p_champion)
        n_c = np.cumsum(to_challenger)
        k_c = np.cumsum(success & to_challenger)
        n_h = np.cumsum(~to_challenger)
        k_h = np.cumsum(success & ~to_challenger)
        decision = "continue"
        for i in range(LOOK_EVERY - 1, EVENTS, LOOK_EVERY):
            c = _arm(int(n_c[i]), int(k_c[i]))
            h = _arm(int(n_h[i]), int(k_h[i]))
            verdict = decide(c, h, alpha=alpha, margin=margin, min_feedback=min_feedback, min_observed_lift=lift)
            decision = verdict.decision
            if decision != "continue":
                if decision == "promote" and promoted_diffs is not None:
                    promoted_diffs.append(verdict.difference)  # type: ignore[arg-type]
                break
        outcomes[decision] += 1
    return outcomes


def _arm(n: int, k: int) -> ArmStats:
    return ArmStats.of_rewards([1.0] * k + [-1.0] * (n - k), binary=True)


def test_equal_rates_abort_at_most_alpha_with_repeated_looks() -> None:
    outcomes = _simulate(0.6, 0.6, seed=1)
    assert outcomes["abort"] / RUNS <= ALPHA + SLACK, outcomes
    assert outcomes["promote"] > 5 * outcomes["abort"], outcomes  # an equal challenger is promoted far more often


def test_challenger_worse_by_the_margin_promoted_at_most_alpha() -> None:
    outcomes = _simulate(0.6 - MARGIN, 0.6, seed=2)
    assert outcomes["promote"] / RUNS <= ALPHA + SLACK, outcomes


def test_clearly_worse_challenger_is_aborted() -> None:
    outcomes = _simulate(0.3, 0.7, seed=3, runs=200)
    assert outcomes["abort"] >= 0.95 * 200, outcomes
    assert outcomes["promote"] == 0, outcomes


def test_clearly_better_challenger_is_promoted() -> None:
    outcomes = _simulate(0.8, 0.6, seed=4, runs=200)
    assert outcomes["promote"] >= 0.9 * 200, outcomes
    assert outcomes["abort"] == 0, outcomes


def test_rules_min_feedback_floor_and_max_duration() -> None:
    good, base = _arm(40, 36), _arm(400, 240)
    assert decide(good, base, alpha=ALPHA, margin=MARGIN, min_feedback=50).decision == "continue"  # 40 < 50
    assert decide(_arm(60, 54), base, alpha=ALPHA, margin=MARGIN, min_feedback=50).decision == "promote"
    assert (
        decide(_arm(5, 0), base, alpha=ALPHA, margin=MARGIN, min_feedback=50).decision == "continue"
    )  # below the floor
    verdict = decide(_arm(5, 0), base, alpha=ALPHA, margin=MARGIN, min_feedback=50, elapsed_s=61, max_duration_s=60)
    assert verdict.decision == "abort" and "max_duration_s=60" in verdict.reason
    assert verdict.lower is None and "interval" not in verdict.reason  # below the floor: no interval to show
    # Out of time with evidence on both sides: still an abort (even a look that would promote), with the interval
    # of that look in the verdict and its reason, so ops see how close it came.
    late = decide(_arm(60, 54), base, alpha=ALPHA, margin=MARGIN, min_feedback=50, elapsed_s=61, max_duration_s=60)
    on_time = decide(_arm(60, 54), base, alpha=ALPHA, margin=MARGIN, min_feedback=50)
    assert late.decision == "abort" and on_time.decision == "promote"
    assert (late.lower, late.upper, late.difference) == (on_time.lower, on_time.upper, on_time.difference)
    assert late.lower is not None and late.upper is not None
    assert f"interval [{late.lower:+.3f}, {late.upper:+.3f}], margin {MARGIN:g}" in late.reason
    broken = ArmStats(60, float("nan"), float("nan"))  # statistics half_width refuses: still a plain time-out
    stalled = decide(broken, base, alpha=ALPHA, margin=MARGIN, min_feedback=50, elapsed_s=61, max_duration_s=60)
    assert stalled.decision == "abort" and stalled.lower is None and "interval" not in stalled.reason
    bad = decide(_arm(60, 10), base, alpha=ALPHA, margin=MARGIN, min_feedback=50)
    assert bad.decision == "abort" and bad.upper < 0 and "worse" in bad.reason


def test_the_observed_lift_floor_keeps_a_challenger_its_users_rated_lower_out() -> None:
    """Seed 1 of bench/learning.py: the demo's canary of then (margin 0.25, alpha 0.2) promoted a challenger at 7.9 %
    thumbs-up against the champion's 10.0 %, within the margin. With min_observed_lift 0 that look goes on."""
    demo = {"alpha": 0.2, "margin": 0.25, "min_feedback": 16, "tau": 0.2}
    challenger, champion = _arm(38, 3), _arm(40, 4)
    assert decide(challenger, champion, **demo).decision == "promote"  # the margin alone
    held = decide(challenger, champion, **demo, min_observed_lift=0.0)
    assert held.decision == "continue" and "below champion" in held.reason and "min_observed_lift 0" in held.reason
    assert decide(_arm(38, 4), champion, **demo, min_observed_lift=0.0).decision == "promote"  # 10.5 % >= 10 %
    assert decide(_arm(38, 0), _arm(40, 30), **demo, min_observed_lift=0.0).decision == "abort"  # abort unchanged


def test_with_the_floor_no_promotion_is_of_a_lower_observed_rate_and_equal_ones_still_pass() -> None:
    floor: list[float] = []
    margin_alone: list[float] = []
    loose = {"margin": 0.25, "alpha": 0.2, "min_feedback": 16}  # a loose margin (the demo's until 2026-12-07)
    _simulate(0.10, 0.15, seed=5, runs=300, lift=0.0, promoted_diffs=floor, **loose)
    _simulate(0.10, 0.15, seed=5, runs=300, promoted_diffs=margin_alone, **loose)
    assert floor and all(d >= 0 for d in floor), floor
    assert sum(d < 0 for d in margin_alone) > 0.5 * len(margin_alone)  # the margin alone: most at a lower rate
    equal = _simulate(0.6, 0.6, seed=1, lift=0.0)
    assert equal["promote"] > 5 * equal["abort"], equal  # an equal challenger is still promoted far more often
    assert equal["abort"] / RUNS <= ALPHA + SLACK, equal


def test_half_width_shrinks_with_evidence_and_refuses_bad_input() -> None:
    assert half_width(0.25 / 1000, ALPHA, 0.1) < half_width(0.25 / 100, ALPHA, 0.1)
    with pytest.raises(ValueError, match="variance"):
        half_width(0.0, ALPHA, 0.1)


def test_mean_rewards_use_sample_variance() -> None:
    stats = ArmStats.of_rewards([0.0, 1.0, 0.5, 0.5], binary=False)
    assert stats.n == 4 and stats.mean == pytest.approx(0.5) and stats.var == pytest.approx(0.125)


def test_thumbs_only_feedback_is_a_rate_and_mixed_feedback_a_mean() -> None:
    from pipeline.canary.monitor import LiveReward, arm_stats

    def live(reward: float, source: str, n: int = 1) -> list[LiveReward]:
        return [LiveReward(f"t{reward}{source}{i}", reward, source) for i in range(n)]

    rows = {"2": live(1.0, "thumbs") + live(-1.0, "thumbs"), "1": live(1.0, "thumbs", 3), None: live(0.5, "reward")}
    (chall, champ), binary = arm_stats(rows, "2", "1")
    assert binary and (chall.n, chall.mean, champ.n, champ.mean) == (2, 0.5, 3, 1.0)
    (chall, base), binary = arm_stats(rows, "2", None)
    assert not binary and chall.mean == 0.0 and base.mean == 0.5


def test_huge_rewards_and_a_tiny_mixture_sd_never_raise_and_a_time_out_still_aborts() -> None:
    """Ingest refuses only non-finite rewards: finite ones near 1e200 square to infinity. The variance is then
    infinite (no OverflowError), the look goes on, and the time-out aborts; so does a mixture_sd whose square
    underflows to 0."""
    huge = ArmStats.of_rewards([1e200, -1e200] * 10, binary=False)
    assert huge.var == float("inf")
    ok = ArmStats(100, 0.5, 0.25)
    assert decide(huge, ok, alpha=ALPHA, margin=MARGIN, min_feedback=16).decision == "continue"
    late = decide(huge, ok, alpha=ALPHA, margin=MARGIN, min_feedback=16, elapsed_s=61, max_duration_s=60)
    assert late.decision == "abort"
    tiny = decide(ok, ok, alpha=ALPHA, margin=MARGIN, min_feedback=16, tau=1e-200, elapsed_s=61, max_duration_s=60)
    assert tiny.decision == "abort" and tiny.lower is None
    with pytest.raises(ValueError, match="tau"):
        half_width(0.25 / 100, ALPHA, 1e-200)


def test_a_negative_mixture_sd_is_refused_and_a_time_out_never_reports_a_nan_interval() -> None:
    """half_width refuses tau < 0 (its square is positive, so the underflow check alone let it through and a
    canary promoted on it); a time-out whose interval is not finite reports none (the evidence goes to JSON)."""
    ok = ArmStats(200, 0.5, 0.25)
    with pytest.raises(ValueError, match="tau"):
        half_width(0.01, ALPHA, -0.1)
    with pytest.raises(ValueError, match="tau"):
        decide(ok, ok, alpha=ALPHA, margin=0.2, min_feedback=5, tau=-0.1)
    wide = decide(ok, ok, alpha=ALPHA, margin=MARGIN, min_feedback=5, tau=1e160, elapsed_s=10, max_duration_s=5)
    assert wide.decision == "abort" and (wide.difference, wide.lower, wide.upper) == (None, None, None)
    assert "nan" not in wide.reason
    huge = ArmStats.of_rewards([1e308] * 20, binary=False)
    late = decide(huge, ok, alpha=ALPHA, margin=MARGIN, min_feedback=5, elapsed_s=10, max_duration_s=5)
    assert late.decision == "abort" and late.lower is None and "nan" not in late.reason


def test_an_infinite_mean_never_promotes() -> None:
    """Finite rewards near 1e308 can average to infinity: such a look has no finite interval and goes on."""
    ok = ArmStats(100, 0.5, 0.1)
    for challenger, champion in ((ArmStats(100, float("inf"), 0.1), ok), (ok, ArmStats(100, float("-inf"), 0.1))):
        verdict = decide(challenger, champion, alpha=ALPHA, margin=MARGIN, min_feedback=30)
        assert verdict.decision == "continue" and verdict.lower is None, verdict
    huge = decide(ArmStats(100, 1e308, 0.1), ArmStats(100, -1e308, 0.1), alpha=ALPHA, margin=MARGIN, min_feedback=30)
    assert huge.decision == "continue"
