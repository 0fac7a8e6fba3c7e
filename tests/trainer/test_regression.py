"""Regression suites against forgetting (``[[rl.regression]]``): the section refuses bad input, suite files
are read or refused with the line named, the gate refuses a candidate that forgets on a suite (named in its
reason) and lets through one that does not, in a real round on the tiny model, with per-suite metrics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from trainer import rewards
from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.data import round_inputs, snapshot_table, split_snapshot
from trainer.errors import SuiteError
from trainer.evaluation import shipped_suites
from trainer.evaluation.gate import gate, gate_round
from trainer.evaluation.evaluate import load_suites
from trainer.evaluation.regression import load_suite, suite_verdicts
from trainer.regression_config import RegressionSuiteConfig
from trainer.round import run_round
from trainer.tasks import reasoning_gym_prompts
from trainer.types import Comparison, EvalResult, RoundSpec, SuiteScores, TenantEvaluation


def _suite(**fields) -> dict:
    return {"name": "reasoning", "path": "shipped:reasoning-gym-mix", "check": "short_answer"} | fields


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"path": "/etc/passwd"}, "is absolute"),
        ({"path": "~/suite.jsonl"}, "is absolute"),
        ({"path": "C:\\suites\\a.jsonl"}, "is absolute"),
        ({"path": "evals/../../secret.jsonl"}, "leads out of the working directory"),
        ({"path": "shipped:../x"}, "is not a suite name"),
        ({"check": "no_such_reward"}, "unknown reward 'no_such_reward'"),
        ({"check": "logged"}, "cannot score new greedy answers"),
        ({"tolerance": -0.1}, "greater than or equal to 0"),
        ({"max_prompts": 0}, "greater than or equal to 1"),
        ({"name": "Bad Name"}, "must match"),
        ({"served_models": ["no/slash"]}, "must match"),
        ({"pathh": "x.jsonl"}, "Extra inputs are not permitted"),
    ],
)
def test_the_suite_section_refuses_bad_input_with_a_clear_error(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        RLConfig(regression=[_suite(**fields)])
    assert message in str(caught.value)


def test_suite_names_are_unique_and_the_defaults_are_documented() -> None:
    with pytest.raises(ValidationError, match=r"repeated: \['reasoning'\]"):
        RLConfig(regression=[_suite(), _suite()])
    rl = RLConfig(regression=[_suite(), _suite(name="mine", path="evals/mine.jsonl", served_models=["hourglass"])])
    assert [s.name for s in rl.regression] == ["reasoning", "mine"]
    assert rl.regression[0].tolerance == 0.05 and rl.regression[0].max_prompts == 64
    assert rl.regression[1].applies_to("hourglass") and not rl.regression[1].applies_to("other")
    assert RLConfig().regression == []  # off unless configured


def _write(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_a_suite_file_is_read_from_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _write(
        tmp_path / "evals" / "mine.jsonl",
        [
            {"id": "a", "prompt": "2 + 2?", "metadata": {"reference_answer": "4"}},
            "",
            {
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 3?"}],
                "metadata": {"reference_answer": "6"},
            },
            {"prompt": "never read", "metadata": {"reference_answer": "0"}},
        ],
    )
    suite = RegressionSuiteConfig(name="mine", path="evals/mine.jsonl", check="exact_answer", max_prompts=2)
    prompts = load_suite(suite)
    assert [p.prompt_id for p in prompts] == ["a", "mine-3"]  # the default id names the line
    assert prompts[0].messages == [{"role": "user", "content": "2 + 2?"}]
    assert prompts[1].messages[0]["role"] == "system" and prompts[1].metadata == {"reference_answer": "6"}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 1: not JSON"),
        ("[1, 2]", "line 1: a line must be a JSON object"),
        ({"prompt": "x"}, "line 1: metadata lacks ['reference_answer'], which check 'exact_answer' needs"),
        ({"prompt": "x", "messages": [], "metadata": {"reference_answer": "1"}}, "exactly one of"),
        ({"messages": [{"role": "robot", "content": "x"}], "metadata": {"reference_answer": "1"}}, "messages[0]"),
        ({"prompt": "x", "metadata": {"reference_answer": "1"}, "extra": 1}, "unknown field(s) ['extra']"),
        ({"prompt": "x", "id": 7, "metadata": {"reference_answer": "1"}}, "'id' must be a string"),
    ],
)
def test_a_bad_suite_line_is_refused_with_its_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "s.jsonl", [line])
    with pytest.raises(SuiteError) as caught:
        load_suite(RegressionSuiteConfig(name="s", path="s.jsonl", check="exact_answer"))
    assert message in str(caught.value) and "regression suite 's' (s.jsonl)" in str(caught.value)


def test_a_suite_outside_the_working_directory_or_missing_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = _write(tmp_path / "outside" / "secret.jsonl", [{"prompt": "x", "metadata": {"reference_answer": "1"}}])
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(outside, work / "link.jsonl")
    monkeypatch.chdir(work)
    with pytest.raises(SuiteError, match="outside the working directory"):
        load_suite(RegressionSuiteConfig(name="s", path="link.jsonl", check="exact_answer"))
    rl = RLConfig(
        regression=[
            RegressionSuiteConfig(name="gone", path="gone.jsonl", check="exact_answer"),
            RegressionSuiteConfig(name="nope", path="shipped:nope", check="exact_answer"),
        ]
    )
    with pytest.raises(SuiteError) as caught:  # every unreadable suite at once
        load_suites(rl)
    assert "'gone' (gone.jsonl)" in str(caught.value) and "no shipped suite 'nope'" in str(caught.value)
    with pytest.raises(SuiteError, match="cannot be imported"):
        load_suite(RegressionSuiteConfig(name="s", path="shipped:reasoning-gym-mix", check="no_module_here:check"))


def test_the_shipped_suite_is_current_and_scored_by_short_answer() -> None:
    """The committed file is what its generator writes; 64 prompts of reasoning-gym tasks, no arithmetic."""
    lines = shipped_suites.reasoning_gym_mix()
    committed = (shipped_suites.SHIPPED_DIR / "reasoning-gym-mix.jsonl").read_text()
    assert committed == "".join(json.dumps(line, ensure_ascii=False, sort_keys=True) + "\n" for line in lines), (
        "regenerate with `python -m trainer.evaluation.shipped_suites`"
    )
    prompts = load_suite(RegressionSuiteConfig(**_suite()))
    assert len(prompts) == 64 and len({p.prompt_id for p in prompts}) == 64
    tasks = {p.metadata["task"] for p in prompts}
    assert len(tasks) >= 6 and "basic_arithmetic" not in tasks
    first = prompts[0]
    check = rewards.short_answer
    assert check(first.messages, f"{first.metadata['reference_answer']}\nbecause ...", first.metadata) == 1.0
    assert check(first.messages, "I cannot tell.", first.metadata) == 0.0


def test_short_answer() -> None:
    ref = {"reference_answer": "Yes"}
    assert rewards.short_answer([], "**Yes.** Because all A are B.", ref) == 1.0
    assert rewards.short_answer([], "Answer: yes", ref) == 1.0
    assert rewards.short_answer([], "No, yes", ref) == 0.0
    assert rewards.short_answer([], "", ref) == 0.0
    assert rewards.short_answer([], "12 legs", {"reference_answer": "12"}) == 1.0
    assert rewards.short_answer([], "12.0", {"reference_answer": "12"}) == 1.0
    assert rewards.short_answer([], "c, b, a", {"reference_answer": "c, b, a"}) == 1.0
    assert rewards.short_answer([], "c, a, b", {"reference_answer": "c, b, a"}) == 0.0


# --- the gate, on hand-made evaluations --------------------------------------------------------------


def _evaluation(suite_champion: list[float], suite_candidate: list[float]) -> TenantEvaluation:
    """A candidate that clearly beats the base on the held-out rows; its and the base's suite scores as given."""
    won = EvalResult(version="c-s2", samples=(), rewards=(1.0,) * 8, mean_kl=0.0, mean_length=4.0)
    return TenantEvaluation(
        served_model="hourglass",
        metric="verifiable",
        unit="reward",
        comparison=Comparison.MEAN,
        candidates={"c": won},
        champion=(0.0,) * 8,
        champion_value=0.0,
        champion_label="base",
        regression={
            "reasoning": SuiteScores(
                "reasoning",
                tuple(f"p{i}" for i in range(len(suite_champion))),
                tuple(suite_champion),
                {"c": tuple(suite_candidate)},
            )
        },
    )


