"""The gate, a pure function of a served model's held-out evaluation: paired bootstrap lower bound,
margin and guardrails, reasons in words."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from trainer.config import CandidateConfig, RLConfig
from trainer.evaluation.evaluate import eval_prompts
from trainer.evaluation.gate import gate
from trainer.evaluation.metrics import GATE_METRICS, feedback_labels, refusal, usable_rows
from trainer.evaluation.stats import auc, paired_auc_lower_bound, paired_bootstrap_lower_bound
from trainer.types import EvalResult, Prompt, TenantEvaluation

RL = RLConfig(gate={"margin": 0.05, "confidence": 0.9, "bootstrap_samples": 500, "max_kl": 0.5, "max_mean_length": 20})
CHAMP = tuple([0.0, 1.0] * 10)  # champion mean 0.5 on 20 prompts


def _evaluation(
    cands: list[CandidateConfig],
    results: dict[str, EvalResult],
    champion: tuple[float, ...],
    label: str,
    rl: RLConfig,
    *,
    labels: tuple[bool, ...] | None = None,
    refusal: str | None = None,
) -> TenantEvaluation:
    """What the round's evaluation hands the gate for one served model, made by hand."""
    spec = GATE_METRICS[rl.gate.metric]
    value = auc(champion, labels) if labels is not None else sum(champion) / len(champion)
    return TenantEvaluation(
        served_model="tenant",
        metric=str(rl.gate.metric),
        unit=spec.unit,
        comparison=spec.comparison,
        candidates={c.name: results[c.name] for c in cands},
        champion=champion,
        champion_value=value,
        champion_label=label,
        labels=labels,
        refusal=refusal,
    )


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
    decision = gate(_evaluation(cands, results, CHAMP, "base", RL), RL)
    assert decision.winner == "good" and decision.metric == "verifiable"
    assert decision.lower_bounds["good"] > 0.05 and decision.champion_reward_mean == pytest.approx(0.5)
    assert "promote good" in decision.reason
    assert "drift: mean KL to base 0.900 > max_kl 0.5" in decision.reason
    assert "long: mean length 64.0 tokens > max_mean_length 20" in decision.reason
    assert "broken: NaN" in decision.reason
    assert "same: reward 0.500 vs base 0.500" in decision.reason


def test_gate_keeps_the_champion_when_nobody_passes() -> None:
    cands = [CandidateConfig(name="meh")]
    decision = gate(_evaluation(cands, {"meh": _result(CHAMP)}, CHAMP, "champion v3", RL), RL)
    assert decision.winner is None and decision.reason.startswith("keep champion v3: no candidate passed")


def test_auc_counts_ties_as_half_and_is_nan_without_both_classes() -> None:
    assert auc([3.0, 2.0, 1.0, 0.0], [True, True, False, False]) == 1.0
    assert auc([0.0, 1.0], [True, False]) == 0.0
    assert auc([0.0] * 6, [True, False] * 3) == 0.5  # the base as champion: implicit reward 0 everywhere
    assert auc([1.0, 0.5, 0.5, 0.0], [True, True, False, False]) == pytest.approx(0.875)  # 3.5 of 4 pairs
    assert math.isnan(auc([1.0, 2.0], [True, True]))


def test_paired_auc_bound_is_exact_for_a_perfect_ranker_against_the_base() -> None:
    labels = [True, False] * 10
    perfect = [1.0 if y else -1.0 for y in labels]
    assert paired_auc_lower_bound(perfect, [0.0] * 20, labels, 0.9, 300) == pytest.approx(
        0.5
    )  # 1.0 - 0.5 in every resample
    noisy = [1.0 if (y ^ (i % 5 == 0)) else -1.0 for i, y in enumerate(labels)]
    lb = paired_auc_lower_bound(noisy, [0.0] * 20, labels, 0.9, 1000)
    assert 0.0 < lb < auc(noisy, labels) - 0.5
    assert math.isnan(paired_auc_lower_bound(perfect, [0.0] * 20, [True] * 20, 0.9, 300))


FEEDBACK = RL.model_copy(update={"gate": RL.gate.model_copy(update={"metric": "feedback"})})
LABELS = tuple([True, False] * 10)


