"""The canary's sample-size table (:mod:`pipeline.canary.sizing`) against a seeded simulation of the
canary's own decision function (:func:`pipeline.canary.sequential.decide`): pure logic, no services."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.canary.sequential import ArmStats, decide
from pipeline.canary.sizing import (
    POWER,
    Sizing,
    SequentialTest,
    decision_probabilities,
    demo_canary,
    events_to_decide,
    markdown,
    ratio_of,
    render,
    table,
)
from pipeline.config import CanaryConfig

PROD = CanaryConfig()
TRIALS = 2000  # single looks: standard error of a rate near 0.8 is 0.009
SEQ_TRIALS = 600  # sequential runs: standard error <= 0.02
LOOKS = 40  # looks per sequential run, evenly spaced up to the table's count


def _decide(k_c: int, n_c: int, k_h: int, n_h: int, canary: CanaryConfig) -> str:
    """The canary's decision on thumbs counts (``ArmStats.of_rewards`` of k ups in n, as the monitor builds them)."""
    chall = ArmStats.of_rewards([1.0] * k_c + [-1.0] * (n_c - k_c), binary=True)
    champ = ArmStats.of_rewards([1.0] * k_h + [-1.0] * (n_h - k_h), binary=True)
    verdict = decide(
        chall,
        champ,
        alpha=canary.alpha,
        margin=canary.margin,
        min_feedback=canary.min_feedback,
        tau=canary.mixture_sd,
    )
    return verdict.decision


def _single_look(s: Sizing, canary: CanaryConfig, trials: int, seed: int) -> tuple[float, float]:
    """(share promoted, share aborted) of canaries that look once at the table's counts."""
    assert s.challenger_events is not None and s.champion_events is not None
    rng = np.random.default_rng(seed)
    k_c = rng.binomial(s.challenger_events, s.challenger_rate, size=trials)
    k_h = rng.binomial(s.champion_events, s.champion_rate, size=trials)
    outcomes = [_decide(int(a), s.challenger_events, int(b), s.champion_events, canary) for a, b in zip(k_c, k_h)]
    return outcomes.count("promote") / trials, outcomes.count("abort") / trials


def _sequential(s: Sizing, canary: CanaryConfig, trials: int, seed: int) -> tuple[float, float]:
    """Canaries that look ``LOOKS`` times up to the table's counts and stop at the first decision:
    (share promoted by then, share aborted by then)."""
    assert s.challenger_events is not None and s.champion_events is not None
    rng = np.random.default_rng(seed)
    looks = np.unique(np.linspace(0, 1, LOOKS + 1)[1:] * s.challenger_events).astype(int)
    n_h_at = [math.ceil(s.champion_events * n / s.challenger_events) for n in looks]
    k_c, k_h = np.zeros(trials, dtype=int), np.zeros(trials, dtype=int)
    last_c = last_h = 0
    outcome = np.array(["continue"] * trials, dtype=object)
    for n_c, n_h in zip(looks, n_h_at):
        k_c += rng.binomial(n_c - last_c, s.challenger_rate, size=trials)
        k_h += rng.binomial(n_h - last_h, s.champion_rate, size=trials)
        last_c, last_h = n_c, n_h
        for t in np.flatnonzero(outcome == "continue"):
            outcome[t] = _decide(int(k_c[t]), int(n_c), int(k_h[t]), n_h, canary)
    return float(np.mean(outcome == "promote")), float(np.mean(outcome == "abort"))


def _pick(rows: list[Sizing], champion: float, challenger: float) -> Sizing:
    return next(s for s in rows if s.champion_rate == champion and s.challenger_rate == pytest.approx(challenger))


def _tol(p: float, trials: int) -> float:
    """4 standard errors of a share near ``p`` over ``trials``, plus 0.03 for the normal approximation."""
    return 4 * math.sqrt(max(p * (1 - p), 0.01) / trials) + 0.03


