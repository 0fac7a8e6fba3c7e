"""The round's plan (built once per round, per candidate) and the algorithm registry, with a fake base
(no model): pools, reward mixes, start points, the prompt-token cache, and the registry's entries."""

from __future__ import annotations

from pathlib import Path

import pytest

import trainer.plan as plan_module
from trainer.config import ALGORITHM_TRAITS, Algorithm, CandidateConfig, RewardTerm, RLConfig
from trainer.errors import DataError
from trainer.plan import PromptTokens, plan_round
from trainer.rewards import RewardMix, build_reward
from trainer.types import Prompt
from trainer.algorithms.registry import ALGORITHMS, ONE_PASS_ALGORITHMS


class FakeBase:
    """Counts tokenisations: one id per character of the chat's contents."""

    max_seq_len = 12

    def __init__(self) -> None:
        self.calls = 0

    def prompt_ids(self, messages: list[dict[str, str]], tools=None, logged_ids=None) -> list[int]:
        self.calls += 1
        return list(logged_ids) if logged_ids else [ord(ch) for m in messages for ch in m["content"]]


def _prompt(i: int, text: str, **kw) -> Prompt:
    return Prompt(prompt_id=f"p{i}", messages=[{"role": "user", "content": text}], **kw)


RL = RLConfig(rollout={"max_new_tokens": 4, "engine": "hf"})
GRADED = [
    _prompt(0, "add 1 2", metadata={"reference_answer": "3"}),
    _prompt(1, "add 2 2", metadata={"reference_answer": "4"}),
]
LOGGED = [_prompt(2, "hello", logged_completion="hi", logged_reward=1.0), _prompt(3, "bye", logged_completion=None)]


def test_prompt_tokens_tokenise_each_prompt_once_and_keep_the_newest_tokens() -> None:
    base = FakeBase()
    tokens = PromptTokens(base, RL)  # type: ignore[arg-type]
    long = _prompt(9, "abcdefghijklmnop")
    first = tokens.many([long, GRADED[0], long])
    again = tokens.many([GRADED[0], long])
    assert base.calls == 2, "two distinct prompts, tokenised once each however often they are used"
    assert first[0] == again[1] == [ord(c) for c in "ijklmnop"]  # max_seq_len 12 - max_new_tokens 4: the last 8 tokens


def test_plan_builds_each_candidates_pool_mix_and_start_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built: list[list[str]] = []
    real = plan_module.build_reward

    def counting(terms: list[RewardTerm]) -> RewardMix:
        built.append([t.fn for t in terms])
        return real(terms)

    monkeypatch.setattr(plan_module, "build_reward", counting)
    graded = CandidateConfig(name="graded", start="champion")
    filtered = CandidateConfig(name="filtered", data_filter="2 2", start="fresh")
    offline = CandidateConfig(
        name="offline", algorithm=Algorithm.OFFLINE_IS, reward=[RewardTerm(fn="logged")], start="self"
    )
    champion = tmp_path / "champion"
    plan = plan_round(
        FakeBase(), [graded, filtered, offline], RL, GRADED + LOGGED, {"hourglass": champion}, tmp_path / "r1"
    )  # type: ignore[arg-type]
    by_name = {c.name: c for c in plan.candidates}
    assert [c.name for c in plan.candidates] == ["graded", "filtered", "offline"]  # config order
    assert built == [["exact_answer"], ["exact_answer"], ["logged"]], "one reward mix per candidate per round"
    assert [p.prompt_id for p in by_name["graded"].pool] == ["p0", "p1"]  # exact_answer needs a reference answer
    assert [p.prompt_id for p in by_name["filtered"].pool] == ["p1"]
    assert [p.prompt_id for p in by_name["offline"].pool] == ["p2"]  # only rows with a logged completion and reward
    assert (
        by_name["graded"].start == champion and by_name["filtered"].start is None and by_name["offline"].start is None
    )
    assert [c.name for c in plan.online] == ["graded", "filtered"]
    one_pass = RL.model_copy(update={"update": RL.update.model_copy(update={"mode": "one_pass"})})
    assert plan.one_pass(one_pass) == {"graded", "filtered"}
    assert plan.one_pass(RL) == set()
    own = CandidateConfig(name="own", start="champion", reference="start")  # its reference pass is its own start
    plan = plan_round(FakeBase(), [graded, own], RL, GRADED, {"hourglass": champion}, tmp_path / "r2")  # type: ignore[arg-type]
    assert plan.one_pass(one_pass) == {"graded"}


