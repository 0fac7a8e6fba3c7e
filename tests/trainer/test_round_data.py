"""The round's data preparation: a snapshot's train and held-out tables read once into prompts, the users'
feedback (examples, feedback pairs, correction pairs), the data window and the per-user metrics."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from trainer.data import prepare_round_data, snapshot_table
from trainer.errors import DataError
from trainer.types import Prompt

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