def test_the_gate_refuses_a_candidate_that_forgets_and_names_the_suite() -> None:
    rl = RLConfig(regression=[_suite(tolerance=0.05)], gate={"bootstrap_samples": 200})
    forgot = gate(_evaluation([1.0] * 16, [1.0] * 8 + [0.0] * 8), rl)
    assert forgot.winner is None
    assert "c: forgets on regression suite 'reasoning': 0.500 vs base 1.000 on 16 prompts" in forgot.reason
    (verdict,) = forgot.regression["c"]
    assert not verdict.passed and verdict.lower_bound < -0.05 and verdict.champion_score == 1.0

    kept = gate(_evaluation([1.0, 0.0] * 8, [1.0, 0.0] * 8), rl)  # the same answers: bound 0 >= -0.05
    assert kept.winner == "c" and kept.regression["c"][0].passed and kept.regression["c"][0].lower_bound == 0.0

    lenient = rl.model_copy(update={"regression": [RegressionSuiteConfig(**_suite(tolerance=1.0))]})
    assert gate(_evaluation([1.0] * 16, [1.0] * 8 + [0.0] * 8), lenient).winner == "c"

    other_model = rl.model_copy(update={"regression": [RegressionSuiteConfig(**_suite(served_models=["other"]))]})
    assert gate(_evaluation([1.0] * 16, [0.0] * 16), other_model).winner == "c"  # not this model's suite