def test_a_candidate_with_nothing_to_learn_sits_out_and_a_round_with_none_left_is_refused() -> None:
    picky = CandidateConfig(name="picky", data_filter="nowhere")
    kto = CandidateConfig(
        name="kto", algorithm=Algorithm.KTO, reward=[RewardTerm(fn="logged")], kto_use_corrections=False
    )
    graded = CandidateConfig(name="graded")
    plan = plan_round(FakeBase(), [picky, graded, kto], RL, GRADED + [LOGGED[1]], {}, Path("/tmp/unused"))  # type: ignore[arg-type]
    assert [c.name for c in plan.candidates] == ["graded"] and [p.prompt_id for p in plan.candidates[0].pool] == [
        "p0",
        "p1",
    ]
    assert list(plan.skipped) == ["picky", "kto"]
    assert plan.skipped["picky"].startswith("no training prompts after the data_filter")
    assert plan.skipped["kto"].startswith("no logged rows with completion and reward")
    with pytest.raises(DataError, match=r"candidates \['picky'\] have no training prompts"):
        plan_round(FakeBase(), [picky], RL, GRADED, {}, Path("/tmp/unused"))  # type: ignore[arg-type]
    with pytest.raises(DataError, match=r"offline candidates \['kto'\] have no logged rows"):
        plan_round(FakeBase(), [kto], RL, [LOGGED[1]], {}, Path("/tmp/unused"))  # type: ignore[arg-type]
    both = r"candidates \['picky'\] have no training prompts.*; offline candidates \['kto'\] have no logged rows"
    with pytest.raises(DataError, match=both):
        plan_round(FakeBase(), [picky, kto], RL, GRADED + [LOGGED[1]], {}, Path("/tmp/unused"))  # type: ignore[arg-type]


def test_every_algorithm_has_one_registry_entry_that_agrees_with_the_config() -> None:
    assert set(ALGORITHMS) == set(Algorithm)
    assert set(ALGORITHMS) == set(Algorithm) and all(
        spec.traits is ALGORITHM_TRAITS[a] for a, spec in ALGORITHMS.items()
    )
    assert {a for a, spec in ALGORITHMS.items() if not spec.online} == {Algorithm.OFFLINE_IS, Algorithm.KTO}
    assert ONE_PASS_ALGORITHMS == {Algorithm.GRPO, Algorithm.PPO_CLIP}


def _kto(**kw) -> CandidateConfig:
    return CandidateConfig(**{"name": "kto", "algorithm": Algorithm.KTO, "reward": [RewardTerm(fn="logged")], **kw})


def _rows(up: int, down: int, corrected: int = 0) -> list[Prompt]:
    """``up`` rows with a positive logged reward, ``down`` with a negative one, and ``corrected`` down-voted rows
    that also carry the user's correction (two examples each: the answer, undesirable; the correction, desirable)."""
    rows = [_prompt(i, f"q{i}", logged_completion="a", logged_reward=0.5) for i in range(up)]
    rows += [_prompt(100 + i, f"r{i}", logged_completion="b", logged_reward=-0.5) for i in range(down)]
    rows += [
        _prompt(200 + i, f"c{i}", logged_completion="c", logged_reward=-1.0, logged_correction="7")
        for i in range(corrected)
    ]
    return rows


@pytest.mark.parametrize(
    ("up", "down", "corrected", "ratio"),
    [(25, 75, 0, 1.0), (25, 75, 0, 4 / 3), (10, 50, 40, 1.0), (3, 97, 0, 1.0)],
)
def test_balanced_kto_weights_give_the_classes_the_configured_ratio_of_weight_times_count(
    up: int, down: int, corrected: int, ratio: float
) -> None:
    """kto_balance: the round's usable rows set the weights, corrections counted as desirable examples; the
    weights average 1 over the examples, and weight x count of desirable : undesirable is the configured ratio."""
    candidate = _kto(kto_balance=True, kto_desirable_weight=ratio, kto_undesirable_weight=1.0)
    plan = plan_round(FakeBase(), [candidate], RL, _rows(up, down, corrected), {}, Path("/tmp/unused"))  # type: ignore[arg-type]
    weights = plan.candidates[0].config
    n_desirable, n_undesirable = up + corrected, down + corrected
    assert weights.kto_desirable_weight * n_desirable == pytest.approx(
        ratio * weights.kto_undesirable_weight * n_undesirable
    )
    total = weights.kto_desirable_weight * n_desirable + weights.kto_undesirable_weight * n_undesirable
    assert total == pytest.approx(n_desirable + n_undesirable)
    assert candidate.kto_desirable_weight == ratio, "the configured candidate is not changed"


def test_fixed_kto_weights_stay_as_set_and_a_missing_class_leaves_balanced_weights_at_one() -> None:
    fixed = plan_round(FakeBase(), [_kto(kto_desirable_weight=8.0)], RL, _rows(25, 75), {}, Path("/tmp/unused"))  # type: ignore[arg-type]
    assert (fixed.candidates[0].config.kto_desirable_weight, fixed.candidates[0].config.kto_undesirable_weight) == (
        8.0,
        1.0,
    )
    only_down = plan_round(
        FakeBase(),
        [_kto(kto_balance=True, kto_desirable_weight=8.0)],
        RL,
        _rows(0, 10),
        {},
        Path("/tmp/unused"),  # type: ignore[arg-type]
    )
    config = only_down.candidates[0].config
    assert (config.kto_desirable_weight, config.kto_undesirable_weight) == (1.0, 1.0)


