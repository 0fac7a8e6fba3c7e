"""How much live feedback a canary needs to decide: the sample size of the canary's own test.

The canary (:func:`pipeline.canary.sequential.decide`) compares the challenger's thumbs-up rate with the
champion's through the always-valid interval ``D ± hw(V)``, with ``D`` the observed difference of rates,
``V = var_c/n_c + var_h/n_h`` (each ``var`` that of the add-one smoothed rate, :meth:`ArmStats.of_rewards`)
and ``hw`` :func:`pipeline.canary.sequential.half_width`. With true rates ``p_h`` (champion) and
``p_c = p_h + d`` (challenger), ``D`` is about normal with mean ``d`` and standard deviation
``s = sqrt(p_c (1 - p_c) / n_c + p_h (1 - p_h) / n_h)``, so a look with ``n_c`` and ``n_h`` events
(:func:`decision_probabilities`):

- **aborts** (``D + hw < 0``, both sides >= ``min_events``) with probability ``Φ((-hw - d) / s)``;
- **promotes** (``D - hw > -margin``, both sides >= ``min_feedback``, and no abort, which is checked
  first: ``D > max(hw - margin, -hw)``) with probability ``1 - Φ((max(hw - margin, -hw) - d) / s)``.

:func:`events_to_decide` returns the fewest challenger events (the champion side getting ``ratio`` times
as many: ``(1 - fraction) / fraction`` for a canary that routes ``fraction`` of the users to the
challenger) at which one look decides with probability at least ``power``, and the likelier decision
there. A challenger at least as good as the champion is promoted and one worse by the margin or more
is aborted; one worse by less than the margin may go either way (both are within the test's promise):
promoted while the interval still reaches 0, aborted once more evidence shrinks ``hw`` below ``-d``.

The tables leave out ``min_observed_lift`` (the simulation too): it never changes an abort, and a
challenger that meets the bound and is at least as good as the champion has an observed difference of at
least 0 at one look in two or more, so it is promoted within a few looks of these counts; for one worse
by less than the margin it is what keeps it out until the interval aborts it (or ``max_duration_s`` does).

The canary looks at every check, not once, and stops at its first decision: by the returned count it
has decided with probability at least about ``power`` (one look there decides with ``power``; earlier
looks only add). ``tests/pipeline/canary/test_canary_sizing.py`` checks both against a seeded
simulation of :func:`decide` itself. ``python -m pipeline.canary.sizing`` prints the tables the
operations page shows (:func:`markdown`; rendered into the docs by ``docs/hooks/canary_sizing.py``).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Literal

from pipeline.canary.sequential import MIN_EVENTS, half_width
from pipeline.config import CanaryConfig

CHAMPION_RATES = (0.2, 0.5)
"""Champion thumbs-up rates of the tables."""
DIFFERENCES = (-0.20, -0.10, -0.05, -0.02, 0.0, 0.02, 0.05, 0.10, 0.20)
"""True differences ``challenger - champion`` of the tables (effect sizes, both ways)."""
POWER = 0.8
MAX_EVENTS = 10**8
"""Search bound on challenger events: past it the canary is said never to decide."""
DEMO_TOML = Path(__file__).resolve().parents[2] / "deploy" / "demo.toml"
_PHI = NormalDist()


@dataclass(frozen=True)
class Sizing:
    """What a canary facing true rates ``champion_rate`` and ``challenger_rate`` needs: after
    ``challenger_events`` and ``champion_events`` feedback events one look decides with probability
    ``power`` or more; ``decision`` is the likelier decision there and ``probability`` its probability
    (None everywhere: never within :data:`MAX_EVENTS`)."""

    champion_rate: float
    challenger_rate: float
    decision: Literal["promote", "abort"] | None
    challenger_events: int | None
    champion_events: int | None
    probability: float | None = None

    @property
    def difference(self) -> float:
        return self.challenger_rate - self.champion_rate


@dataclass(frozen=True)
class SequentialTest:
    """The canary's settings the sizing needs (``serving.canary``; ``tau`` is ``mixture_sd``)."""

    margin: float
    alpha: float
    tau: float
    min_feedback: int
    min_events: int = MIN_EVENTS

    @classmethod
    def of(cls, canary: CanaryConfig) -> "SequentialTest":
        return cls(canary.margin, canary.alpha, canary.mixture_sd, canary.min_feedback)


def _smoothed_var(rate: float, n: int) -> float:
    """The variance the canary plugs in for ``n`` thumbs at ``rate`` (:meth:`ArmStats.of_rewards`, expected count)."""
    s = (rate * n + 1) / (n + 2)
    return s * (1 - s)


def _cdf(x: float, sd: float) -> float:
    """``P(Z·sd <= x)``; a step when ``sd`` is 0 (both rates 0 or 1)."""
    return _PHI.cdf(x / sd) if sd > 0 else float(x >= 0)


def decision_probabilities(
    champion_rate: float, challenger_rate: float, challenger_events: int, champion_events: int, test: SequentialTest
) -> tuple[float, float]:
    """``(P(promote), P(abort))`` of one look of the canary at these counts (the module doc's formulas)."""
    n_c, n_h, p_c, p_h = challenger_events, champion_events, challenger_rate, champion_rate
    if min(n_c, n_h) < max(test.min_events, 1):
        return 0.0, 0.0
    v = _smoothed_var(p_c, n_c) / n_c + _smoothed_var(p_h, n_h) / n_h
    sd = math.sqrt(p_c * (1 - p_c) / n_c + p_h * (1 - p_h) / n_h)
    hw = half_width(v, test.alpha, test.tau)
    d = p_c - p_h
    abort = _cdf(-hw - d, sd)
    promote = 0.0
    if min(n_c, n_h) >= test.min_feedback:
        promote = 1.0 - _cdf(max(hw - test.margin, -hw) - d, sd)
    return promote, abort


