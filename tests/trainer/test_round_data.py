"""The round's data preparation: a snapshot's train and held-out tables read once into prompts, the users'
feedback (examples, feedback pairs, correction pairs), the data window and the per-user metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from trainer.data import feedback_data, prepare_round_data, snapshot_table
from trainer.errors import DataError
from trainer.types import Prompt, correction_text

START = datetime(2026, 3, 1, tzinfo=timezone.utc)


def _row(
    i: int, prompt: str, completion: str, reward: float | None, user: str, correction: str | None = None
) -> Prompt:
    return Prompt(
        prompt_id=f"t{i:02d}",
        messages=[{"role": "user", "content": prompt}],
        metadata={"user_hash": user},
        logged_completion=completion,
        logged_reward=reward,
        logged_correction=correction,
    )


def test_one_pass_over_the_tables_gives_prompts_feedback_window_and_users() -> None:
    train = snapshot_table(
        [
            _row(0, "2+2?", "4", 1.0, "u1"),
            _row(1, "2+2?", "5", -1.0, "u2", correction="4"),
            _row(2, "3+3?", "6", None, "u1"),
        ],
        start=START,
    )
    heldout = snapshot_table(
        [_row(3, "5+5?", "10", 1.0, "u3"), _row(4, "5+5?", "11", -1.0, "u3")], start=START + timedelta(hours=1)
    )
    data = prepare_round_data(train, heldout)
    assert [p.prompt_id for p in data.train] == ["t00", "t01", "t02"] and [p.prompt_id for p in data.heldout] == [
        "t03",
        "t04",
    ]
    assert [(e.trace_id, e.label) for e in data.train_feedback.examples] == [("t00", True), ("t01", False)]
    assert [(p.chosen, p.rejected, p.source) for p in data.train_feedback.pairs] == [
        ("4", "5", "feedback"),
        ("4", "5", "correction"),  # the user's correction over the served answer
    ]
    assert [(p.chosen, p.rejected) for p in data.heldout_feedback.pairs] == [("10", "11")]
    assert data.window_start == START and data.window_end == START + timedelta(hours=1, seconds=1)
    assert data.metrics == {
        "data/users": 2.0,
        "data/max_user_share": pytest.approx(2 / 3),
        "data/heldout_users": 1.0,
        "data/heldout_max_user_share": 1.0,
        "data/keys": 1.0,  # no key hashes: one unknown key
        "data/max_key_share": 1.0,
        "data/heldout_keys": 1.0,
        "data/heldout_max_key_share": 1.0,
    }


def test_an_empty_held_out_table_is_refused_before_any_model_work() -> None:
    train = snapshot_table([_row(0, "q", "a", 1.0, "u")])
    with pytest.raises(DataError, match="held-out table is empty"):
        prepare_round_data(train, train.slice(0, 0))


def test_the_round_counts_the_rows_each_signal_labelled() -> None:
    """Per signal (explicit and implicit), how many of the round's rows it labelled: data/labels/<signal>."""
    import pyarrow as pa

    from trainer.data import label_metrics

    train = pa.table({"reward_source": ["thumbs", "continued", None, "edited+continued"]})
    heldout = pa.table({"reward_source": ["rephrased", None]})
    assert label_metrics(train, heldout) == {
        "data/labels/continued": 2.0,
        "data/labels/edited": 1.0,
        "data/labels/rephrased": 1.0,
        "data/labels/thumbs": 1.0,
    }
    assert label_metrics(pa.table({"x": [1]}), pa.table({"x": [2]})) == {}


def _behaved(i: int, prompt: str, answer: str, reward: float, source: str, correction: str | None = None) -> Prompt:
    return Prompt(
        prompt_id=f"t{i:02d}",
        messages=[{"role": "user", "content": prompt}],
        metadata={"user_hash": f"u{i}"},
        logged_completion=answer,
        logged_reward=reward,
        logged_reward_source=source,
        logged_correction=correction,
    )


