"""The gate metrics by name (``rl.gate.metric``): one entry per metric, with its unit, how candidates
and the champion are compared under it, which held-out rows it can use, when it refuses to promote,
and how it turns a version's answers into per-row values. Nothing else compares metric names.

- ``verifiable``: greedy answers scored by ``rl.gate.reward`` (default ``exact_answer``), on held-out
  rows that carry its metadata (trusted reference answers). Unit: reward; compared by the mean.
- ``reward_model``: greedy answers scored by the round's reward model (trained on the training split
  only). A round without one, or whose reward model's held-out AUC lower bound is <= 0.5 (not better
  than chance), promotes nothing. Unit: reward-model score; compared by the mean.
- ``feedback``: on held-out traces with a reward (user feedback), the policy's implicit reward
  ``log pi(y|x) - log pi_ref(y|x)`` (sequence sums; pi_ref = the base with adapters disabled) of the
  logged completion ranks up-voted (reward > 0) above down-voted ones. Unit: feedback AUC (Mann-Whitney,
  ties count 1/2); the base as champion has implicit reward 0 and AUC 0.5; compared by the AUC.
  With ``rl.gate.positives_from = "explicit"`` the positives are what users said (up-votes, and their
  corrections as held-out rows of their own); implicit signals give negatives only.

A new metric is one :class:`GateMetricSpec` in :data:`GATE_METRICS` (and its name in
:class:`trainer.config.GateMetric`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from trainer.algorithms.batch import answer_ids, fit_after, logged_ids
from trainer.config import GateMetric, RLConfig
from trainer.data import capped_prompts, explicit_rows
from trainer.evaluation.measure import score, sequence_logps
from trainer.model.base import ResidentBase
from trainer.reward_model.model import RewardModel
from trainer.rewards import RewardMix, build_reward
from trainer.types import BASE_VERSION, CORRECTION_SOURCE
from trainer.types import Comparison, Prompt, RewardModelReport, Sample

Values = Callable[[str], tuple[float, ...]]
"""A version's per-row values on the usable held-out rows (for ``feedback`` its adapter must be live)."""


@dataclass(frozen=True)
class HeldOut:
    """What a metric's values are made from: the usable held-out rows, their prompt ids, every version's
    greedy answers to them (``answers[version][i]`` answers ``rows[i]``), the base, and the round's reward
    model (None when it trained none)."""

    base: ResidentBase
    rows: Sequence[Prompt]
    prompt_ids: Sequence[list[int]]
    answers: Mapping[str, Sequence[Sample]]
    rl: RLConfig
    reward_model: RewardModel | None = None


@dataclass(frozen=True)
class GateMetricSpec:
    """One gate metric: ``unit`` (what its values are, in words), ``comparison`` (paired mean
    difference, or paired AUC difference against each row's up-vote), ``usable`` (the held-out rows it
    can use, oldest first), ``needs`` (what such a row carries, in words), ``refusal`` (why a round may
    promote nothing under it, given the usable rows and the round's reward-model report; None: it may),
    and ``values`` (per-row values of each version, built once per evaluation)."""

    unit: str
    comparison: Comparison
    usable: Callable[[Sequence[Prompt], RLConfig], list[Prompt]]
    needs: Callable[[RLConfig], str]
    refusal: Callable[[Sequence[Prompt], RewardModel | None, RewardModelReport | None], str | None]
    values: Callable[[HeldOut], Values]


def gate_mix(rl: RLConfig) -> RewardMix:
    """The ``verifiable`` yardstick: ``rl.gate.reward``, the same for every candidate and the champion."""
    return build_reward(rl.gate.reward)


def feedback_labels(rows: Sequence[Prompt]) -> list[bool]:
    """Up-voted (logged reward > 0) or not, per row."""
    return [bool(p.logged_reward is not None and p.logged_reward > 0) for p in rows]


def _no_refusal(rows: Sequence[Prompt], model: RewardModel | None, report: RewardModelReport | None) -> str | None:
    return None


# --- verifiable -----------------------------------------------------------------------------------


def _verifiable_rows(rows: Sequence[Prompt], rl: RLConfig) -> list[Prompt]:
    mix = gate_mix(rl)
    return [p for p in rows if mix.accepts(p.metadata)]


def _verifiable_values(held: HeldOut) -> Values:
    mix = gate_mix(held.rl)
    return lambda version: score(held.answers[version], held.rows, mix)


# --- reward_model ---------------------------------------------------------------------------------


def _reward_model_refusal(
    rows: Sequence[Prompt], model: RewardModel | None, report: RewardModelReport | None
) -> str | None:
    if model is None:
        return "the gate metric is 'reward_model' but this round has no reward model"
    if report is None or not report.auc_lower_bound > 0.5:
        lb = report.auc_lower_bound if report is not None else float("nan")
        return f"the reward model is not better than chance on held-out feedback (AUC lower bound {lb:.3f} <= 0.5)"
    return None


