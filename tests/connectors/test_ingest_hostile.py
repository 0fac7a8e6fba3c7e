"""Integration (real Tansu broker): hostile but valid input never stops the ingest worker.

Compressed batches of every codec, a batch the consumer cannot decode, lone surrogates, timestamps out
of range, late feedback, and a full disk (injected ENOSPC and a real 256 KiB tmpfs).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from kafka import KafkaProducer

from connectors import schema as s
from connectors.buffer import RewardBuffer
from connectors.config import BufferConfig, KafkaConfig
from connectors.dead_letter import DeadLetterStore
from connectors.ingest import DEAD_LETTERS, STORAGE_OK, IngestWorker
from connectors.kafka_admin import consumer_group_lag, ensure_topics

from tests.connectors.connector_helpers import wait_for

pytestmark = pytest.mark.integration


def _trace(trace_id: str, ts: datetime | None = None, **over: object) -> bytes:
    fields: dict[str, object] = {"model": "m", "prompt": "p", "completion": "c", **over}
    return s.TraceEvent(trace_id=trace_id, ts=ts or datetime.now(timezone.utc), **fields).to_json_bytes()


def _produce(
    kafka: KafkaConfig, values: list[bytes], topic: str | None = None, key: bytes = b"k", **settings: object
) -> None:
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all", linger_ms=100, **settings)
    try:  # sent together, acknowledged together: one record batch (compressed as a whole)
        futures = [producer.send(topic or kafka.traces_topic, value=value, key=key) for value in values]
        producer.flush(timeout=30)
        for future in futures:
            future.get(timeout=30)
    finally:
        producer.close()


def _stored_ids(buffer: BufferConfig) -> list[str]:
    return sorted(RewardBuffer(buffer).snapshot()["trace_id"].to_pylist())


def _all_committed(kafka: KafkaConfig) -> bool:
    return not any(consumer_group_lag(kafka).values())


def test_batches_of_every_codec_are_stored(
    kafka_cfg: KafkaConfig, buffer_cfg: BufferConfig, run_worker: Callable[..., IngestWorker]
) -> None:
    ensure_topics(kafka_cfg)
    codecs = ("gzip", "snappy", "lz4", "zstd")
    for codec in codecs:
        _produce(
            kafka_cfg,
            [_trace(f"{codec}-{i}", completion="compressible " * 50) for i in range(3)],
            compression_type=codec,
        )
    worker = run_worker(kafka_cfg, buffer_cfg)
    wait_for(lambda: worker.stats().traces >= 12, 60, "12 compressed traces stored")
    assert _stored_ids(buffer_cfg) == sorted(f"{c}-{i}" for c in codecs for i in range(3))
    assert worker.stats().dead_letters == 0 and worker.stats().reconnects == 0


def test_an_undecodable_batch_is_dead_lettered_and_skipped(
    kafka_cfg: KafkaConfig,
    buffer_cfg: BufferConfig,
    run_worker: Callable[..., IngestWorker],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kafka.codec

    ensure_topics(kafka_cfg)
    _produce(kafka_cfg, [_trace("before")])
    _produce(
        kafka_cfg, [_trace(f"snappy-{i}", completion="compressible " * 50) for i in range(2)], compression_type="snappy"
    )
    _produce(kafka_cfg, [_trace("after")])
    monkeypatch.setattr(kafka.codec, "has_snappy", lambda: False)  # the consumer host lacks the codec
    before = DEAD_LETTERS.labels(s.UNDECODABLE_RECORD)._value.get()
    worker = run_worker(kafka_cfg, buffer_cfg)
    wait_for(
        lambda: worker.stats().traces >= 2 and worker.stats().dead_letters >= 2,
        30,
        f"2 traces + 2 dead letters {worker.stats()}",
    )
    assert _stored_ids(buffer_cfg) == ["after", "before"]
    letters = DeadLetterStore(buffer_cfg.dead_letter_root).list()
    assert [d["reason"] for d in letters] == [s.UNDECODABLE_RECORD] * 2
    assert {d["topic"] for d in letters} == {kafka_cfg.traces_topic} and len({d["partition"] for d in letters}) == 1
    assert sorted(d["offset"] for d in letters) == [1, 2]  # "before" is offset 0 of the same partition
    assert "UnsupportedCodecError" in letters[0]["detail"]
    assert worker.stats().reconnects == 0  # no session restart loop
    assert DEAD_LETTERS.labels(s.UNDECODABLE_RECORD)._value.get() - before == 2
    wait_for(lambda: _all_committed(kafka_cfg), 30, "offsets past the undecodable batch committed")


def test_poison_records_are_dead_lettered_and_the_worker_keeps_going(
    kafka_cfg: KafkaConfig, buffer_cfg: BufferConfig, run_worker: Callable[..., IngestWorker]
) -> None:
    """The issue's smallest inputs: a lone surrogate in metadata.user_id, ts in year 9999 and year 1,
    epoch seconds sent as a number, and a numeric string."""
    ensure_topics(kafka_cfg)
    now = datetime.now(timezone.utc)
    good = json.loads(_trace("x"))
    surrogate = (
        json.dumps({**good, "trace_id": "t", "metadata": {"user_id": "@"}}).encode().replace(b'"@"', b'"\\ud800"')
    )
    poison = {
        s.INVALID_UNICODE: surrogate,
        s.TS_OUT_OF_RANGE: json.dumps({**good, "trace_id": "future", "ts": "9999-12-31T23:59:59Z"}).encode(),
        "old": json.dumps({**good, "trace_id": "ancient", "ts": "0001-01-01T00:00:00Z"}).encode(),
        "seconds": json.dumps({**good, "trace_id": "secs", "ts": int(now.timestamp())}).encode(),
        s.SCHEMA_VIOLATION: json.dumps({**good, "trace_id": "numstr", "ts": str(int(now.timestamp()))}).encode(),
    }
    _produce(kafka_cfg, [*poison.values(), _trace("good-after")])
    worker = run_worker(kafka_cfg, buffer_cfg)
    wait_for(lambda: worker.stats().traces >= 1 and worker.stats().dead_letters >= 5, 60, "1 trace + 5 dead letters")
    worker.maintain()  # retention and the sweep run on what was stored: nothing to overflow on
    assert _stored_ids(buffer_cfg) == ["good-after"]
    letters = {json.loads(d["payload"])["trace_id"]: d for d in DeadLetterStore(buffer_cfg.dead_letter_root).list()}
    assert {k: d["reason"] for k, d in letters.items()} == {
        "t": s.INVALID_UNICODE,
        "future": s.TS_OUT_OF_RANGE,
        "ancient": s.TS_OUT_OF_RANGE,
        "secs": s.TS_OUT_OF_RANGE,
        "numstr": s.SCHEMA_VIOLATION,
    }
    assert letters["t"]["detail"].startswith("metadata.user_id:")
    assert json.loads(letters["t"]["payload"])["metadata"]["user_id"].startswith("hmac-sha256:")
    assert "max_event_age_s" in letters["ancient"]["detail"] and "numeric string" in letters["numstr"]["detail"]
    assert worker.health()["storage_ok"] is True


def test_late_feedback_is_dead_lettered_when_unmatched(
    kafka_cfg: KafkaConfig, tmp_path: Path, run_worker: Callable[..., IngestWorker]
) -> None:
    """Feedback whose ts is already behind the sweep watermark when it arrives (join window 2 s, ts now - 6 s)."""
    buffer = BufferConfig(
        root=str(tmp_path / "buf"),
        dead_letter_root=str(tmp_path / "dlq"),
        feedback_join_window_s=2,
        maintenance_interval_s=0.3,
    )
    ensure_topics(kafka_cfg)
    worker = run_worker(kafka_cfg, buffer)
    wait_for(lambda: "feedback_swept_until_ms" in RewardBuffer(buffer).read_manifest(), 30, "a first sweep")
    late = (datetime.now(timezone.utc) - timedelta(seconds=6)).isoformat()
    _produce(
        kafka_cfg,
        [json.dumps({"schema": s.FEEDBACK_SCHEMA, "trace_id": "ghost-old", "ts": late, "thumbs": "up"}).encode()],
        topic=kafka_cfg.feedback_topic,
    )
    store = DeadLetterStore(buffer.dead_letter_root)
    wait_for(lambda: store.count_by_reason().get(s.UNMATCHED_FEEDBACK) == 1, 30, "the late feedback dead-lettered")
    assert json.loads(store.list()[0]["payload"])["trace_id"] == "ghost-old"
    assert worker.stats().unmatched_feedback == 1


def test_a_correction_with_hidden_characters_is_dead_lettered_and_a_clean_one_stored(
    kafka_cfg: KafkaConfig, buffer_cfg: BufferConfig, run_worker: Callable[..., IngestWorker]
) -> None:
    """Through the broker: a correction that reads as "7" but holds a zero-width space and tag characters is
    dead-lettered as hidden_characters (naming them); the same user's plain correction of the trace is stored."""
    ensure_topics(kafka_cfg)
    now = datetime.now(timezone.utc).isoformat()

    def vote(correction: str) -> bytes:
        event = {"schema": s.FEEDBACK_SCHEMA, "trace_id": "x", "ts": now, "thumbs": "down", "correction": correction}
        return json.dumps(event).encode()

    _produce(kafka_cfg, [_trace("x")])
    _produce(kafka_cfg, [vote("7\u200b\U000e0041\U000e0042"), vote("8")], topic=kafka_cfg.feedback_topic)
    worker = run_worker(kafka_cfg, buffer_cfg)
    wait_for(lambda: worker.stats().feedback >= 1 and worker.stats().dead_letters >= 1, 60, "1 feedback + 1 letter")
    letters = DeadLetterStore(buffer_cfg.dead_letter_root).list()
    assert [d["reason"] for d in letters] == [s.HIDDEN_CHARACTERS]
    assert "U+200B, U+E0041, U+E0042" in letters[0]["detail"] and letters[0]["topic"] == kafka_cfg.feedback_topic
    assert worker.stats().feedback == 1 and _stored_ids(buffer_cfg) == ["x"]