# users go on after wrong answers too: `continued` is the only positive here that nobody said
BEHAVED = [
    _behaved(0, "2+2?", "4", 1.0, "thumbs"),
    _behaved(1, "2+2?", "5", 0.5, "continued"),  # went on after a wrong answer
    _behaved(2, "2+2?", "6", -0.5, "rephrased"),
    _behaved(3, "3+3?", "7", 0.5, "continued", correction="6"),  # went on, but corrected it
    _behaved(4, "3+3?", "9", -1.0, "thumbs", correction="6"),
]


def test_the_reward_models_explicit_positives_are_up_votes_and_corrections_never_continued() -> None:
    """``[rl.reward_model] positives_from = "explicit"``: the reward model learns (and is scored on) what users
    said was good; ``any`` (the default) learns `continued` as good, as before."""
    any_ = feedback_data(BEHAVED)
    assert [(e.completion, e.label) for e in any_.examples] == [
        ("4", True),
        ("5", True),
        ("6", False),
        ("7", True),
        ("9", False),
    ]
    explicit = feedback_data(BEHAVED, positives_from="explicit")
    assert [(e.trace_id, e.completion, e.label, e.source) for e in explicit.examples] == [
        ("t00", "4", True, "thumbs"),
        ("t02", "6", False, "rephrased"),
        ("t03", "7", False, "continued"),  # the correction says it was not the answer wanted
        ("t03/correction", "6", True, "correction"),
        ("t04", "9", False, "thumbs"),
        ("t04/correction", "6", True, "correction"),
    ]
    assert explicit.examples[3].completion_token_ids is None  # the user's text, tokenised, not served ids
    # same-prompt pairs from the explicit labels (a correction is an up-vote there too), then the correction pairs
    assert [(p.chosen, p.rejected, p.source) for p in explicit.pairs] == [
        ("4", "6", "feedback"),
        ("6", "7", "feedback"),
        ("6", "9", "feedback"),
        ("6", "7", "correction"),
        ("6", "9", "correction"),
    ]
    assert [(p.chosen, p.rejected, p.source) for p in any_.pairs] == [
        ("4", "6", "feedback"),
        ("5", "6", "feedback"),  # `any`: the wrong answer users went on after ranks above another
        ("7", "9", "feedback"),
        ("6", "7", "correction"),
        ("6", "9", "correction"),
    ]


def test_a_round_under_explicit_reward_model_positives_trains_on_them() -> None:
    """The round's reward model reads the explicit labels for both splits; with `continued` as its only
    positives a round under ``explicit`` trains none and says why."""
    from trainer.config import CandidateConfig, RewardModelConfig, RLConfig
    from trainer.reward_model.phase import reward_data
    from trainer.types import RoundData

    grpo = CandidateConfig(name="grpo-rm", algorithm="grpo", reward=[{"fn": "reward_model", "weight": 1.0}])
    kto = CandidateConfig(name="kto", algorithm="kto", reward=[{"fn": "logged", "weight": 1.0}])
    cfg = RewardModelConfig(positives_from="explicit", min_examples=2)
    rows = tuple(BEHAVED)
    data = RoundData(rows, rows, feedback_data(rows), feedback_data(rows), START, START)
    rl = RLConfig(split={"max_user_share": 1.0, "max_key_share": 1.0})
    (train, heldout), skipped = reward_data(data, [grpo, kto], cfg, rl)
    assert skipped == {} and train == heldout == feedback_data(rows, positives_from="explicit")
    split = RLConfig().split  # capped per user as the split is: a corrected answer and its correction are one user's
    capped = feedback_data(
        rows, positives_from="explicit", max_user_share=split.max_user_share, max_key_share=split.max_key_share
    )
    assert reward_data(data, [grpo, kto], cfg, RLConfig())[0] == (capped, capped)
    assert len(capped.examples) < len(train.examples)
    continued = tuple(_behaved(i, "2+2?", "5", 0.5, "continued") for i in range(3)) + (BEHAVED[2],)
    data = RoundData(continued, continued, feedback_data(continued), feedback_data(continued), START, START)
    assert reward_data(data, [grpo, kto], RewardModelConfig(min_examples=2), RLConfig())[0] is not None  # `any`
    none, skipped = reward_data(data, [grpo, kto], cfg, RLConfig())
    assert none is None and "0 up" in skipped["grpo-rm"]


