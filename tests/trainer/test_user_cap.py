"""One user's flood cannot own a round: the held-out split is drawn across users and time,
and no user holds more than ``rl.split.max_user_share`` of the train or held-out rows."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest

from trainer.errors import DataError
from trainer.data import (
    SNAPSHOT_SCHEMA,
    cap_user_share,
    prompts_from_table,
    row_users,
    split_snapshot,
    user_cap,
    user_metrics,
)

START = datetime(2026, 5, 1, tzinfo=timezone.utc)


def table(rows: list[tuple[str | None, int]]) -> pa.Table:
    """Rows ``(user_hash or None, seconds after START)``, trace ids ``r<i>``."""
    data: dict[str, list] = {name: [] for name in SNAPSHOT_SCHEMA.names}
    for i, (user, second) in enumerate(rows):
        data["trace_id"].append(f"r{i}")
        data["ts"].append(START + timedelta(seconds=second))
        data["model"].append("m")
        data["adapter_version"].append(None)
        data["prompt"].append(json.dumps([{"role": "user", "content": f"q{i}"}]))
        data["completion"].append("a")
        data["completion_token_ids"].append(None)
        data["completion_logprobs"].append(None)
        data["reward"].append(1.0)
        data["metadata"].append(json.dumps({"reference_answer": "1", **({"user_hash": user} if user else {})}))
    return pa.Table.from_pydict(data, schema=SNAPSHOT_SCHEMA)


def shares(part: pa.Table) -> Counter[str]:
    return Counter(row_users(part))


def test_a_flood_just_before_the_round_owns_neither_train_nor_heldout() -> None:
    honest = [(f"user-{u}", 60 * i + u) for u in range(10) for i in range(6)]  # 10 users x 6 rows over an hour
    flood = [("mallory", 3600 + i) for i in range(500)]  # 500 rows in the last minutes
    train, heldout = split_snapshot(table(honest + flood), 0.2, max_user_share=0.2)
    for part in (train, heldout):
        counts = shares(part)
        assert counts["mallory"] / part.num_rows <= 0.2 + 1e-9, counts
        assert len(counts) == 11
    assert shares(heldout)["mallory"] >= 1 and all(shares(heldout)[f"user-{u}"] >= 1 for u in range(10))
    metrics = user_metrics(prompts_from_table(train), prompts_from_table(heldout))
    assert metrics["data/users"] == 11 and metrics["data/max_user_share"] <= 0.2 + 1e-9
    assert metrics["data/heldout_users"] == 11


def test_without_a_cap_the_flood_would_dominate() -> None:  # the attack the cap defends against is real
    honest = [(f"user-{u}", u) for u in range(10)]
    flood = [("mallory", 100 + i) for i in range(90)]
    train, heldout = split_snapshot(table(honest + flood), 0.2)
    assert shares(heldout)["mallory"] / heldout.num_rows > 0.5


def test_heldout_is_each_users_newest_rows_in_proportion() -> None:
    rows = [("a", i) for i in range(10)] + [("b", 100 + i) for i in range(10)]
    train, heldout = split_snapshot(table(rows), 0.2)
    held = sorted(zip(row_users(heldout), heldout.column("trace_id").to_pylist()))
    assert held == [("a", "r8"), ("a", "r9"), ("b", "r18"), ("b", "r19")], (
        "a's newest too, not only b's (the newest slice)"
    )
    for user in ("a", "b"):
        t = [ts for u, ts in zip(row_users(train), train.column("ts").to_pylist()) if u == user]
        h = [ts for u, ts in zip(row_users(heldout), heldout.column("ts").to_pylist()) if u == user]
        assert max(t) < min(h)


def test_rows_without_a_user_hash_are_one_anonymous_user_and_few_users_split_evenly() -> None:
    only_anonymous = table([(None, i) for i in range(10)])
    train, heldout = split_snapshot(only_anonymous, 0.2, max_user_share=0.2)
    assert (train.num_rows, heldout.num_rows) == (8, 2), "one user: the cap cannot go below an even split (all of it)"
    two = table([(None, i) for i in range(30)] + [("b", 100 + i) for i in range(5)])
    capped = cap_user_share(two, 0.2)
    assert shares(capped) == Counter({"anonymous": 5, "b": 5})


def test_user_cap_is_the_largest_feasible_bound() -> None:
    assert user_cap([100, 3, 3, 3, 3], 0.2) == 3
    assert user_cap([5, 5, 5, 5, 5], 0.2) == 5
    assert user_cap([100], 0.2) == 100
    assert user_cap([50, 1, 1, 1, 1, 1, 1, 1, 1, 1], 0.2) == 2  # 2 <= 0.2 * (2 + 9)
    with pytest.raises(DataError, match="max_user_share"):
        split_snapshot(table([("a", 1), ("b", 2)]), 0.5, max_user_share=0.0)


def test_busy_users_are_not_cut_to_a_new_user_s_one_trace() -> None:
    # four equal users cannot each hold 20 %: the share bound alone gave 1 (every app cut to one row, a side of
    # 161 rows to 5); the floor is the typical (lower median) user's count
    assert user_cap([40, 40, 40, 40, 1], 0.2) == 40
    assert user_cap([40, 40, 40, 1, 1], 0.2) == 40
    assert user_cap([40, 40, 1, 1], 0.2) == 1  # half busy, half new: the median is a new user's, the bound holds
    assert user_cap([100, 40, 40, 40, 40, 1], 0.2) == 40  # a flood above the typical user is still cut to it


def test_the_round_splits_with_the_configured_cap_and_logs_user_metrics(tmp_path) -> None:
    """pipeline.rounds.steps.LiveSteps.train_and_evaluate: what reaches the trainer (its data, capped per user,
    and the per-user metrics the round's MLflow run logs), with a fake trainer and no champions."""
    from pipeline.config import HourglassConfig
    from pipeline.rounds.records import RoundRecord
    from pipeline.rounds.steps import LiveSteps
    from trainer.types import RoundResult

    seen = {}

    def fake_run_round(spec, inputs, out_dir, **kwargs):
        seen["inputs"] = inputs
        return RoundResult(
            round_id="r1",
            base_fingerprint="f",
            window_start=inputs.data.window_start,
            window_end=inputs.data.window_end,
            train_rows=len(inputs.data.train),
            heldout_rows=len(inputs.data.heldout),
            eval_prompt_ids=(),
            candidates=(),
            decisions={},
            metrics={"round/wall_s": 1.0},
        )

    class NoChampions(LiveSteps):
        def champions(self, candidates):
            return {}, None

    cfg = HourglassConfig(state_dir=str(tmp_path), rl={"split": {"max_user_share": 0.25}, "rollout": {"engine": "hf"}})
    record = RoundRecord(
        round_id="r1",
        state="train",
        trigger="manual",
        candidates=["default"],
        window="1h",
        created_at="",
        updated_at="",
    )
    rows = [(f"user-{u}", u * 10 + i) for u in range(4) for i in range(5)] + [("mallory", 1000 + i) for i in range(200)]
    steps = NoChampions(cfg, "f" * 64, trainer=fake_run_round)
    result = steps.train_and_evaluate(record, table(rows), lambda boundary: None)
    data = seen["inputs"].data
    for part in (data.train, data.heldout):
        counts = Counter(p.metadata.get("user_hash") for p in part)
        assert counts["mallory"] / len(part) <= 0.25 + 1e-9, counts
    assert data.metrics["data/users"] == 5 and data.metrics["data/max_user_share"] <= 0.25 + 1e-9
    assert result.metrics["round/wall_s"] == 1.0
