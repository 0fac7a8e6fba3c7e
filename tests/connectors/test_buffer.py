"""Unit tests of the reward buffer on a temporary folder: durability layout, dedup, join, retention."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa

from connectors.buffer import RewardBuffer
from connectors.config import BufferConfig
from connectors.dead_letter import DeadLetterStore
from connectors.schema import CONVERSATION_FIELDS, UNMATCHED_FEEDBACK, FeedbackEvent, TraceEvent
from connectors.segments import SNAPSHOT_SCHEMA, Coordinates

T0 = datetime(2026, 3, 1, 10, 15, tzinfo=timezone.utc)


def _cfg(tmp_path: Path, **over: object) -> BufferConfig:
    return BufferConfig(
        root=str(tmp_path / "buf"), dead_letter_root=str(tmp_path / "dlq"), feedback_join_window_s=600, **over
    )


def _trace(i: int, ts: datetime = T0, **over: object) -> tuple[TraceEvent, Coordinates]:
    fields: dict = {
        "trace_id": f"t{i}",
        "ts": ts,
        "model": "m",
        "prompt": f"q{i}",
        "completion": f"a{i}",
        "completion_token_ids": [1, 2],
        "completion_logprobs": [-0.5, -0.25],
        "metadata": {"reference_answer": str(i)},
    }
    event = TraceEvent(**{**fields, **over})
    return event, Coordinates("traces", 0, i)


def _fb(i: int, ts: datetime, offset: int = 0, **signals: object) -> tuple[FeedbackEvent, Coordinates]:
    return FeedbackEvent(trace_id=f"t{i}", ts=ts, **signals), Coordinates("feedback", 1, offset)


def test_segments_are_hour_partitioned_sealed_arrow_files(tmp_path: Path) -> None:
    buf = RewardBuffer(_cfg(tmp_path))
    paths = buf.append([_trace(1), _trace(2, T0 + timedelta(hours=1))], [_fb(1, T0, thumbs="up")])
    assert len(paths) == 3
    root = tmp_path / "buf"
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.arrow"))
    assert [f.rsplit("/", 1)[0] for f in files] == [
        "feedback/dt=2026-03-01/hour=10",
        "traces/dt=2026-03-01/hour=10",
        "traces/dt=2026-03-01/hour=11",
    ]
    assert not list(root.rglob(".tmp-*"))  # nothing half-written is left behind


def test_snapshot_schema_and_values(tmp_path: Path) -> None:
    buf = RewardBuffer(_cfg(tmp_path))
    buf.append([_trace(1, adapter_version="v3")], [])
    snap = buf.snapshot(T0 - timedelta(hours=1), T0 + timedelta(hours=1))
    assert snap.schema.equals(SNAPSHOT_SCHEMA)
    row = snap.to_pylist()[0]
    assert row["trace_id"] == "t1" and row["adapter_version"] == "v3"
    assert json.loads(row["prompt"]) == [{"role": "user", "content": "q1"}]
    assert row["completion_token_ids"] == [1, 2] and row["completion_logprobs"] == [-0.5, -0.25]
    assert json.loads(row["metadata"]) == {"reference_answer": "1"}
    assert (row["topic"], row["partition"], row["offset"]) == ("traces", 0, 1)
    assert row["reward"] is None and row["reward_source"] is None


def test_redelivered_trace_appears_once(tmp_path: Path) -> None:
    buf = RewardBuffer(_cfg(tmp_path))
    buf.append([_trace(1), _trace(2)], [])
    buf.append([_trace(2), _trace(3)], [])  # redelivery after a crash before the commit
    snap = buf.snapshot()
    assert sorted(snap["trace_id"].to_pylist()) == ["t1", "t2", "t3"]
    assert buf.stats().trace_rows == 4


def test_feedback_joins_before_after_and_outside_window(tmp_path: Path) -> None:
    buf = RewardBuffer(_cfg(tmp_path))
    buf.append([], [_fb(1, T0 - timedelta(seconds=30), thumbs="up")])  # feedback before its trace
    buf.append([_trace(1), _trace(2), _trace(3), _trace(4, reward=0.3)], [])
    buf.append(
        [],
        [
            _fb(2, T0 + timedelta(minutes=5), rating=1),  # after
            _fb(3, T0 + timedelta(hours=2), thumbs="up"),  # too late: outside the window
            _fb(4, T0 + timedelta(minutes=1), thumbs="down"),
        ],
    )  # overrides nothing: reward has priority
    rows = {r["trace_id"]: (r["reward"], r["reward_source"]) for r in buf.snapshot().to_pylist()}
    assert rows == {"t1": (1.0, "thumbs"), "t2": (-1.0, "rating"), "t3": (None, None), "t4": (0.3, "reward")}


def test_snapshot_window_and_consistency(tmp_path: Path) -> None:
    buf = RewardBuffer(_cfg(tmp_path))
    buf.append([_trace(i, T0 + timedelta(minutes=20 * i)) for i in range(6)], [])
    snap = buf.snapshot(T0 + timedelta(minutes=20), T0 + timedelta(minutes=80))
    assert snap["trace_id"].to_pylist() == ["t1", "t2", "t3"]
    assert snap["ts"].type == pa.timestamp("ms", tz="UTC")


def test_unmatched_feedback_past_window_is_dead_lettered_once(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    buf, dlq = RewardBuffer(cfg), DeadLetterStore(cfg.dead_letter_root)
    buf.append(
        [_trace(1)],
        [_fb(1, T0, 0, thumbs="up"), _fb(9, T0, 7, thumbs="down"), _fb(8, T0 + timedelta(hours=3), 8, thumbs="up")],
    )
    assert buf.sweep_unmatched_feedback(dlq, now=T0 + timedelta(minutes=5)) == 0  # window not over yet
    assert buf.sweep_unmatched_feedback(dlq, now=T0 + timedelta(hours=1)) == 1
    assert buf.sweep_unmatched_feedback(dlq, now=T0 + timedelta(hours=1, minutes=5)) == 0  # not twice
    letters = dlq.list()
    assert [(d["reason"], d["topic"], d["offset"]) for d in letters] == [(UNMATCHED_FEEDBACK, "feedback", 7)]
    assert json.loads(letters[0]["payload"])["trace_id"] == "t9"
    assert buf.read_manifest()["feedback_swept_until_ms"] == int((T0 + timedelta(minutes=55)).timestamp() * 1000)


def test_retention_by_age_then_size(tmp_path: Path) -> None:
    writer = RewardBuffer(_cfg(tmp_path))
    for h in range(4):
        writer.append([_trace(h, T0 + timedelta(hours=h))], [])
    biggest = max(seg.size for seg in writer.segments())
    # room for one partition but not two
    buf = RewardBuffer(_cfg(tmp_path, retention_hours=5, retention_max_bytes=max(1024, int(biggest * 1.5))))
    now = T0 + timedelta(hours=6, minutes=30)  # cutoff 11:30: hour 10 (ends 11:00) is too old
    removed = buf.apply_retention(now)
    assert removed == [f"traces/dt=2026-03-01/hour={h}" for h in (10, 11, 12)]  # 10 by age, 11-12 by size
    assert buf.snapshot()["trace_id"].to_pylist() == ["t3"]
    assert buf.apply_retention(now) == []


def test_retention_removes_stale_temp_files_of_a_crashed_write(tmp_path: Path) -> None:
    import os

    buf = RewardBuffer(_cfg(tmp_path))
    buf.append([_trace(1)], [])
    part = next((tmp_path / "buf").rglob("*.arrow")).parent
    stale, fresh = part / ".tmp-dead", part / ".tmp-inflight"
    stale.write_bytes(b"half a segment")
    fresh.write_bytes(b"being written")
    old = (datetime.now(timezone.utc) - timedelta(hours=2)).timestamp()
    os.utime(stale, (old, old))
    assert buf.snapshot()["trace_id"].to_pylist() == ["t1"]  # temp files are never read
    assert buf.apply_retention(T0 + timedelta(minutes=1)) == []
    assert not stale.exists() and fresh.exists()


def test_one_vote_per_user_and_the_latest_correction(tmp_path: Path) -> None:
    buf = RewardBuffer(_cfg(tmp_path))
    alice, bob = {"user_hash": "hmac-sha256:a"}, {"user_hash": "hmac-sha256:b"}
    buf.append(
        [_trace(1), _trace(2), _trace(3)],
        [
            _fb(1, T0 + timedelta(seconds=1), thumbs="up", metadata=alice),
            _fb(
                1, T0 + timedelta(seconds=2), thumbs="up", metadata=alice
            ),  # the same vote again: replaces, never stacks
            _fb(1, T0 + timedelta(seconds=3), thumbs="down", metadata=alice, correction="it is 4"),  # changed mind
            _fb(2, T0 + timedelta(seconds=1), reward=1.0, metadata=alice),
            _fb(2, T0 + timedelta(seconds=2), edited=True, metadata=bob, correction="first"),
            _fb(2, T0 + timedelta(seconds=4), edited=True, metadata=bob, correction="second"),
            _fb(3, T0 + timedelta(seconds=1), thumbs="down"),
            _fb(3, T0 + timedelta(seconds=2), thumbs="up"),  # anonymous: one voter, the latest counts
        ],
    )
    rows = {r["trace_id"]: (r["reward"], r["reward_source"], r["correction"]) for r in buf.snapshot().to_pylist()}
    assert rows == {
        "t1": (-1.0, "thumbs", "it is 4"),
        "t2": (0.5, "reward+edited", "second"),
        "t3": (1.0, "thumbs", None),
    }


def test_retention_never_overflows_and_counts_what_it_deletes(tmp_path: Path) -> None:
    from connectors.buffer import RETENTION_ROWS

    buf = RewardBuffer(_cfg(tmp_path))
    buf.append(
        [
            _trace(1, datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc)),
            _trace(2, datetime(1, 1, 1, tzinfo=timezone.utc)),
            _trace(3),
        ],
        [],
    )
    dirs = sorted(str(p.parent.relative_to(tmp_path / "buf")) for p in (tmp_path / "buf").rglob("*.arrow"))
    assert "traces/dt=0001-01-01/hour=00" in dirs and "traces/dt=9999-12-31/hour=23" in dirs
    assert buf.stats().trace_rows == 3  # every partition is seen by the listing
    before = RETENTION_ROWS.labels("traces")._value.get()
    assert buf.apply_retention(T0 + timedelta(minutes=1)) == ["traces/dt=0001-01-01/hour=00"]
    assert RETENTION_ROWS.labels("traces")._value.get() - before == 1
    huge = RewardBuffer(_cfg(tmp_path, retention_hours=1e12))  # cutoff before year 1: clamped, nothing deleted
    assert huge.apply_retention(datetime(9999, 12, 31, 23, 59, tzinfo=timezone.utc)) == []
    assert buf.apply_retention(datetime(9999, 12, 31, 23, 59, tzinfo=timezone.utc)) == ["traces/dt=2026-03-01/hour=10"]
    assert sorted(buf.snapshot()["trace_id"].to_pylist()) == ["t1"]


def test_late_feedback_below_the_watermark_is_still_swept(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    buf, dlq = RewardBuffer(cfg), DeadLetterStore(cfg.dead_letter_root)
    buf.append([_trace(1)], [_fb(1, T0, 0, thumbs="up")])
    assert buf.sweep_unmatched_feedback(dlq, now=T0 + timedelta(hours=2)) == 0  # watermark: T0 + 1h50
    # Arrives late: its ts is already behind the watermark (a late client, consumer lag).
    RewardBuffer(cfg).append(
        [], [_fb(7, T0 + timedelta(minutes=30), 5, thumbs="down"), _fb(1, T0 + timedelta(minutes=1), 6, rating=4)]
    )
    assert buf.sweep_unmatched_feedback(dlq, now=T0 + timedelta(hours=2, minutes=1)) == 1
    assert buf.sweep_unmatched_feedback(dlq, now=T0 + timedelta(hours=2, minutes=2)) == 0  # not twice
    assert [(d["reason"], d["offset"]) for d in dlq.list()] == [(UNMATCHED_FEEDBACK, 5)]


def test_a_failed_durable_write_removes_its_temp_file(tmp_path: Path, monkeypatch) -> None:
    import errno

    import pytest

    from connectors import atomic
    from connectors.errors import BufferStorageError

    def full(path: str, directory: bool = False) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "_fsync", full)
    buf = RewardBuffer(_cfg(tmp_path))
    with pytest.raises(BufferStorageError, match="No space left"):
        buf.append([_trace(1)], [])
    assert not list((tmp_path / "buf").rglob(".tmp-*")) and not list((tmp_path / "buf").rglob("*.arrow"))


def test_conversation_columns_land_in_the_snapshot(tmp_path: Path) -> None:
    buf = RewardBuffer(_cfg(tmp_path))
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    buf.append(
        [
            _trace(
                1,
                prompt=[{"role": "user", "content": "1+1?"}],
                tools=[tool],
                completion="",
                completion_tool_calls=[call],
                finish_reason="tool_calls",
                prompt_token_ids=[7, 8, 9],
                usage={"prompt_tokens": 3, "completion_tokens": 2},
                conversation_id="conv-1",
                turn=0,
            )
        ],
        [],
    )
    row = buf.snapshot().to_pylist()[0]
    assert json.loads(row["tools"]) == [tool] and json.loads(row["completion_tool_calls"]) == [call]
    assert (row["finish_reason"], row["prompt_token_ids"], row["conversation_id"], row["turn"]) == (
        "tool_calls",
        [7, 8, 9],
        "conv-1",
        0,
    )
    assert json.loads(row["usage"]) == {"prompt_tokens": 3, "completion_tokens": 2} and row["parent_trace_id"] is None


def test_segments_written_before_the_conversation_columns_still_read(tmp_path: Path) -> None:
    """A segment in the old layout (no v2 columns) and a new one read together; the old rows read null there."""
    from connectors.segments import TRACE_SEGMENT_SCHEMA, encode, trace_row, trace_rows_table

    buf = RewardBuffer(_cfg(tmp_path))
    buf.append([_trace(2, prompt_token_ids=[5], turn=1, conversation_id="conv-2")], [])
    old_columns = [f.name for f in TRACE_SEGMENT_SCHEMA if f.name not in CONVERSATION_FIELDS]
    old = trace_rows_table([trace_row(_trace(1)[0], "traces", 0, 1)], T0)
    old = old.select(old_columns)
    assert "prompt_token_ids" not in old.column_names
    folder = tmp_path / "buf" / "traces" / "dt=2026-03-01" / "hour=10"
    (folder / "seg-0000000000001-old-000000-n1.arrow").write_bytes(encode(old))
    snap = buf.snapshot()
    assert sorted(snap["trace_id"].to_pylist()) == ["t1", "t2"]
    rows = {r["trace_id"]: r for r in snap.to_pylist()}
    assert rows["t1"]["prompt_token_ids"] is None and rows["t1"]["turn"] is None
    assert rows["t2"]["prompt_token_ids"] == [5] and rows["t2"]["turn"] == 1


def test_a_snapshot_links_turns_the_gateway_could_not(tmp_path: Path) -> None:
    """Trace 2 continues trace 1's answer (its ``continues`` hash is trace 1's ``answer`` hash) but was served
    by another gateway replica (no parent_trace_id): the snapshot links it; one already linked is kept; a
    hash nobody answered stays unlinked; the latest answer before it wins over later ones."""
    buf = RewardBuffer(_cfg(tmp_path))

    def turn(i: int, minutes: int, **conversation: str) -> tuple[TraceEvent, Coordinates]:
        return _trace(i, T0 + timedelta(minutes=minutes), metadata={"conversation": conversation})

    linked = _trace(5, T0 + timedelta(minutes=5), parent_trace_id="t9", metadata={"conversation": {"continues": "h1"}})
    buf.append(
        [
            turn(1, 0, answer="h1"),
            turn(0, 1, answer="h1"),  # the same prompt and answer again (a regeneration that said the same)
            turn(2, 2, continues="h1", answer="h2"),
            turn(3, 3, continues="h-unknown"),
            linked,
            turn(4, 4, answer="h1"),  # after trace 2: not its parent
        ],
        [],
    )
    parents = {r["trace_id"]: r["parent_trace_id"] for r in buf.snapshot().to_pylist()}
    assert parents == {"t0": None, "t1": None, "t2": "t0", "t3": None, "t4": None, "t5": "t9"}