@pytest.mark.parametrize(
    ("canary", "champion", "challenger"),
    [
        (PROD, 0.5, 0.3),  # clearly worse: abort
        (PROD, 0.2, 0.3),  # better: promote
        (PROD, 0.5, 0.5),  # equal: promote
        (PROD, 0.5, 0.48),  # worse by less than the margin: either, promotion likelier
        (PROD, 0.2, 0.1),  # worse by more than the margin: abort
        (demo_canary(), 0.5, 0.3),  # the demo: worse by 0.2, aborted
        (demo_canary(), 0.5, 0.4),  # the demo: worse by 0.1, within its margin of 0.25: promoted as often as not
        (demo_canary(), 0.2, 0.4),
    ],
)
def test_the_table_matches_a_simulation_of_the_canarys_decision(
    canary: CanaryConfig, champion: float, challenger: float
) -> None:
    """At the table's counts one look of ``decide`` promotes and aborts as often as the formula says
    (each within 4 standard errors plus 0.03), deciding with probability POWER or a little more (the
    count is the fewest that reaches it); a canary that looks all along has decided by then at least
    as often, and never the wrong way for a challenger outside the margin more often than alpha."""
    s = _pick(table(canary), champion, challenger)
    assert s.decision is not None and s.challenger_events is not None and s.champion_events is not None
    test = SequentialTest.of(canary)
    want_promote, want_abort = decision_probabilities(
        s.champion_rate, s.challenger_rate, s.challenger_events, s.champion_events, test
    )
    assert POWER <= want_promote + want_abort <= POWER + 0.05
    promoted, aborted = _single_look(s, canary, TRIALS, seed=0)
    assert abs(promoted - want_promote) <= _tol(want_promote, TRIALS), (s, promoted, want_promote)
    assert abs(aborted - want_abort) <= _tol(want_abort, TRIALS), (s, aborted, want_abort)
    seq_promoted, seq_aborted = _sequential(s, canary, SEQ_TRIALS, seed=1)
    assert seq_promoted + seq_aborted >= POWER - _tol(POWER, SEQ_TRIALS), (s, seq_promoted, seq_aborted)
    if s.difference >= 0:
        assert seq_aborted <= canary.alpha + 0.03
    if s.difference <= -canary.margin:
        assert seq_promoted <= canary.alpha + 0.03
    # and not decided much earlier: at half the counts one look decides clearly less often
    half_c, half_h = s.challenger_events // 2, s.champion_events // 2
    if min(half_c, half_h) >= canary.min_feedback:
        half = Sizing(s.champion_rate, s.challenger_rate, s.decision, half_c, half_h)
        assert sum(_single_look(half, canary, TRIALS, seed=2)) < POWER - 0.1


def test_formula_edges() -> None:
    test = SequentialTest(margin=0.05, alpha=0.05, tau=0.1, min_feedback=30)
    # worse by exactly the margin: aborted; equal: promoted
    assert events_to_decide(0.5, 0.45, test).decision == "abort"
    assert events_to_decide(0.5, 0.5, test).decision == "promote"
    # more traffic on the champion's side: fewer challenger events for the same decision
    one = events_to_decide(0.5, 0.4, test)
    four = events_to_decide(0.5, 0.4, test, ratio=4.0)
    assert four.challenger_events is not None and one.challenger_events is not None
    assert four.challenger_events < one.challenger_events and four.champion_events == 4 * four.challenger_events
    # a huge effect is decided at the floor: min_feedback per side for a promotion
    assert events_to_decide(0.2, 0.9, test).challenger_events == 30
    # a tiny margin with no difference needs far more than a big one
    small = events_to_decide(0.5, 0.5, SequentialTest(margin=0.01, alpha=0.05, tau=0.1, min_feedback=30))
    big = events_to_decide(0.5, 0.5, test)
    assert small.challenger_events is not None and big.challenger_events is not None
    assert small.challenger_events > 10 * big.challenger_events
    # no margin and no difference: a look never promotes nor aborts with 80 %
    assert events_to_decide(0.5, 0.5, SequentialTest(margin=0.0, alpha=0.05, tau=0.1, min_feedback=30)).decision is None
    with pytest.raises(ValueError):
        events_to_decide(0.5, 1.2, test)


def test_rendered_tables_cover_production_and_demo() -> None:
    text = render()
    assert "**Production defaults**: margin 0.05, alpha 0.05" in text and "demo.toml" in text
    assert ratio_of(PROD) == pytest.approx(4.0)
    rows = table(PROD)
    assert len(rows) == 18  # 2 champion rates x 9 differences, every challenger rate in [0, 1]
    s = _pick(rows, 0.5, 0.3)
    assert s.challenger_events is not None and s.champion_events is not None
    assert f"| 0.50 | 0.30 | -0.20 | abort (80%) | {s.challenger_events:,} | {s.champion_events:,} |" in markdown(
        PROD, "x"
    )