def events_to_decide(
    champion_rate: float,
    challenger_rate: float,
    test: SequentialTest,
    *,
    power: float = POWER,
    ratio: float = 1.0,
) -> Sizing:
    """Fewest feedback events per side at which one look of the canary decides with probability ``power``
    (the module doc's formulas), by doubling then bisection (the probability grows with the events).

    Args:
        champion_rate, challenger_rate: true thumbs-up rates, in [0, 1].
        test: the canary's settings.
        power: probability of a decision by the returned counts, in (0.5, 1).
        ratio: champion events per challenger event (``(1 - fraction) / fraction``).

    Raises:
        ValueError: a rate outside [0, 1], ``power`` outside (0.5, 1) or ``ratio`` not positive.
    """
    if not (0 <= champion_rate <= 1 and 0 <= challenger_rate <= 1):
        raise ValueError(f"rates must be in [0, 1]; got {champion_rate}, {challenger_rate}")
    if not 0.5 < power < 1 or not ratio > 0:
        raise ValueError(f"need 0.5 < power < 1 and ratio > 0; got {power}, {ratio}")

    def decided(n_c: int) -> bool:
        return sum(decision_probabilities(champion_rate, challenger_rate, n_c, math.ceil(ratio * n_c), test)) >= power

    lo, hi = 0, max(test.min_events, 1)
    while not decided(hi):
        if hi >= MAX_EVENTS:
            return Sizing(champion_rate, challenger_rate, None, None, None)
        lo, hi = hi, min(hi * 2, MAX_EVENTS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if decided(mid) else (mid, hi)
    n_h = math.ceil(ratio * hi)
    promote, abort = decision_probabilities(champion_rate, challenger_rate, hi, n_h, test)
    decision: Literal["promote", "abort"] = "promote" if promote >= abort else "abort"
    return Sizing(champion_rate, challenger_rate, decision, hi, n_h, max(promote, abort))


def ratio_of(canary: CanaryConfig) -> float:
    """Champion feedback events per challenger event when users rate both sides alike: the canary sends
    ``fraction`` of the users to the challenger."""
    return (1 - canary.fraction) / canary.fraction


def table(
    canary: CanaryConfig,
    *,
    champion_rates: Sequence[float] = CHAMPION_RATES,
    differences: Sequence[float] = DIFFERENCES,
    power: float = POWER,
) -> list[Sizing]:
    """:func:`events_to_decide` for every champion rate and difference (rates outside [0, 1] left out)."""
    rows = []
    for p_h in champion_rates:
        for d in differences:
            p_c = round(p_h + d, 10)
            if 0 <= p_c <= 1:
                rows.append(events_to_decide(p_h, p_c, SequentialTest.of(canary), power=power, ratio=ratio_of(canary)))
    return rows


def demo_canary(path: Path = DEMO_TOML) -> CanaryConfig:
    """The demo's ``[serving.canary]`` (``deploy/demo.toml``), defaults for what it leaves out."""
    return CanaryConfig(**tomllib.loads(path.read_text()).get("serving", {}).get("canary", {}))


def markdown(canary: CanaryConfig, title: str, *, power: float = POWER) -> str:
    """One setting's table in Markdown: per champion rate and true difference, the feedback events each
    side needs for one look to decide with probability ``power``, and the likelier decision there."""
    head = (
        f"**{title}**: margin {canary.margin:g}, alpha {canary.alpha:g}, mixture_sd {canary.mixture_sd:g}, "
        f"min_feedback {canary.min_feedback}, fraction {canary.fraction:g} (champion events = "
        f"{ratio_of(canary):g} × challenger events); one look at these counts decides with probability "
        f"{power:.0%} or more, the canary looking all along has decided by then at least as often.\n\n"
        "| champion rate | challenger rate | difference | decision | challenger events | champion events | rated requests in all |\n"
        "| --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = []
    for s in table(canary, power=power):
        if s.decision is None or s.challenger_events is None or s.champion_events is None:
            counts = "never | never | never"
        else:
            counts = f"{s.challenger_events:,} | {s.champion_events:,} | {s.challenger_events + s.champion_events:,}"
        lines.append(
            f"| {s.champion_rate:.2f} | {s.challenger_rate:.2f} | {s.difference:+.2f} | "
            f"{s.decision or 'none'}{f' ({s.probability:.0%})' if s.probability is not None else ''} | {counts} |"
        )
    return head + "\n".join(lines) + "\n"


def render(demo_path: Path = DEMO_TOML) -> str:
    """The operations page's tables: the production defaults (:class:`CanaryConfig`) and the demo's setting."""
    parts = [markdown(CanaryConfig(), "Production defaults")]
    if demo_path.is_file():
        parts.append(markdown(demo_canary(demo_path), f"The demo ({demo_path.parent.name}/{demo_path.name})"))
    return "\n".join(parts)


if __name__ == "__main__":
    print(render())