def test_a_suite_that_was_not_scored_refuses_every_candidate() -> None:
    rl = RLConfig(regression=[_suite(), _suite(name="extra")], gate={"bootstrap_samples": 200})
    decision = gate(_evaluation([1.0] * 4, [1.0] * 4), rl)
    assert decision.winner is None and "regression suite 'extra' was not scored" in decision.reason
    assert [v.suite for v in suite_verdicts("c", {}, "hourglass", rl)] == ["reasoning", "extra"]


# --- a real round on the tiny model ------------------------------------------------------------------


def _newline_share(prompt_messages, completion: str, metadata) -> float:
    """Newlines per completion token slot (4 tokens): the 'lines' suite's check."""
    return completion.count("\n") / 4


def no_newline(prompt_messages, completion: str, metadata) -> float:
    """1.0 for an answer without a newline: the gate's yardstick and the 'plain' suite's check
    (imported as ``module:function``)."""
    return float("\n" not in completion)


def test_a_round_refuses_the_candidate_that_forgets_a_suite_and_lets_through_one_that_does_not(
    peaked_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peaked tiny model answers with newlines only. 'flat' learns to answer without them, which the
    gate's yardstick rewards, so it beats the base on the held-out rows; but the suite 'lines' counts
    newlines, so 'flat' forgets it and is refused with the suite named. Gated on the suite 'plain' (answers
    without a newline) instead, it forgets nothing there, and wins."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(rewards.BUILTINS, "newline_share", _newline_share)
    suite_rows = [
        {"prompt": f"Say something about {w}.", "metadata": {}} for w in ("rain", "sun", "snow", "wind", "fog", "ice")
    ]
    _write(tmp_path / "plain.jsonl", suite_rows)
    _write(tmp_path / "lines.jsonl", suite_rows)
    prompts = reasoning_gym_prompts(
        "basic_arithmetic", 24, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    train, heldout = split_snapshot(snapshot_table(prompts), 0.25)
    flat = CandidateConfig(
        name="flat",
        learning_rate=2e-3,
        kl_coef=0.0,
        reward=[RewardTerm(fn="newline_share", weight=-1.0)],
        start="fresh",
    )
    plain = RegressionSuiteConfig(
        name="plain",
        path="plain.jsonl",
        check="tests.trainer.test_regression:no_newline",
        tolerance=0.1,
        max_new_tokens=4,
    )
    lines = RegressionSuiteConfig(
        name="lines", path="lines.jsonl", check="newline_share", tolerance=0.1, max_new_tokens=4
    )
    rl = RLConfig(
        steps_per_round=12,
        prompts_per_step=2,
        rollout={"group_size": 8, "max_new_tokens": 4, "engine": "hf"},
        gate={
            "eval_prompts": 6,
            "max_kl": 100.0,
            "reward": [RewardTerm(fn="tests.trainer.test_regression:no_newline")],
            "bootstrap_samples": 200,
        },
        regression=[plain, lines],
        seed=0,
    )
    evaluated = run_round(
        RoundSpec(ModelConfig(name=str(peaked_model)), (flat,), rl), round_inputs(train, heldout), tmp_path / "r1"
    )
    result = gate_round(evaluated, rl)

    decision = result.decisions["hourglass"]
    assert decision.winner is None, decision.reason
    assert "flat: forgets on regression suite 'lines'" in decision.reason
    assert decision.lower_bounds["flat"] > 0, "the test needs a candidate that beats the base on the gate"
    verdicts = {v.suite: v for v in decision.regression["flat"]}
    assert verdicts["plain"].passed and verdicts["plain"].candidate_score > verdicts["plain"].champion_score
    assert not verdicts["lines"].passed
    assert verdicts["lines"].candidate_score < verdicts["lines"].champion_score - 0.1
    # per-suite scores: round metrics (logged on the round's MLflow run), candidate metrics, bounds from the gate
    metrics = result.metrics
    assert metrics["regression/lines/flat"] == verdicts["lines"].candidate_score
    assert metrics["regression/lines/champion/hourglass"] == verdicts["lines"].champion_score
    assert metrics["regression/lines/flat/lower_bound"] == verdicts["lines"].lower_bound
    assert metrics["regression/lines/flat/passed"] == 0.0 and metrics["regression/plain/flat/passed"] == 1.0
    assert result.candidates[0].eval_metrics["regression/lines"] == verdicts["lines"].candidate_score
    scored = evaluated.evaluations["hourglass"].regression["plain"]
    assert scored.prompt_ids == tuple(f"plain-{i}" for i in range(1, 7)) and len(scored.champion) == 6

    # the same round gated on the 'plain' suite only: 'flat' forgets nothing there, and wins
    only_plain = rl.model_copy(update={"regression": [plain]})
    decision = gate_round(evaluated, only_plain).decisions["hourglass"]
    assert decision.winner == "flat", decision.reason
    assert [v.suite for v in decision.regression["flat"]] == ["plain"] and decision.regression["flat"][0].passed


def _inf_check(prompt_messages, completion: str, metadata) -> float:
    return float("inf") if completion == "inf" else 1.0


def test_hostile_suite_files_and_checks_are_refused_with_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a red-team pass: a line nested past the JSON parser's limit escaped as a RecursionError (a traceback
    from `hourglass config check`), a line of gigabytes was read whole before its length was checked, a check's
    unknown keyword argument passed the load and failed only when the round scored, after the engine call, and a
    check returning infinity was scored (an infinite candidate score passes any tolerance)."""
    from trainer.evaluation.regression import MAX_LINE_BYTES, score_suite
    from trainer.types import Sample

    monkeypatch.chdir(tmp_path)
    good = {"prompt": "2 + 2?", "metadata": {"reference_answer": "4"}}
    for line, message in [
        ("[" * 60_000, "line 1: not JSON"),
        ('{"prompt": "x", "metadata": ' + "[" * 60_000 + "}", "line 1: not JSON"),
        ("x" * (MAX_LINE_BYTES * 64), f"line 1: longer than {MAX_LINE_BYTES} bytes"),
    ]:
        _write(tmp_path / "s.jsonl", [line])
        with pytest.raises(SuiteError, match=message.replace("[", r"\[")):
            load_suite(RegressionSuiteConfig(name="s", path="s.jsonl", check="exact_answer"))
    (tmp_path / "s.jsonl").write_text("x" * (MAX_LINE_BYTES * 64))  # no newline at all
    with pytest.raises(SuiteError, match="longer than"):
        load_suite(RegressionSuiteConfig(name="s", path="s.jsonl", check="exact_answer"))
    _write(tmp_path / "s.jsonl", [good])
    with pytest.raises(SuiteError, match="bogus"):
        load_suite(RegressionSuiteConfig(name="s", path="s.jsonl", check="exact_answer", check_kwargs={"bogus": 1}))
    suite = RegressionSuiteConfig(name="s", path="s.jsonl", check=f"{__name__}:_inf_check")
    prompts = load_suite(suite)
    sample = Sample(prompt_id=prompts[0].prompt_id, text="inf", token_ids=(), logprobs=(), adapter_version="base")
    with pytest.raises(SuiteError, match="not a finite number"):
        score_suite(suite, prompts, [sample])