def _reward_model_values(held: HeldOut) -> Values:
    """Every version's greedy answers scored in one batched call."""
    scores: dict[str, list[float]] = {}
    n = len(held.rows)
    if held.reward_model is not None and held.rows:
        order = list(held.answers)
        eos = held.base.tokenizer.eos_token_id
        flat = held.reward_model.score(
            [i for _ in order for i in held.prompt_ids],
            [list(s.token_ids) or [eos] for v in order for s in held.answers[v]],
        )
        scores = {v: list(flat[k * n : (k + 1) * n]) for k, v in enumerate(order)}
    return lambda version: tuple(scores.get(version, [float("nan")] * n))


# --- feedback -------------------------------------------------------------------------------------


def _rated(p: Prompt) -> bool:
    return p.logged_completion is not None and p.logged_reward is not None


def _feedback_rows(rows: Sequence[Prompt], rl: RLConfig) -> list[Prompt]:
    """The rated rows (:func:`_capped`); under ``rl.gate.positives_from = "explicit"``, of
    :func:`~trainer.data.explicit_rows` (each correction a positive row of its own after its row: its greedy
    answers and monitors count that prompt twice)."""
    return _capped(
        [p for p in (explicit_rows(rows) if rl.gate.positives_from == "explicit" else rows) if _rated(p)], rl
    )


def _capped(rows: list[Prompt], rl: RLConfig) -> list[Prompt]:
    """``rows`` with each API key's and user's rows cut to their share (``rl.split``, as the held-out split
    is: :func:`~trainer.data.capped_rows`): the split caps every held-out row, the gate reads only these, and
    a user who rates (or corrects) more than the others would otherwise hold more of them. Order kept."""
    return [rows[i] for i in capped_prompts(rows, rl.split.max_user_share, rl.split.max_key_share)]


def _feedback_refusal(
    rows: Sequence[Prompt], model: RewardModel | None, report: RewardModelReport | None
) -> str | None:
    labels = feedback_labels(rows)
    if rows and (all(labels) or not any(labels)):
        kind = "up-voted" if all(labels) else "down-voted"
        return f"all {len(rows)} held-out rows with feedback are {kind}; the feedback AUC needs both up- and down-votes"
    return None


def _feedback_values(held: HeldOut) -> Values:
    """The implicit reward of each row's logged completion under the live adapter (the base's is 0)."""
    base, ids = held.base, held.prompt_ids
    logged = [
        fit_after(
            base,
            i,
            answer_ids(base, p, p.logged_completion or "")
            if p.logged_reward_source == CORRECTION_SOURCE
            else logged_ids(base, p),
        )
        for i, p in zip(ids, held.rows)
    ]
    reference = sequence_logps(base, ids, logged, reference=True) if logged else []

    def values(version: str) -> tuple[float, ...]:
        if version == BASE_VERSION:
            return tuple(0.0 for _ in held.rows)  # the base's implicit reward against itself
        return tuple(a - b for a, b in zip(sequence_logps(base, ids, logged), reference))

    return values


GATE_METRICS: dict[GateMetric, GateMetricSpec] = {
    GateMetric.VERIFIABLE: GateMetricSpec(
        unit="reward",
        comparison=Comparison.MEAN,
        usable=_verifiable_rows,
        needs=lambda rl: f"the metadata {sorted(gate_mix(rl).required_metadata)} of rl.gate.reward",
        refusal=_no_refusal,
        values=_verifiable_values,
    ),
    GateMetric.REWARD_MODEL: GateMetricSpec(
        unit="reward-model score",
        comparison=Comparison.MEAN,
        usable=lambda rows, rl: list(rows),
        needs=lambda rl: "a prompt",
        refusal=_reward_model_refusal,
        values=_reward_model_values,
    ),
    GateMetric.FEEDBACK: GateMetricSpec(
        unit="feedback AUC",
        comparison=Comparison.AUC,
        usable=_feedback_rows,
        needs=lambda rl: (
            "a logged completion with a reward (user feedback)"
            if rl.gate.positives_from == "any"
            else "a correction, or a logged completion with a reward that implicit signals alone did not call good"
        ),
        refusal=_feedback_refusal,
        values=_feedback_values,
    ),
}


def usable_rows(heldout: Sequence[Prompt], rl: RLConfig) -> list[Prompt]:
    """The held-out rows ``rl.gate.metric`` can use, oldest first (see :data:`GATE_METRICS`)."""
    return GATE_METRICS[rl.gate.metric].usable(heldout, rl)


def refusal(
    rows: Sequence[Prompt],
    heldout_count: int,
    rl: RLConfig,
    reward_model: RewardModel | None = None,
    report: RewardModelReport | None = None,
) -> str | None:
    """Why the usable held-out ``rows`` cannot promote anything this round under ``rl.gate.metric``
    (None when they can): none usable, one label only (``feedback``), or a reward model missing or at
    chance (``reward_model``)."""
    spec = GATE_METRICS[rl.gate.metric]
    if not rows:
        return (
            f"none of the {heldout_count} held-out rows carries {spec.needs(rl)}, "
            f"which gate metric {str(rl.gate.metric)!r} needs"
        )
    return spec.refusal(rows, reward_model, report)
