"""Gate metrics in real rounds on the tiny model (HF rollouts): one yardstick per served model,
the feedback gate, and rounds without usable held-out rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer import rewards
from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.evaluation.stats import paired_bootstrap_lower_bound
from trainer.round import run_round
from trainer.types import Prompt
from trainer.tasks import reasoning_gym_prompts
from trainer.data import snapshot_table, split_snapshot
from trainer.types import RoundSpec
from trainer.data import round_inputs
from trainer.evaluation.gate import gate_round

from .float32_tolerance import LOGPROB_TOL, U


def _newline_share(prompt_messages, completion: str, metadata) -> float:
    """Toy verifiable reward the tiny model can learn: newlines per completion token slot (4 tokens)."""
    return completion.count("\n") / 4


def test_an_inverted_reward_candidate_is_never_promoted(
    peaked_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both candidates are judged by the tenant's yardstick (rl.gate.reward), not by their own rewards:
    the inverted one learned to avoid what the yardstick counts, so it loses - by its own inverted
    reward it would have beaten the base."""
    monkeypatch.setitem(rewards.BUILTINS, "newline_share", _newline_share)
    prompts = reasoning_gym_prompts(
        "basic_arithmetic", 24, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    normal = CandidateConfig(
        name="normal", learning_rate=2e-3, kl_coef=0.0, reward=[RewardTerm(fn="newline_share")], start="fresh"
    )
    inverted = normal.model_copy(update={"name": "inverted", "reward": [RewardTerm(fn="newline_share", weight=-1.0)]})
    rl = RLConfig(
        steps_per_round=12,
        prompts_per_step=2,
        rollout={"group_size": 8, "max_new_tokens": 4, "engine": "hf"},
        gate={"eval_prompts": 6, "max_kl": 100.0, "reward": [RewardTerm(fn="newline_share")], "bootstrap_samples": 200},
        seed=0,
    )
    result = gate_round(
        run_round(
            RoundSpec(
                ModelConfig(name=str(peaked_model)),
                (
                    normal,
                    inverted,
                ),
                rl,
            ),
            round_inputs(train, heldout),
            tmp_path / "r1",
        ),
        rl,
    )

    decision = result.decisions["hourglass"]
    assert decision.metric == "verifiable" and decision.winner != "inverted", decision.reason
    by_name = {c.name: c for c in result.candidates}
    assert by_name["inverted"].eval_metrics["eval/verifiable"] < decision.champion_reward_mean
    assert by_name["normal"].eval_metrics["eval/verifiable"] > by_name["inverted"].eval_metrics["eval/verifiable"]
    assert result.metrics["eval/verifiable/inverted"] == by_name["inverted"].eval_metrics["eval/verifiable"]
    # The old rule - each candidate scored by its own reward, the champion by that same mix - promotes it:
    champion = [decision.champion_reward_mean] * len(by_name["inverted"].eval_rewards)  # mean is enough for the sign
    own = [-x for x in by_name["inverted"].eval_rewards]
    assert paired_bootstrap_lower_bound([a + b for a, b in zip(own, champion)], 0.9, 200) > 0, (
        "the test needs an inverted candidate that learned"
    )


def _thumbs_rows(n: int, *, corrections: bool = False) -> list[Prompt]:
    """Users up-vote 'yes' (+1) and down-vote 'no' (-1); with ``corrections`` every down-voted row
    also carries the user's corrected answer 'yes'."""
    rows = []
    for i in range(n):
        good = i % 2 == 0
        rows.append(
            Prompt(
                prompt_id=f"row{i:02d}",
                messages=[{"role": "user", "content": f"Is {i} fine?"}],
                metadata={},
                logged_completion="yes" if good else "no",
                logged_reward=1.0 if good else -1.0,
                logged_adapter_version="base",
                logged_correction=None if good or not corrections else "yes",
            )
        )
    return rows


THUMBS_KTO = CandidateConfig(
    name="kto",
    algorithm="kto",
    learning_rate=5e-3,
    kl_coef=0.0,
    kto_beta=1.0,
    reward=[RewardTerm(fn="logged")],
    start="fresh",
)
"""A KTO candidate that learns the thumbs of :func:`_thumbs_rows` in a few steps."""


def test_kto_learns_from_thumbs_and_the_feedback_gate_refuses_its_inverse(tiny_model: Path, tmp_path: Path) -> None:
    train, heldout = split_snapshot(snapshot_table(_thumbs_rows(24, corrections=True)), 0.25)
    kto = THUMBS_KTO
    inverse = kto.model_copy(
        update={"name": "kto-inverse", "reward": [RewardTerm(fn="logged", weight=-1.0)], "kto_use_corrections": False}
    )
    rl = RLConfig(
        steps_per_round=6,
        prompts_per_step=2,
        rollout={"group_size": 4, "max_new_tokens": 4, "engine": "hf"},
        gate={"eval_prompts": 6, "max_kl": 100.0, "metric": "feedback", "bootstrap_samples": 200},
    )
    result = gate_round(
        run_round(
            RoundSpec(
                ModelConfig(name=str(tiny_model)),
                (
                    kto,
                    inverse,
                ),
                rl,
            ),
            round_inputs(train, heldout),
            tmp_path / "r1",
        ),
        rl,
    )

    by_name = {c.name: c for c in result.candidates}
    assert sum(m["train/kto_corrections"] for m in by_name["kto"].step_metrics) > 0
    assert all(m["train/kto_corrections"] == 0 for m in by_name["kto-inverse"].step_metrics)
    decision = result.decisions["hourglass"]
    assert decision.metric == "feedback" and decision.winner == "kto", decision.reason
    assert decision.champion_reward_mean == 0.5  # the base ranks nothing
    assert by_name["kto"].eval_metrics["eval/feedback"] == 1.0
    assert by_name["kto-inverse"].eval_metrics["eval/feedback"] == 0.0
    assert "kto-inverse: feedback AUC 0.000 vs base 0.500" in decision.reason
    assert result.metrics["eval/feedback/champion/hourglass"] == 0.5
    assert len(by_name["kto"].eval_rewards) == len(result.eval_prompt_ids) == 6

    # next round: the promoted adapter is the champion, measured against the base by the same yardstick
    champion = {"hourglass": by_name["kto"].adapter_dir}
    again = gate_round(
        run_round(
            RoundSpec(ModelConfig(name=str(tiny_model)), (inverse,), rl),
            round_inputs(train, heldout, champion),
            tmp_path / "r2",
        ),
        rl,
    )
    decision = again.decisions["hourglass"]
    assert decision.champion_reward_mean == 1.0 and decision.winner is None
    assert f"kto-inverse: feedback AUC 0.000 vs champion {by_name['kto'].adapter_dir} 1.000" in decision.reason


def test_no_usable_heldout_row_keeps_the_champion_with_a_reason(tiny_model: Path, tmp_path: Path) -> None:
    """Held-out rows without feedback (feedback metric) or without references (verifiable): no winner, no crash."""
    rows = _thumbs_rows(12)
    unrated = [Prompt(prompt_id=f"z{i}", messages=p.messages, metadata={}) for i, p in enumerate(rows[:4])]
    table = snapshot_table(rows[:8] + unrated)
    train, heldout = split_snapshot(table, 0.25)  # the newest 4 rows carry no completion and no reward
    kto = CandidateConfig(name="kto", algorithm="kto", reward=[RewardTerm(fn="logged")], start="fresh")
    rl = RLConfig(
        steps_per_round=1,
        prompts_per_step=2,
        rollout={"group_size": 2, "max_new_tokens": 3, "engine": "hf"},
        gate={"eval_prompts": 4, "metric": "feedback"},
    )
    result = gate_round(
        run_round(
            RoundSpec(ModelConfig(name=str(tiny_model)), (kto,), rl), round_inputs(train, heldout), tmp_path / "r1"
        ),
        rl,
    )
    decision = result.decisions["hourglass"]
    assert decision.winner is None
    assert "none of the 3 held-out rows carries a logged completion with a reward (user feedback)" in decision.reason
    assert result.eval_prompt_ids == () and result.metrics["eval/prompts"] == 0.0
    assert (
        "eval/feedback/kto" not in result.metrics and "eval/feedback" not in result.candidates[0].eval_metrics
    )  # undefined: left out

    verifiable = rl.model_copy(update={"gate": rl.gate.model_copy(update={"metric": "verifiable"})})
    result = gate_round(
        run_round(
            RoundSpec(ModelConfig(name=str(tiny_model)), (kto,), verifiable),
            round_inputs(train, heldout),
            tmp_path / "r2",
        ),
        verifiable,
    )
    assert "carries the metadata ['reference_answer'] of rl.gate.reward" in result.decisions["hourglass"].reason


class _FakeReport:
    """The reward-model report's fields the gate reads (see trainer.types.RewardModelReport)."""

    def __init__(self, auc_lower_bound: float) -> None:
        self.auc, self.auc_lower_bound = auc_lower_bound + 0.05, auc_lower_bound


class _FakeRewardModel:
    """Scores a completion by its token count; records every batched call."""

    name = "hourglass-reward"

    def __init__(self) -> None:
        self.calls: list[int] = []

    def score(self, prompt_ids_B, completion_ids_B) -> list[float]:
        assert len(prompt_ids_B) == len(completion_ids_B)
        self.calls.append(len(completion_ids_B))
        return [float(len(c)) for c in completion_ids_B]


def test_reward_model_gate_scores_greedy_answers_and_refuses_without_a_better_than_chance_model(
    tiny_model: Path, tmp_path: Path
) -> None:
    from trainer.adapters.store import make_store
    from trainer.model.base import load_base
    from trainer.evaluation.evaluate import Contestants, evaluate
    from trainer.evaluation.gate import gate
    from trainer.executors.local import publish
    from trainer.reward_model.phase import RewardPhase
    from trainer.rollout.hf import HFEngine

    rl = RLConfig(
        rollout={"max_new_tokens": 3, "engine": "hf"},
        gate={"eval_prompts": 4, "metric": "reward_model", "bootstrap_samples": 200, "max_kl": 100.0},
    )
    heldout = [
        Prompt(prompt_id=f"h{i}", messages=[{"role": "user", "content": f"say {i}"}], metadata={}) for i in range(5)
    ]  # no references needed
    base = load_base(ModelConfig(name=str(tiny_model)))
    store = make_store("offload", base)
    engine = HFEngine(base, store)
    cand = CandidateConfig(name="a", start="fresh")
    store.create("a", cand)
    versions = {"a": publish(engine, store, "a", 0, tmp_path, None)[0]}

    def run(reward_model=None, reward_report=None):
        reward = RewardPhase(model=reward_model, report=reward_report)
        evaluation = evaluate(
            base, store, engine, Contestants([cand], versions, {}), heldout, rl, round_id="r1", reward=reward
        )
        return evaluation.results, {m: gate(e, rl) for m, e in evaluation.tenants.items()}, evaluation.metrics

    results, decisions, metrics = run()
    assert decisions["hourglass"].winner is None and "has no reward model" in decisions["hourglass"].reason

    model = _FakeRewardModel()
    results, decisions, _ = run(reward_model=model, reward_report=_FakeReport(0.48))
    assert decisions["hourglass"].reason.startswith(
        "keep base: the reward model is not better than chance on held-out feedback (AUC lower bound 0.480 <= 0.5)"
    )

    model = _FakeRewardModel()
    results, decisions, metrics = run(reward_model=model, reward_report=_FakeReport(0.8))
    assert model.calls == [2 * 4], "one batched call: the candidate's and the base's greedy answers on the 4 eval rows"
    decision = decisions["hourglass"]
    assert decision.metric == "reward_model" and decision.winner is None
    assert results["a"].rewards == tuple(float(len(s.token_ids) or 1) for s in results["a"].samples)
    # a fresh adapter answers as the base does: same scores, no gain
    assert (
        decision.candidate_reward_means["a"]
        == decision.champion_reward_mean
        == metrics["eval/reward_model/champion/hourglass"]
    )
    assert "a: reward-model score" in decision.reason and "does not exceed margin" in decision.reason
    store.close()


def test_a_round_gated_on_a_reward_model_at_chance_promotes_nothing(tiny_model: Path, tmp_path: Path) -> None:
    """The users up- and down-vote the very same answer: the round's reward model cannot beat chance
    on held-out feedback, so the reward_model gate refuses whatever the candidates did."""
    from trainer.config import RewardModelConfig

    rows = [
        Prompt(
            prompt_id=f"s{i:02d}",
            messages=[{"role": "user", "content": "Say something."}],
            metadata={},
            logged_completion="something",
            logged_reward=1.0 if i % 2 else -1.0,
            logged_adapter_version="base",
        )
        for i in range(32)
    ]
    train, heldout = split_snapshot(snapshot_table(rows), 0.25)
    kto = CandidateConfig(name="kto", algorithm="kto", reward=[RewardTerm(fn="logged")], start="fresh")
    rl = RLConfig(
        steps_per_round=1,
        prompts_per_step=2,
        rollout={"group_size": 2, "max_new_tokens": 3, "engine": "hf"},
        gate={"eval_prompts": 4, "metric": "reward_model"},
    )
    result = gate_round(
        run_round(
            RoundSpec(
                ModelConfig(name=str(tiny_model)),
                (kto,),
                rl.model_copy(update={"reward_model": RewardModelConfig(steps=2, batch_size=8, start="fresh")}),
            ),
            round_inputs(train, heldout),
            tmp_path / "r1",
        ),
        rl,
    )
    assert result.reward_model is not None and result.reward_model.report.auc_lower_bound <= 0.5
    decision = result.decisions["hourglass"]
    assert decision.winner is None and decision.metric == "reward_model"
    assert "the reward model is not better than chance on held-out feedback (AUC lower bound" in decision.reason


def test_evaluation_forward_passes_in_chunks_give_the_same_values(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.evaluation import measure as evaluate
    from trainer.model.base import load_base
    from trainer.types import Sample

    base = load_base(
        ModelConfig(name=str(tiny_model), dtype="float32")
    )  # bf16 results shift with batch padding (~1e-3)
    ids = [base.chat_token_ids([{"role": "user", "content": f"q{i}" * (i + 1)}]) for i in range(5)]
    comps = [[11 + i, 12, 13][: 1 + i % 3] for i in range(5)]
    answers = {
        v: [
            Sample(prompt_id=str(i), text="", token_ids=tuple(c), logprobs=(-0.5,) * len(c), adapter_version=v)
            for i, c in enumerate(comps[k:] + comps[:k])
        ]
        for k, v in enumerate(("a", "b", "c"))
    }  # three versions' answers to the same prompts: 15 rows, ordered by prompt in the reference pass

    def values() -> tuple[list[float], dict[str, float], dict[str, list]]:
        ref = evaluate.reference_logprobs(base, ids, answers)
        return evaluate.sequence_logps(base, ids, comps), {v: evaluate.kl_to_base(answers[v], ref[v]) for v in ref}, ref

    whole = values()
    monkeypatch.setattr(evaluate, "EVAL_CHUNK", 2)
    monkeypatch.setattr(evaluate, "REFERENCE_CHUNK_ROWS", 4)  # whole prompts: 3 answers each, one prompt a pass
    chunked = values()
    # Other batch shapes and paddings: the same sums in another order, so float32 rounding only. A sequence
    # log-prob is a sum of <= 3 token log-probs, each within LOGPROB_TOL of the largest |log-prob| (~10.8 nats: the
    # tiny model is near-uniform over 49k tokens); the k3 KL moves by |1 - exp(r)| <= 1 times a reference log-prob's
    # error (r = ref - logged < 0 here), plus the rounding of the KL itself (~9.2 nats: a few U of it).
    token_tol = LOGPROB_TOL * max(float(t.abs().max()) for v in whole[2] for t in whole[2][v] if t is not None)
    seq_err = max(abs(a - b) for a, b in zip(chunked[0], whole[0]))
    kl_err = max(abs(chunked[1][v] - whole[1][v]) for v in whole[1])
    kl_tol = token_tol + 8 * U * max(whole[1].values())
    print(f"chunked vs whole: sequence log-prob error / tol {seq_err / (3 * token_tol):.3g}, KL {kl_err / kl_tol:.3g}")
    assert seq_err <= 3 * token_tol, (chunked[0], whole[0])
    assert kl_err <= kl_tol, (chunked[1], whole[1])
    assert len(chunked[0]) == 5 and all(x < 0 for x in chunked[0])
    # the reference log-probs are the base's sequence log-probs of the same completions
    assert [float(chunked[2]["a"][i].sum()) for i in range(5)] == pytest.approx(whole[0], rel=0, abs=3 * token_tol)


def test_the_feedback_gate_with_positives_from_explicit_is_not_fooled_by_users_who_went_on_after_wrong_answers(
    tiny_model: Path, tmp_path: Path
) -> None:
    """KTO learns 'yes' from thumbs and corrections. Held out: up-voted 'yes', and 'no' answers the users went
    on after (``continued``, a positive implicit label), restated (``rephrased``) or down-voted with the correction
    'yes'. Under ``positives_from = "any"`` the continued 'no' answers are positives, so the candidate that ranks
    'yes' first scores below a perfect AUC; under ``"explicit"`` the positives are the up-votes and the
    corrections, and it ranks every one first."""
    heldout = []
    for i, (answer, reward, source, correction) in enumerate(
        [("yes", 1.0, "thumbs", None)] * 2
        + [("no", 0.5, "continued", None)] * 3
        + [("no", -0.5, "rephrased", None)] * 2
        + [("no", -1.0, "thumbs", "yes")] * 2
    ):
        heldout.append(
            Prompt(
                prompt_id=f"held{i}",
                messages=[{"role": "user", "content": f"Is {100 + i} fine?"}],
                logged_completion=answer,
                logged_reward=reward,
                logged_adapter_version="base",
                logged_correction=correction,
                logged_reward_source=source,
            )
        )
    kto = THUMBS_KTO
    values = {}
    for positives_from in ("any", "explicit"):
        rl = RLConfig(
            steps_per_round=6,
            prompts_per_step=2,
            rollout={"group_size": 4, "max_new_tokens": 4, "engine": "hf"},
            gate={
                "eval_prompts": 16,
                "max_kl": 100.0,
                "metric": "feedback",
                "bootstrap_samples": 200,
                "positives_from": positives_from,
            },
        )
        result = gate_round(
            run_round(
                RoundSpec(ModelConfig(name=str(tiny_model)), (kto,), rl),
                round_inputs(snapshot_table(_thumbs_rows(24, corrections=True)), snapshot_table(heldout)),
                tmp_path / positives_from,
            ),
            rl,
        )
        values[positives_from] = result.candidates[0].eval_metrics["eval/feedback"]
        if positives_from == "explicit":
            assert result.eval_prompt_ids == (
                "held0", "held1", "held5", "held6", "held7", "held7/correction", "held8", "held8/correction",
            )  # fmt: skip
            assert result.decisions["hourglass"].winner == "kto", result.decisions["hourglass"].reason
        else:
            assert len(result.eval_prompt_ids) == 9
    assert values["explicit"] == 1.0
    assert values["any"] < 0.9  # 3 of its 5 positives are the wrong answer
