"""Integration: real Tansu broker -> IngestWorker -> buffer and dead-letter store."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import datetime, timezone

import pyarrow.compute as pc
import pytest

from connectors import schema as s
from connectors.buffer import RewardBuffer
from connectors.config import BufferConfig, KafkaConfig
from connectors.dead_letter import DeadLetterStore
from connectors.ingest import IngestWorker
from connectors.kafka_admin import ensure_topics
from connectors.replay import iter_sharegpt_traces
from connectors.sink import TraceSink, produce_events

from tests.connectors.connector_helpers import wait_for

pytestmark = pytest.mark.integration
NOW = datetime.now(timezone.utc)


def _trace(i: int, **over: object) -> s.TraceEvent:
    return s.TraceEvent(
        trace_id=f"good-{i}",
        ts=NOW,
        model="base",
        prompt=f"q{i}",
        completion=f"a{i}",
        metadata={"user_id": f"u{i}"},
        **over,
    )


def test_bad_records_are_dead_lettered_and_good_ones_kept(
    kafka_cfg: KafkaConfig, buffer_cfg: BufferConfig, run_worker: Callable[..., IngestWorker]
) -> None:
    kafka = kafka_cfg.model_copy(update={"max_record_bytes": 4096})
    ensure_topics(kafka)
    good_trace = json.loads(_trace(0).to_json_bytes())
    bad: dict[str, bytes] = {
        s.INVALID_JSON: b'{"schema": "hourglass.trace/v1", "trace_id": ',
        s.NOT_UTF8: b'{"schema": "\xff\xfe hourglass"}',
        s.SCHEMA_VIOLATION: json.dumps({**good_trace, "trace_id": "bad-schema", "completion": None}).encode(),
        s.OVERSIZE: json.dumps({**good_trace, "trace_id": "bad-big", "completion": "x" * 5000}).encode(),
        s.NON_FINITE_REWARD: json.dumps({**good_trace, "trace_id": "bad-nan", "reward": float("nan")}).encode(),
        s.UNKNOWN_SCHEMA: json.dumps({**good_trace, "trace_id": "bad-v9", "schema": "hourglass.trace/v9"}).encode(),
        s.NOT_AN_OBJECT: b'["a list"]',
    }
    assert b"NaN" in bad[s.NON_FINITE_REWARD]
    with TraceSink(kafka) as sink:
        for i in range(6):
            sink.send_trace(_trace(i, reward=0.5) if i == 5 else _trace(i))
            for reason, raw in bad.items():
                if i == reason_index(reason, bad):
                    sink.send_raw(kafka.traces_topic, raw, key=b"bad")
        sink.send_feedback(s.FeedbackEvent(trace_id="good-1", thumbs="up", ts=NOW))
        sink.send_raw(kafka.feedback_topic, b"\xc3\x28 not utf-8", key=b"bad")
        assert sink.flush() == 6 + len(bad) + 2
    total = 6 + len(bad) + 2
    worker = run_worker(kafka, buffer_cfg)
    wait_for(lambda: _seen(worker) >= total, 60, f"{total} records ingested")

    snap = RewardBuffer(buffer_cfg).snapshot()
    assert sorted(snap["trace_id"].to_pylist()) == [f"good-{i}" for i in range(6)]
    rewards = dict(zip(snap["trace_id"].to_pylist(), snap["reward"].to_pylist()))
    assert rewards["good-1"] == 1.0 and rewards["good-5"] == 0.5 and rewards["good-0"] is None
    metadata = json.loads(snap.filter(pc.equal(snap["trace_id"], "good-2"))["metadata"][0].as_py())
    assert metadata["user_id"].startswith("hmac-sha256:")

    letters = DeadLetterStore(buffer_cfg.dead_letter_root).list()
    by_reason: dict[str, list[dict]] = {}
    for letter in letters:
        by_reason.setdefault(letter["reason"], []).append(letter)
    assert set(by_reason) == set(bad)
    from connectors.fast_parse import _scrubbed

    hasher = s.UserHasher(buffer_cfg.user_hash_key.get_secret_value(), buffer_cfg.user_id_keys)
    for reason, raw in bad.items():
        stored = _scrubbed(raw, hasher)  # user ids hashed, as in the buffer
        assert (b'"user_id": "u0"' in raw) == (
            reason in (s.SCHEMA_VIOLATION, s.OVERSIZE, s.NON_FINITE_REWARD, s.UNKNOWN_SCHEMA)
        )
        assert b'"user_id": "u0"' not in stored
        found = [
            d
            for d in by_reason[reason]
            if d.get("payload", "").encode() == stored or base64.b64decode(d.get("payload_b64") or "") == stored
        ]
        assert len(found) == 1, f"{reason}: {by_reason[reason]}"
        letter = found[0]
        assert letter["topic"] == kafka.traces_topic and letter["offset"] >= 0 and letter["partition"] in (0, 1)
        assert letter["detail"]
    assert "not_utf8" in {d["reason"] for d in letters if d["topic"] == kafka.feedback_topic}
    assert worker.stats().dead_letters == len(bad) + 1 == len(letters)


def reason_index(reason: str, bad: dict[str, bytes]) -> int:
    """Interleave: the k-th bad record goes after the k-th good one."""
    return list(bad).index(reason) % 6


def _seen(worker: IngestWorker) -> int:
    stats = worker.stats()
    return stats.traces + stats.feedback + stats.dead_letters


def test_sharegpt_replay_through_kafka_loses_nothing(
    kafka_cfg: KafkaConfig, buffer_cfg: BufferConfig, run_worker: Callable[..., IngestWorker]
) -> None:
    n = 5000
    ensure_topics(kafka_cfg)
    events = list(iter_sharegpt_traces(n))
    assert len(events) == n
    with TraceSink(kafka_cfg) as sink:
        assert produce_events(sink, events) == n
    worker = run_worker(kafka_cfg, buffer_cfg)
    wait_for(lambda: worker.stats().traces >= n, 120, f"{n} ShareGPT traces ingested")
    snap = RewardBuffer(buffer_cfg).snapshot()
    assert snap.num_rows == n
    assert set(snap["trace_id"].to_pylist()) == {e.trace_id for e in events}
    assert worker.stats().dead_letters == 0
    first = next(r for r in snap.to_pylist() if r["trace_id"] == events[0].trace_id)
    assert first["completion"] == events[0].completion
    assert json.loads(first["prompt"]) == events[0].messages()


class _CrashBeforeCommit(IngestWorker):
    """Stands for a process that dies after the durable write and before the offset commit."""

    def _commit(self, consumer: object, offsets: object) -> None:
        return None


def test_crash_between_write_and_commit_redelivers_and_snapshot_dedups(
    kafka_cfg: KafkaConfig, buffer_cfg: BufferConfig, run_worker: Callable[..., IngestWorker]
) -> None:
    import threading

    ensure_topics(kafka_cfg)
    n = 40
    with TraceSink(kafka_cfg) as sink:
        assert produce_events(sink, [_trace(i) for i in range(n)]) == n
        sink.send_feedback(s.FeedbackEvent(trace_id="good-3", rating=5, ts=NOW))
        sink.flush()
    crashed = _CrashBeforeCommit(kafka_cfg, buffer_cfg)
    stop = threading.Event()
    thread = threading.Thread(target=crashed.run, args=(stop,), daemon=True)
    thread.start()
    wait_for(lambda: crashed.stats().traces >= n and crashed.stats().feedback >= 1, 60, "first pass")
    stop.set()
    thread.join(timeout=30)
    assert crashed.stats().commits == 0

    again = run_worker(kafka_cfg, buffer_cfg)  # same group: nothing was committed, so all is redelivered
    wait_for(lambda: again.stats().traces >= n and again.stats().feedback >= 1, 60, "redelivery")
    buffer = RewardBuffer(buffer_cfg)
    assert buffer.stats().trace_rows == 2 * n
    snap = buffer.snapshot()
    assert sorted(snap["trace_id"].to_pylist()) == sorted(f"good-{i}" for i in range(n))
    assert snap.filter(pc.equal(snap["trace_id"], "good-3"))["reward"].to_pylist() == [1.0]


class _StopOnLastRecord(IngestWorker):
    """Asks itself to stop the moment it has parsed ``n`` records: the last batch is then stored and
    committed by the shutdown path alone."""

    def __init__(self, *args: object, n: int, stop: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.n, self.stop, self.parsed = n, stop, 0

    def _parse(self, polled: dict) -> object:  # type: ignore[override]
        batch = super()._parse(polled)
        self.parsed += len(batch.traces)
        if self.parsed >= self.n:
            self.stop.set()  # type: ignore[attr-defined]
        return batch


def test_graceful_stop_leaves_every_stored_record_committed(kafka_cfg: KafkaConfig, buffer_cfg: BufferConfig) -> None:
    import threading

    from kafka import KafkaConsumer, TopicPartition

    kafka = kafka_cfg.model_copy(update={"batch_max_records": 50})  # several batches, so several async commits
    ensure_topics(kafka)
    n = 400
    with TraceSink(kafka) as sink:
        assert produce_events(sink, [_trace(i) for i in range(n)]) == n
    stop = threading.Event()
    worker = _StopOnLastRecord(kafka, buffer_cfg, n=n, stop=stop)
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and worker.stats().traces == n
    stats = worker.stats()
    assert stats.commit_failures == 0 and stats.commits >= 1

    snap = RewardBuffer(buffer_cfg).snapshot()
    stored_next = {
        p: max(o for q, o in zip(snap["partition"].to_pylist(), snap["offset"].to_pylist()) if q == p) + 1
        for p in set(snap["partition"].to_pylist())
    }
    probe = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, group_id=kafka.group_id, enable_auto_commit=False)
    try:
        committed = {p: probe.committed(TopicPartition(kafka.traces_topic, p)) for p in range(kafka.partitions)}
    finally:
        probe.close(autocommit=False)
    assert {p: o for p, o in committed.items() if o is not None} == stored_next