def test_a_full_disk_is_retried_until_it_clears_and_nothing_is_lost(
    kafka_cfg: KafkaConfig, tmp_path: Path, run_worker: Callable[..., IngestWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    from connectors import atomic

    buffer = BufferConfig(root=str(tmp_path / "buf"), dead_letter_root=str(tmp_path / "dlq"), storage_retry_max_s=0.3)
    full = {"on": True}
    real_fsync = atomic._fsync

    def fsync(path: str, directory: bool = False) -> None:
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_fsync(path, directory)

    monkeypatch.setattr(atomic, "_fsync", fsync)
    ensure_topics(kafka_cfg)
    _produce(kafka_cfg, [_trace(f"t{i}") for i in range(5)] + [b"not json"])
    worker = run_worker(kafka_cfg, buffer)
    wait_for(lambda: worker.health()["storage_failures"] >= 2, 30, "two failed store attempts")
    health = worker.health()
    assert health["storage_ok"] is False and "No space left" in health["last_error"]
    assert STORAGE_OK._value.get() == 0
    assert worker.stats().traces == 0 and worker.stats().commits == 0
    assert not list(tmp_path.rglob(".tmp-*"))  # failed writes clean up after themselves
    full["on"] = False
    wait_for(
        lambda: worker.stats().traces == 5 and worker.health()["storage_ok"],
        30,
        "the batch stored after the disk cleared",
    )
    assert STORAGE_OK._value.get() == 1 and worker.health()["storage_failures"] == 0
    assert _stored_ids(buffer) == [f"t{i}" for i in range(5)]
    assert [d["reason"] for d in DeadLetterStore(buffer.dead_letter_root).list()] == [
        s.INVALID_JSON
    ]  # once, not per retry
    wait_for(lambda: _all_committed(kafka_cfg), 30, "offsets committed after the retry")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (skipped where mounting is not permitted)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_tmpfs_backs_off_then_recovers(
    kafka_cfg: KafkaConfig, tmp_path: Path, small_tmpfs: Path, run_worker: Callable[..., IngestWorker]
) -> None:
    filler = small_tmpfs / "filler"
    with open(filler, "wb", buffering=0) as f:  # fill the disk to the last block
        try:
            while True:
                f.write(os.urandom(4096))
        except OSError as err:
            assert err.errno == errno.ENOSPC
    buffer = BufferConfig(
        root=str(small_tmpfs / "buf"), dead_letter_root=str(tmp_path / "dlq"), storage_retry_max_s=0.3
    )
    ensure_topics(kafka_cfg)
    ids = [f"tmpfs-{uuid.uuid4().hex[:6]}-{i}" for i in range(20)]
    _produce(kafka_cfg, [_trace(i, completion="x" * 2000) for i in ids])
    worker = run_worker(kafka_cfg, buffer)
    wait_for(lambda: worker.health()["storage_failures"] >= 1, 30, "a failed store on the full tmpfs")
    assert worker.health()["storage_ok"] is False and "No space left" in worker.health()["last_error"]
    assert not list(small_tmpfs.rglob(".tmp-*"))
    filler.unlink()
    wait_for(lambda: worker.stats().traces == 20, 30, "all traces stored once space is back")
    assert _stored_ids(buffer) == sorted(ids) and worker.health()["storage_ok"] is True
