"""Always-valid sequential comparison of two live feedback means (challenger vs champion).

The decision rests on the normal-mixture confidence sequence of the mixture
sequential probability ratio test (mSPRT): Johari, Pekelis & Walsh, "Always
Valid Inference: Continuous Monitoring of A/B Tests", Operations Research 70(3),
2022 (arXiv:1512.04922), section 4, and the same boundary as the "normal
mixture" uniform boundary of Howard, Ramdas, McAuliffe & Sekhon, "Time-uniform,
nonparametric, nonasymptotic confidence sequences", Annals of Statistics 49(2),
2021, eq. (14). With ``D`` the observed difference of means (challenger minus
champion), ``V`` its variance (``var_c/n_c + var_h/n_h``) and ``tau`` the
mixing standard deviation, the interval

    D ± sqrt( V (V + tau²) / tau² · (2 log(1/alpha) + log((V + tau²) / V)) )

covers the true difference at every look simultaneously with probability at
least ``1 - alpha`` (under the Gaussian approximation of the running means), so
it may be checked after every new feedback event without inflating the error.

Decision, in this order:

1. ``abort`` when ``max_duration_s`` has passed without a decision (with the interval of that look, where
   both sides have ``min_events``: how close it came);
2. ``continue`` until both sides have at least ``min_events`` events (a floor
   for the variance estimate);
3. ``abort`` when the upper bound is below 0 (the challenger is worse);
4. ``promote`` when both sides have ``min_feedback`` events, the lower bound
   is above ``-margin`` (the challenger is not worse by more than the margin)
   and, with ``min_observed_lift`` set, the observed difference is at least that
   (default 0: the users' observed rate of the challenger is not below the
   champion's);
5. ``continue`` otherwise.

Abort is checked before promote: a challenger known to be worse is never
promoted, even when it is worse by less than the margin. The margin alone
promotes a challenger whose observed rate is below the champion's, as long as
the interval allows a loss of less than the margin; the observed-lift floor
refuses that at the look, and the canary goes on (a challenger truly worse by
less than the margin then runs until ``max_duration_s`` aborts it, unless
its observed rate catches up).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

Decision = Literal["promote", "abort", "continue"]

MIN_EVENTS = 10
"""Events per side before any decision: the plug-in variance needs a few points."""


@dataclass(frozen=True)
class ArmStats:
    """Sufficient statistics of one side: ``n`` events, their ``mean`` and (population) ``var``."""

    n: int
    mean: float
    var: float

    @classmethod
    def of_rewards(cls, rewards: list[float], *, binary: bool) -> "ArmStats":
        """Stats of rewards. ``binary``: success = reward > 0, with the variance of the
        add-one smoothed rate ``(k+1)/(n+2)`` (never 0, so 10 thumbs-down in a row is not
        taken as certainty); else the sample mean and variance, floored at 1e-4."""
        n = len(rewards)
        if n == 0:
            return cls(0, float("nan"), float("nan"))
        if binary:
            k = sum(1 for r in rewards if r > 0)
            smoothed = (k + 1) / (n + 2)
            return cls(n, k / n, smoothed * (1 - smoothed))
        mean = sum(rewards) / n
        var = sum((r - mean) * (r - mean) for r in rewards) / n  # huge rewards: inf, not OverflowError
        return cls(n, mean, max(var, 1e-4))


@dataclass(frozen=True)
class Verdict:
    """One look: the decision, the interval of ``challenger - champion`` and why."""

    decision: Decision
    reason: str
    difference: float | None
    lower: float | None
    upper: float | None
    challenger: ArmStats
    champion: ArmStats

    def as_dict(self) -> dict:
        return asdict(self)


def half_width(variance: float, alpha: float, tau: float) -> float:
    """Half-width of the normal-mixture confidence sequence at variance ``variance`` of the estimate.

    Raises:
        ValueError: ``variance`` or ``tau`` not positive, or ``alpha`` not in (0, 1).
    """
    if not variance > 0 or not tau > 0 or not tau * tau > 0 or not 0 < alpha < 1:  # a tau whose square underflows too
        raise ValueError(f"need variance > 0, tau > 0 and 0 < alpha < 1; got {variance}, {tau}, {alpha}")
    t2 = tau * tau
    return math.sqrt(variance * (variance + t2) / t2 * (2 * math.log(1 / alpha) + math.log((variance + t2) / variance)))


def decide(
    challenger: ArmStats,
    champion: ArmStats,
    *,
    alpha: float,
    margin: float,
    min_feedback: int,
    tau: float = 0.1,
    elapsed_s: float = 0.0,
    max_duration_s: float | None = None,
    min_events: int = MIN_EVENTS,
    control: str = "champion",
    min_observed_lift: float | None = None,
) -> Verdict:
    """One look at the evidence; see the module doc for the rule and its source.

    Args:
        challenger, champion: the stats of each side since the canary started.
        alpha: error rate (probability that the interval ever misses the true difference).
        margin: non-inferiority margin, in reward units (a rate difference for thumbs).
        min_feedback: events each side needs before a promotion.
        tau: standard deviation of the mixing distribution (the effect size the test is tuned for).
        elapsed_s, max_duration_s: time since the canary started and its limit (None: no limit).
        control: what the ``champion`` side is called in the reasons (``"base"`` when the model has no
            champion yet and the base model serves that side).
        min_observed_lift: the smallest observed difference (challenger minus champion) a promotion needs
            besides the bound; None: the bound alone.
    """
    floor = max(min_events, 1)
    if max_duration_s is not None and elapsed_s >= max_duration_s:
        # out of time: aborted whatever the evidence says; the interval, where there is one, shows how close it was
        last = _interval(challenger, champion, alpha, tau, floor)
        last_diff, last_lower, last_upper = last or (None, None, None)
        where = (
            ""
            if last is None
            else "; difference {:+.3f}, interval [{:+.3f}, {:+.3f}], margin {:g}".format(*last, margin)
        )
        return Verdict(
            "abort",
            f"no decision within max_duration_s={max_duration_s:g}s "
            f"({challenger.n} challenger / {champion.n} {control} events{where})",
            last_diff,
            last_lower,
            last_upper,
            challenger,
            champion,
        )
    if challenger.n < floor or champion.n < floor:
        return Verdict(
            "continue",
            f"waiting for {floor} events per side (challenger {challenger.n}, {control} {champion.n})",
            None,
            None,
            None,
            challenger,
            champion,
        )
    diff = challenger.mean - champion.mean
    hw = half_width(challenger.var / challenger.n + champion.var / champion.n, alpha, tau)
    lower, upper = diff - hw, diff + hw
    if not all(math.isfinite(x) for x in (diff, lower, upper)):  # huge rewards: an infinite mean decides nothing
        reason = f"undecided: no finite interval (challenger mean {challenger.mean:g}, {control} {champion.mean:g})"
        return Verdict("continue", reason, None, None, None, challenger, champion)
    if upper < 0:
        reason = (
            f"challenger worse: rate {challenger.mean:.3f} vs {control} {champion.mean:.3f}, difference "
            f"{diff:+.3f}, {1 - alpha:.0%} always-valid interval [{lower:+.3f}, {upper:+.3f}] is below 0"
        )
        return Verdict("abort", reason, diff, lower, upper, challenger, champion)
    lifted = min_observed_lift is None or diff >= min_observed_lift
    if challenger.n >= min_feedback and champion.n >= min_feedback and lower > -margin and not lifted:
        reason = (
            f"undecided: not worse by more than {margin:g} (interval [{lower:+.3f}, {upper:+.3f}]), but the "
            f"observed rate {challenger.mean:.3f} is below {control} {champion.mean:.3f} by more than the "
            f"min_observed_lift {min_observed_lift:g} allows (difference {diff:+.3f})"
        )
        return Verdict("continue", reason, diff, lower, upper, challenger, champion)
    if challenger.n >= min_feedback and champion.n >= min_feedback and lower > -margin:
        reason = (
            f"challenger not worse by more than {margin:g}: rate {challenger.mean:.3f} vs {control} "
            f"{champion.mean:.3f}, interval [{lower:+.3f}, {upper:+.3f}] (lower bound > -{margin:g})"
        )
        return Verdict("promote", reason, diff, lower, upper, challenger, champion)
    reason = f"undecided: difference {diff:+.3f}, interval [{lower:+.3f}, {upper:+.3f}], margin {margin:g}, need {min_feedback} per side"
    return Verdict("continue", reason, diff, lower, upper, challenger, champion)


def _interval(
    challenger: ArmStats, champion: ArmStats, alpha: float, tau: float, floor: int
) -> tuple[float, float, float] | None:
    """(difference, lower, upper) of one look, or None where it has none: a side below ``floor`` events, or
    statistics :func:`half_width` refuses or that give no finite interval (a time-out never raises for want of an
    interval, and never reports a NaN one: the evidence goes to JSON and to MLflow)."""
    if challenger.n < floor or champion.n < floor:
        return None
    try:
        hw = half_width(challenger.var / challenger.n + champion.var / champion.n, alpha, tau)
    except ValueError:
        return None
    diff = challenger.mean - champion.mean
    interval = diff, diff - hw, diff + hw
    return interval if all(math.isfinite(x) for x in interval) else None
