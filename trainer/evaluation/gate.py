"""The promotion gate: a pure function of one served model's held-out evaluation and ``[rl]``.

The gate per served model (tenant) promotes the candidate with the highest paired-bootstrap lower
confidence bound on (candidate - champion) value - the mean of paired per-row differences, or for
an AUC comparison the AUC difference on the same resampled rows - if that bound exceeds
``rl.gate.margin`` and its guardrails hold: mean k3 KL to the base on its greedy answers <=
``rl.gate.max_kl`` (the serving engine's log-probs against the base's), mean completion length <=
``rl.gate.max_mean_length`` tokens, no NaN, it forgets nothing: on every regression suite of its
served model (``[[rl.regression]]``) the paired-bootstrap lower bound of mean(candidate - champion)
score is at least ``-tolerance`` (:func:`trainer.evaluation.regression.suite_verdicts`), and no
reward-hack monitor refuses it (:func:`monitor_refusal`: ``[rl.monitors]`` on its greedy answers vs the
champion's, :mod:`trainer.evaluation.monitors`). A refusal recorded by the evaluation (no usable held-out
row, a reward model at chance) promotes nothing. Source of the bound: Efron & Tibshirani 1993, "An
Introduction to the Bootstrap" (percentile interval).

No model, engine or I/O here: the round's ``gate`` state (:mod:`pipeline.rounds.job`) calls
:func:`gate_round` on the evaluations the trainer returned, and a test can call :func:`gate` on
hand-made ones.
"""

from __future__ import annotations

import math
from dataclasses import replace

from trainer.config import RLConfig
from trainer.evaluation.monitors import MonitorCheck, check_all, check_metrics, refusal
from trainer.evaluation.regression import describe_failure, suite_verdicts
from trainer.evaluation.stats import paired_auc_lower_bound, paired_bootstrap_lower_bound
from trainer.types import Comparison, GateDecision, RoundResult, TenantEvaluation


def monitor_checks(evaluation: TenantEvaluation, name: str, rl: RLConfig) -> list[MonitorCheck]:
    """The reward-hack monitors of candidate ``name`` against the champion (none when either was not measured);
    no single user or API key of the held-out rows can make one refuse (:func:`check_all`)."""
    reading, champion = evaluation.readings.get(name), evaluation.champion_reading
    if reading is None or champion is None:
        return []
    return check_all(reading, champion, rl.monitors, max_key_share=rl.split.max_key_share)


def monitor_refusal(evaluation: TenantEvaluation, name: str, rl: RLConfig) -> str | None:
    """Why the monitors refuse candidate ``name`` (each refusing monitor named), or None."""
    return refusal(monitor_checks(evaluation, name, rl))


def gate(evaluation: TenantEvaluation, rl: RLConfig) -> GateDecision:
    """The verdict for one served model (see the module docstring for the rule). ``reason``
    lists, for every candidate, why it won or lost."""
    unit, champion, champion_label = evaluation.unit, evaluation.champion, evaluation.champion_label
    champion_value, refusal = evaluation.champion_value, evaluation.refusal
    results = evaluation.candidates
    values = {name: r.metric_value for name, r in results.items()}
    bounds: dict[str, float] = {}
    verdicts: list[str] = []
    eligible: list[str] = []
    regression = {name: suite_verdicts(name, evaluation.regression, evaluation.served_model, rl) for name in results}
    for name, r in results.items():
        forgets = [v for v in regression[name] if not v.passed]
        if evaluation.comparison == Comparison.AUC:
            assert evaluation.labels is not None, "an AUC comparison needs each row's label"
            lb = paired_auc_lower_bound(
                r.rewards, champion, evaluation.labels, rl.gate.confidence, rl.gate.bootstrap_samples, rl.seed
            )
        else:
            lb = paired_bootstrap_lower_bound(
                [a - b for a, b in zip(r.rewards, champion)], rl.gate.confidence, rl.gate.bootstrap_samples, rl.seed
            )
        bounds[name] = lb
        if refusal is not None:
            verdicts.append(f"{name}: {unit} {values[name]:.3f}")
        elif any(math.isnan(x) for x in (*r.rewards, r.mean_kl, r.mean_length)):
            verdicts.append(f"{name}: NaN in {unit}s, KL or length")
        elif r.mean_kl > rl.gate.max_kl:
            verdicts.append(f"{name}: mean KL to base {r.mean_kl:.3f} > max_kl {rl.gate.max_kl}")
        elif r.mean_length > rl.gate.max_mean_length:
            verdicts.append(
                f"{name}: mean length {r.mean_length:.1f} tokens > max_mean_length {rl.gate.max_mean_length}"
            )
        elif forgets:
            verdicts.append(f"{name}: " + "; ".join(describe_failure(v, champion_label) for v in forgets))
        elif hack := monitor_refusal(evaluation, name, rl):
            verdicts.append(f"{name}: {hack}")
        elif not lb > rl.gate.margin:
            verdicts.append(
                f"{name}: {unit} {values[name]:.3f} vs {champion_label} {champion_value:.3f}, "
                f"{rl.gate.confidence:.0%} lower bound {lb:+.3f} does not exceed margin {rl.gate.margin}"
            )
        else:
            eligible.append(name)
            verdicts.append(
                f"{name}: beats {champion_label} on {unit} by lower bound {lb:+.3f} > margin {rl.gate.margin}"
            )
    winner = max(eligible, key=lambda n: (bounds[n], values[n])) if eligible else None
    if refusal is not None:
        head = f"keep {champion_label}: {refusal}"
    else:
        head = f"promote {winner}" if winner else f"keep {champion_label}: no candidate passed"
    return GateDecision(
        served_model=evaluation.served_model,
        winner=winner,
        reason=f"{head}. " + "; ".join(verdicts),
        champion_reward_mean=champion_value,
        candidate_reward_means=values,
        lower_bounds=bounds,
        metric=evaluation.metric,
        regression=regression,
    )


def gate_round(result: RoundResult, rl: RLConfig) -> RoundResult:
    """``result`` with one :class:`~trainer.types.GateDecision` per served model it evaluated, each
    candidate's monitor drifts in its metrics (``monitor/<candidate>/<monitor>``, ``.../refused``), and the
    regression verdicts as round metrics: ``regression/<suite>/<candidate>/lower_bound`` and ``.../passed``
    (1 or 0; the scores themselves come from the evaluation)."""
    decisions = {model: gate(e, rl) for model, e in sorted(result.evaluations.items())}
    metrics = dict(result.metrics)
    metrics |= {
        f"monitor/{name}/{k.removeprefix('monitor/')}": v
        for e in result.evaluations.values()
        for name in e.candidates
        for k, v in check_metrics(monitor_checks(e, name, rl)).items()
    }
    for decision in decisions.values():
        for name, suites in decision.regression.items():
            for v in suites:
                if math.isfinite(v.lower_bound):
                    metrics[f"regression/{v.suite}/{name}/lower_bound"] = v.lower_bound
                metrics[f"regression/{v.suite}/{name}/passed"] = float(v.passed)
    return replace(result, decisions=decisions, metrics=metrics)