@pytest.mark.parametrize(("desirable", "undesirable"), [(1e9, 1e-9), (1e-9, 1e9), (1e17, 1.0), (1e308, 1e308)])
def test_balanced_kto_weights_stay_positive_and_in_ratio_for_extreme_configured_weights(
    desirable: float, undesirable: float
) -> None:
    candidate = _kto(kto_balance=True, kto_desirable_weight=desirable, kto_undesirable_weight=undesirable)
    weights = plan_round(FakeBase(), [candidate], RL, _rows(25, 75), {}, Path("/tmp/unused")).candidates[0].config  # type: ignore[arg-type]
    assert 0 < weights.kto_desirable_weight < float("inf") and 0 < weights.kto_undesirable_weight < float("inf")
    assert weights.kto_desirable_weight * 25 / (weights.kto_undesirable_weight * 75) == pytest.approx(
        desirable / undesirable, rel=1e-12
    )


def test_a_row_whose_logged_reward_is_not_finite_is_no_kto_example_and_kto_balance_needs_kto() -> None:
    """The snapshot's reward column is a nullable float: a NaN there labels nothing (dropped from the pool, as the
    reward model drops it), so balancing the classes does not fail the round on it."""
    rows = _rows(2, 2) + [
        _prompt(300 + i, f"n{i}", logged_completion="x", logged_reward=v)
        for i, v in enumerate([float("nan"), float("inf")])
    ]
    plan = plan_round(FakeBase(), [_kto(kto_balance=True)], RL, rows, {}, Path("/tmp/unused"))  # type: ignore[arg-type]
    assert sorted(p.prompt_id for p in plan.candidates[0].pool) == ["p0", "p1", "p100", "p101"]
    with pytest.raises(ValueError, match="kto_balance weighs KTO's classes; candidate 'g' uses 'grpo'"):
        CandidateConfig(name="g", kto_balance=True)


def test_kto_desirable_from_explicit_leaves_out_answers_that_only_implicit_signals_called_good() -> None:
    """A positive reward from implicit signals alone (``continued``) is no KTO example under
    ``kto_desirable_from = "explicit"``; thumbs (with an edit too), a negative implicit label, a row from before
    implicit signals (no source) and a user's correction still are. Balancing counts what is left."""
    logged = {"logged_completion": "x"}
    rows = [
        _prompt(0, "a", logged_reward=0.5, logged_reward_source="continued", **logged),
        _prompt(1, "b", logged_reward=1.0, logged_reward_source="thumbs", **logged),
        _prompt(2, "c", logged_reward=-0.5, logged_reward_source="rephrased", **logged),
        _prompt(3, "d", logged_reward=0.5, logged_reward_source="thumbs+edited", **logged),
        _prompt(4, "e", logged_reward=0.5, logged_reward_source=None, **logged),
        _prompt(5, "f", logged_reward=0.5, logged_reward_source="continued", logged_correction="7", **logged),
    ]
    pools = {
        desirable_from: sorted(
            p.prompt_id
            for p in plan_round(
                FakeBase(),
                [_kto(kto_desirable_from=desirable_from)],
                RL,
                rows,
                {},
                Path("/tmp/unused"),  # type: ignore[arg-type]
            )
            .candidates[0]
            .pool
        )
        for desirable_from in ("any", "explicit")
    }
    assert pools == {"any": ["p0", "p1", "p2", "p3", "p4", "p5"], "explicit": ["p1", "p2", "p3", "p4", "p5"]}
    config = (
        plan_round(
            FakeBase(),
            [_kto(kto_desirable_from="explicit", kto_balance=True)],
            RL,
            rows,
            {},
            Path("/tmp/unused"),  # type: ignore[arg-type]
        )
        .candidates[0]
        .config
    )
    # desirable: p1, p3, p4 and p5's correction (p5's answer is none); undesirable: p2
    assert config.kto_desirable_weight * 4 == pytest.approx(config.kto_undesirable_weight * 1)
    with pytest.raises(ValueError, match="kto_desirable_from picks KTO's examples; candidate 'g' uses 'grpo'"):
        CandidateConfig(name="g", kto_desirable_from="explicit")


def test_under_kto_desirable_from_explicit_a_reward_mix_never_makes_an_implicit_label_desirable() -> None:
    """With more in the reward mix than the logged reward (here a `format` bonus), a `rephrased` answer's mix can be
    > 0; under "explicit" it stays an undesirable example, while a thumbs-down answer's mix decides as before."""
    from trainer.algorithms.kto import _examples

    kto = _kto(kto_desirable_from="explicit", reward=[RewardTerm(fn="logged"), RewardTerm(fn="format", weight=0.5)])
    rephrased = _prompt(0, "a", logged_completion="7", logged_reward=-0.2, logged_reward_source="rephrased")
    thumbs = _prompt(1, "b", logged_completion="7", logged_reward=-0.2, logged_reward_source="thumbs")
    mix = build_reward(kto.reward)
    [implicit] = list(_examples(kto, rephrased, mix))
    [explicit] = list(_examples(kto, thumbs, mix))
    assert implicit.value == explicit.value and implicit.value is not None and implicit.value > 0
    assert (implicit.desirable, explicit.desirable) == (False, True)