def test_feedback_gate_refuses_a_candidate_that_ranks_down_votes_above_up_votes() -> None:
    cands = [CandidateConfig(name=n) for n in ("right", "inverted")]
    right = tuple(2.0 if y else -2.0 for y in LABELS)
    inverted = tuple(-x for x in right)
    results = {
        "right": EvalResult("v", (), right, 0.1, 5.0, value=auc(right, LABELS)),
        "inverted": EvalResult("v", (), inverted, 0.1, 5.0, value=auc(inverted, LABELS)),
    }
    decision = gate(_evaluation(cands, results, (0.0,) * 20, "base", FEEDBACK, labels=LABELS), FEEDBACK)
    assert decision.winner == "right" and decision.metric == "feedback"
    assert decision.champion_reward_mean == 0.5 and decision.candidate_reward_means == {"right": 1.0, "inverted": 0.0}
    assert "inverted: feedback AUC 0.000 vs base 0.500" in decision.reason
    assert decision.lower_bounds["inverted"] == pytest.approx(-0.5)


def test_a_refusal_keeps_the_champion_even_for_a_clear_winner() -> None:
    cands = [CandidateConfig(name="good")]
    rm = RL.model_copy(update={"gate": RL.gate.model_copy(update={"metric": "reward_model"})})
    reason = "the reward model is not better than chance on held-out feedback (AUC lower bound 0.480 <= 0.5)"
    decision = gate(_evaluation(cands, {"good": _result(tuple([1.0] * 20))}, CHAMP, "base", rm, refusal=reason), rm)
    assert decision.winner is None and decision.reason.startswith(f"keep base: {reason}")
    assert decision.metric == "reward_model" and "good: reward-model score 1.000" in decision.reason


def test_every_gate_metric_has_one_entry_with_its_unit_and_comparison() -> None:
    from trainer.config import GateMetric
    from trainer.types import Comparison

    assert set(GATE_METRICS) == set(GateMetric)
    assert {m: (s.unit, s.comparison) for m, s in GATE_METRICS.items()} == {
        GateMetric.VERIFIABLE: ("reward", Comparison.MEAN),
        GateMetric.REWARD_MODEL: ("reward-model score", Comparison.MEAN),
        GateMetric.FEEDBACK: ("feedback AUC", Comparison.AUC),
    }


def test_the_staged_champion_is_named_by_its_version_in_a_gate_reason() -> None:
    from trainer.evaluation.evaluate import _champion_label

    assert _champion_label("/srv/hourglass/state/staging/hourglass/v12") == "champion v12"
    assert _champion_label("/tmp/rounds/r1/kto") == "champion /tmp/rounds/r1/kto"  # any other folder: its path


def _rated(i: int, answer: str, reward: float, source: str | None, correction: str | None = None) -> Prompt:
    return Prompt(
        prompt_id=f"t{i}",
        messages=[{"role": "user", "content": f"q{i}"}],
        logged_completion=answer,
        logged_reward=reward,
        logged_reward_source=source,
        logged_correction=correction,
    )


HELDOUT = [
    _rated(0, "right", 1.0, "thumbs"),
    _rated(1, "wrong", 0.5, "continued"),  # the user went on after a wrong answer
    _rated(2, "wrong", -0.5, "rephrased"),
    _rated(3, "wrong", -1.0, "thumbs", correction="right"),
    _rated(4, "right", 1.0, "thumbs+edited", correction=" right "),  # the correction repeats the answer
    _rated(5, "old", 1.0, None),  # written before implicit signals: its label is the user's
    Prompt(prompt_id="t6", messages=[{"role": "user", "content": "q6"}], logged_correction="right"),  # no reward
    _rated(7, "wrong", 0.6, "continued+regenerated", correction="right"),  # went on, but corrected it
    _rated(8, "wrong", -1.0, "thumbs", correction=" \u200b\n"),  # a correction with nothing visible in it
]


def test_feedback_gate_positives_from_explicit_are_up_votes_and_corrections_never_implicit_labels() -> None:
    explicit = FEEDBACK.model_copy(update={"gate": FEEDBACK.gate.model_copy(update={"positives_from": "explicit"})})
    rows = usable_rows(HELDOUT, explicit)
    assert [(p.prompt_id, p.logged_completion, p.logged_reward_source) for p in rows] == [
        ("t0", "right", "thumbs"),
        ("t2", "wrong", "rephrased"),
        ("t3", "wrong", "thumbs"),
        ("t3/correction", "right", "correction"),
        ("t4", "right", "thumbs+edited"),
        ("t5", "old", None),
        ("t6/correction", "right", "correction"),
        ("t7", "wrong", "continued+regenerated"),
        ("t7/correction", "right", "correction"),
        ("t8", "wrong", "thumbs"),
    ]
    assert feedback_labels(rows) == [True, False, False, True, True, True, True, False, True, False]
    correction = rows[3]
    assert correction.messages == HELDOUT[3].messages and correction.logged_token_ids is None
    # "any" (the default) is as before: every rated row, labelled by its reward, no correction
    assert [p.prompt_id for p in usable_rows(HELDOUT, FEEDBACK)] == ["t0", "t1", "t2", "t3", "t4", "t5", "t7", "t8"]
    assert feedback_labels(usable_rows(HELDOUT, FEEDBACK)) == [True, True, False, False, True, True, True, False]


