"""The demo's scoreboard: the users' live verdict per phase of traffic, gains, and forgetting on the
shipped regression suite (base vs final champion).

A *phase* is the traffic sent between two rounds (phase 0: before the first
round). Its live thumbs-up rate comes from the reward buffer itself - the
snapshot's rows whose feedback joined (``reward`` not null), up-voted when
``reward > 0`` - grouped by phase and by the ``adapter_version`` that served
each request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from trainer.types import Prompt


@dataclass(frozen=True)
class LiveRate:
    """One phase's users' verdict: ``up`` thumbs-up among ``rated`` answers, and which versions served it."""

    phase: int
    served_by: dict[str, tuple[int, int]]  # adapter version ("base" when none) -> (up, rated)
    up: int
    rated: int

    @property
    def rate(self) -> float:
        return self.up / self.rated if self.rated else float("nan")


def live_rates(
    table: pa.Table, phases: Sequence[Sequence[str]], verdicts: Mapping[str, bool] | None = None
) -> list[LiveRate]:
    """The thumbs-up rate of each phase's traffic, from a buffer snapshot.

    Args:
        table: ``RewardBuffer.snapshot()`` rows (``trace_id``, ``adapter_version``, ``reward``).
        phases: the trace ids sent in each phase (``phases[0]``: before round 1).
        verdicts: trace id -> right by the users' own check. Given, every sent answer counts with that
            verdict (users who rate only some answers); else each rated row, up when ``reward > 0``.

    Returns:
        One :class:`LiveRate` per phase; rows without a verdict, or not sent
        by the demo, are left out (a phase with no such row has rate NaN).
    """
    phase_of = {trace_id: i for i, ids in enumerate(phases) for trace_id in ids}
    counts: list[dict[str, list[int]]] = [{} for _ in phases]
    for row in table.select(["trace_id", "adapter_version", "reward"]).to_pylist():
        phase = phase_of.get(row["trace_id"])
        if verdicts is not None:
            up = verdicts.get(row["trace_id"])
        else:
            up = None if row["reward"] is None else row["reward"] > 0
        if phase is None or up is None:
            continue
        up_rated = counts[phase].setdefault(row["adapter_version"] or "base", [0, 0])
        up_rated[0] += int(up)
        up_rated[1] += 1
    return [
        LiveRate(
            phase=i,
            served_by={v: (c[0], c[1]) for v, c in sorted(by_version.items())},
            up=sum(c[0] for c in by_version.values()),
            rated=sum(c[1] for c in by_version.values()),
        )
        for i, by_version in enumerate(counts)
    ]


def gains_line(base: float, champion: float | None, oracle: float | None = None) -> str:
    """The scoreboard's gains over the base (a champion that never replaced the base gained nothing). With the
    opt-in oracle (deploy/demo.toml), its gain beside it and no ratio of the two: the oracle is gated on the
    same held-out feedback as the champion, so it is promoted only where that feedback agrees, and it has ended
    both above and far below the champion (0.333 against 0.708): a reference, not an upper bound."""
    line = (
        f"gain over the base: feedback-only champion {champion - base:+.3f}"
        if champion is not None
        else "gain over the base: feedback-only champion +0.000 (none promoted: the base still serves)"
    )
    if oracle is not None:
        line += (
            f"; oracle reference {oracle - base:+.3f} "
            "(GRPO on the users' own check, gated on the same held-out feedback: a reference, not an upper bound)"
        )
    return line


def explicit_only_line(
    base: float, champion: float | None, explicit: float, served: str | None, rating_rate: float, rounds: int
) -> str:
    """The explicit-only line beside the champion (:mod:`pipeline.demo.replay`): its greedy accuracy, gain over the
    base, and what the implicit signals added (the champion's gain minus its; the base's accuracy for a champion
    that never replaced the base)."""
    who = f"its champion {served}" if served else "no version promoted: the base"
    with_implicit = champion if champion is not None else base
    return (
        f"explicit-only line (the same traffic, its {rating_rate:.0%} explicit ratings alone, {rounds} round(s) "
        f"replayed): greedy accuracy {explicit:.3f} ({who}), gain over the base {explicit - base:+.3f}; with the "
        f"implicit signals {with_implicit:.3f}, gain {with_implicit - base:+.3f}: the implicit signals add "
        f"{with_implicit - explicit:+.3f}"
    )


def plot_live_rates(rates: Sequence[LiveRate], out: Path) -> None:
    """Live thumbs-up rate by phase (phase i = traffic after round i) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [r.phase for r in rates]
    ax.plot(xs, [r.rate for r in rates], "o-", label="users' thumbs-up rate (live traffic)")
    for r in rates:
        ax.annotate(
            f"{r.up}/{r.rated}", (r.phase, r.rate), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8
        )
    ax.set_xlabel("round (0 = before the first round)")
    ax.set_ylabel("thumbs-up rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(xs)
    ax.legend(loc="upper left")
    ax.set_title("Hourglass demo: what the users say, by round")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


FORGETTING_TARGET = 0.05  # issue 28: the final champion may lose at most this much on the shipped suite


@dataclass(frozen=True)
class SuiteScore:
    """One model's greedy score on a regression suite: the check's mean over ``prompts`` answers."""

    model: str
    score: float
    prompts: int


def suite_score(
    model: str, prompts: Sequence[Prompt], answer: Callable[[Prompt], str], check: Callable[..., float]
) -> SuiteScore:
    """``model``'s mean ``check`` score of ``answer(prompt)`` (its greedy answer) over ``prompts``."""
    scores = [float(check(p.messages, answer(p), p.metadata)) for p in prompts]
    return SuiteScore(model, sum(scores) / len(scores) if scores else float("nan"), len(scores))


def forgetting_line(
    suite: str, base: SuiteScore, champion: SuiteScore | None, target: float = FORGETTING_TARGET
) -> str:
    """The scoreboard's forgetting line: forgetting = base - champion on the shipped suite, against the target."""
    if champion is None:
        return (
            f"regression suite {suite}: base {base.score:.3f} on {base.prompts} prompts; no champion was promoted, "
            "so nothing was forgotten"
        )
    loss = base.score - champion.score
    verdict = "within" if loss <= target else "OVER"
    return (
        f"regression suite {suite}: base {base.score:.3f}, final champion ({champion.model}) {champion.score:.3f} "
        f"on {base.prompts} prompts; forgetting (base - champion) {loss:+.3f}, {verdict} the target <= {target:g}"
    )