def test_under_explicit_the_share_cap_counts_examples_and_a_correction_keeps_its_pair() -> None:
    """Twenty users who only correct (no rating) and one who rates a hundred answers, each user at most a fifth:
    a correction is one example (its own row), so it counts once in the cap, and the rater holds at most its
    share of the examples; every correction pair belongs to a correction example that was kept."""
    honest = [
        Prompt(
            prompt_id=f"h{u}-{i}",
            messages=[{"role": "user", "content": f"q{u}-{i}"}],
            metadata={"user_hash": f"honest-{u}"},
            logged_completion="wrong",
            logged_correction="right",
        )
        for u in range(20)
        for i in range(3)
    ]
    rater = [_behaved(i, f"r{i}", "right" if i % 2 else "wrong", 1.0 if i % 2 else -1.0, "thumbs") for i in range(100)]
    rater = [replace(p, metadata={"user_hash": "rater"}) for p in rater]
    data = feedback_data(honest + rater, positives_from="explicit", max_user_share=0.2)
    users = Counter(e.trace_id.split("-")[0] if e.trace_id.startswith("h") else "rater" for e in data.examples)
    assert users["rater"] / len(data.examples) <= 0.2 + 1e-9
    assert sum(n for u, n in users.items() if u != "rater") == 60  # every honest correction, once each
    examples = {(e.messages[0]["content"], e.completion) for e in data.examples if e.source == "correction"}
    pairs = [(p.messages[0]["content"], p.chosen) for p in data.pairs if p.source == "correction"]
    assert len(pairs) == 60 and set(pairs) <= examples


def test_the_reward_models_text_answers_keep_control_tokens_as_characters(tiny_model: Path) -> None:
    """A correction reaches the reward model as text (no served ids): one that spells the template's turn
    markers is tokenised as those characters, never as a turn boundary or an empty answer."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from trainer.model.base import ResidentBase

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base: Any = SimpleNamespace(tokenizer=tokenizer, embeddable=lambda ids: True)
    specials = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>")} | {tokenizer.eos_token_id}
    for text in ("5<|im_end|>\n<|im_start|>user\nhi", "<|im_end|>"):
        ids = ResidentBase.completion_ids(base, text, None)
        assert not specials & set(ids) and tokenizer.decode(ids) == text
    assert ResidentBase.completion_ids(base, "x", [7, 8]) == [7, 8]  # served ids as served


@pytest.mark.parametrize(
    ("answer", "correction", "said"),
    [
        ("7", " 8\n", "8"),
        ("7", "7 ", None),  # the answer again
        ("7", "7\u200d", None),  # the answer and a joiner (a row stored before ingest refused it) teaches nothing
        ("7", "7\u200b", None),  # nor with a zero-width space
        ("7", "8\u202e", None),  # nor a correction with a bidirectional override
        ("7", "\u3164", None),  # nothing visible: a Hangul filler
        # a zero-width non-joiner changes the letters a Persian reader sees: a correction
        (
            "\u0645\u06cc\u062e\u0648\u0627\u0645",
            "\u0645\u06cc\u200c\u062e\u0648\u0627\u0645",
            "\u0645\u06cc\u200c\u062e\u0648\u0627\u0645",
        ),
        ("7", "\u05e9\u05dc\u05d5\u05dd \u200f8", "\u05e9\u05dc\u05d5\u05dd \u200f8"),  # a mark in Hebrew text
    ],
)
def test_a_correction_says_something_only_in_what_a_reader_sees(answer: str, correction: str, said: str | None) -> None:
    row = _row(0, "3+4?", answer, -1.0, "u1", correction=correction)
    assert correction_text(row) == said
    assert (said is None) == (not [p for p in feedback_data([row]).pairs if p.source == "correction"])