def test_a_user_who_corrects_every_answer_holds_no_more_than_its_share_of_the_feedback_gates_rows() -> None:
    """Five users, ten held-out traces each (20 % apiece, as the split capped them). One user down-votes and
    corrects every answer; the four others' answers are labelled by behaviour. Under ``explicit`` the others'
    ``continued`` rows drop out and each correction is a row: uncapped, the correcting user would hold 20 of
    28 rows and every positive."""
    rows = []
    for u in "abcde":
        for i in range(10):
            if u == "a":
                label = dict(logged_reward=-1.0, logged_reward_source="thumbs", logged_correction="right")
            else:
                source = "continued" if i < 8 else "rephrased"
                label = dict(logged_reward=0.5 if i < 8 else -0.5, logged_reward_source=source)
            rows.append(
                Prompt(f"{u}{i}", [{"role": "user", "content": "q"}], {"user_hash": u}, "wrong", **label)  # type: ignore[arg-type]
            )
    rl = RLConfig(gate={"metric": "feedback", "positives_from": "explicit"}, split={"max_user_share": 0.2})
    used = usable_rows(rows, rl)
    by_user = Counter(p.metadata["user_hash"] for p in used)
    assert by_user == {"a": 2, "b": 2, "c": 2, "d": 2, "e": 2}  # every user at the typical user's 2 rows
    assert sum(feedback_labels(used)) == 1  # one of user a's two rows is a correction


def test_feedback_gate_positives_from_explicit_with_only_implicit_positives_says_what_it_needs() -> None:
    explicit = FEEDBACK.model_copy(update={"gate": FEEDBACK.gate.model_copy(update={"positives_from": "explicit"})})
    only_continued = [_rated(1, "wrong", 0.5, "continued"), _rated(8, "wrong", 0.5, "continued")]
    assert usable_rows(only_continued, explicit) == []
    assert refusal([], 2, explicit) == (
        "none of the 2 held-out rows carries a correction, or a logged completion with a reward that implicit "
        "signals alone did not call good, which gate metric 'feedback' needs"
    )
    negatives = [_rated(2, "wrong", -0.5, "rephrased"), _rated(1, "wrong", 0.5, "continued")]
    rows = usable_rows(negatives, explicit)
    assert refusal(rows, 2, explicit) == (
        "all 1 held-out rows with feedback are down-voted; the feedback AUC needs both up- and down-votes"
    )


def test_positives_from_is_refused_on_a_gate_that_does_not_read_feedback() -> None:
    with pytest.raises(
        ValueError, match="positives_from picks the feedback gate's positives; the gate metric is 'verifiable'"
    ):
        RLConfig(gate={"positives_from": "explicit"})
    with pytest.raises(ValueError, match="positives_from"):
        RLConfig(gate={"metric": "feedback", "positives_from": "implicit"})


def test_the_feedback_gates_rows_hold_both_labels_when_the_oldest_hold_one() -> None:
    """At a low rating rate up-votes are rare: forty down-voted rows, then three up-votes, then more down-votes.
    The first 32 rows would hold no up-vote and the round would promote nothing; the gate takes every up-vote
    (fewer than half) and the oldest down-votes, in row order. A mean metric still takes the first rows."""
    rows = [_rated(i, "a", -1.0 if not 40 <= i < 43 else 1.0, "thumbs") for i in range(60)]
    rl = FEEDBACK.model_copy(update={"gate": FEEDBACK.gate.model_copy(update={"eval_prompts": 32})})
    picked = eval_prompts(rows, rl)
    assert [p.prompt_id for p in picked] == [f"t{i}" for i in range(29)] + ["t40", "t41", "t42"]
    balanced = [_rated(i, "a", 1.0 if i % 3 else -1.0, "thumbs") for i in range(60)]  # 40 up, 20 down
    labels = feedback_labels(eval_prompts(balanced, rl))
    assert len(labels) == 32 and sum(labels) == 16
    few = rl.model_copy(update={"gate": rl.gate.model_copy(update={"eval_prompts": 80})})
    assert eval_prompts(rows, few) == rows  # all of them when they fit
    verifiable = RLConfig(gate={"metric": "verifiable", "eval_prompts": 5})
    answered = [replace(r, metadata={"reference_answer": "1"}) for r in rows]
    assert [p.prompt_id for p in eval_prompts(answered, verifiable)] == ["t0", "t1", "t2", "t3", "t4"]
