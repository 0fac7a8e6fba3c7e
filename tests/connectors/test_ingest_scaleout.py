"""Ingest scale-out: three ``hourglass ingest`` processes in one consumer group on the real broker;
one is SIGKILLed mid-stream; every trace id ends up in the snapshot exactly once.

The survivors take over the dead member's partitions after its session times
out (``kafka.session_timeout_ms``) and re-read from the group's last commit, so
raw segments may hold a record twice; the snapshot de-duplicates by trace id.
(The single-process kill/restart loop is tests/connectors/test_crash.py; its
config writer and process starter are reused here.)
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from connectors.buffer import RewardBuffer
from connectors.config import BufferConfig, KafkaConfig
from connectors.kafka_admin import ensure_topics
from connectors.schema import TraceEvent
from connectors.sink import TraceSink

from tests.connectors.connector_helpers import wait_for
from tests.connectors.test_crash import _start, _write_config

pytestmark = pytest.mark.integration

N = 450
WORKERS = 3


def _produce(kafka: KafkaConfig, acked: set[str], done: threading.Event) -> None:
    """N traces in bursts of 15, paced over ~9 s; record the acknowledged trace ids."""
    t0 = datetime.now(timezone.utc)
    with TraceSink(kafka) as sink:
        for start in range(0, N, 15):
            for i in range(start, start + 15):
                trace = TraceEvent(
                    trace_id=f"scale-{i}",
                    ts=t0 + timedelta(milliseconds=i),
                    model="base",
                    prompt=f"q{i}",
                    completion=f"a{i}",
                )
                sink.send_trace(
                    trace, on_done=(lambda tid: lambda err: acked.add(tid) if err is None else None)(trace.trace_id)
                )
            sink.flush()
            time.sleep(0.3)
    done.set()


def _writers(buffer_cfg: BufferConfig) -> set[str]:
    """Writer ids of the trace segments on disk (one per ingest process)."""
    return {p.name.split("-")[2] for p in Path(buffer_cfg.root, "traces").rglob("seg-*.arrow")}


def test_three_ingest_processes_one_killed_every_trace_once(
    kafka_cfg: KafkaConfig, buffer_cfg: BufferConfig, tmp_path: Path
) -> None:
    kafka = kafka_cfg.model_copy(update={"partitions": 3})
    ensure_topics(kafka)
    config = tmp_path / "hourglass.toml"
    _write_config(config, kafka, buffer_cfg)
    logs = [tmp_path / f"ingest-{i}.log" for i in range(WORKERS)]
    procs = [_start(config, log) for log in logs]
    try:
        wait_for(
            lambda: (
                all("ingesting " in log.read_text() for log in logs if log.exists())
                and all(log.exists() for log in logs)
            ),
            90,
            "three ingest processes to start",
        )
        buffer = RewardBuffer(buffer_cfg)
        acked: set[str] = set()
        done = threading.Event()
        producer = threading.Thread(target=_produce, args=(kafka, acked, done), daemon=True)
        producer.start()

        # mid-stream: once every member has stored something (so each owns partitions), kill one
        wait_for(lambda: len(_writers(buffer_cfg)) >= WORKERS or done.is_set(), 60, "every member to store traces")
        writers_before_kill = _writers(buffer_cfg)
        assert not done.is_set(), "the stream ended before the kill; the test did not kill mid-stream"
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)
        assert procs[0].returncode == -signal.SIGKILL

        producer.join(timeout=120)
        assert done.is_set() and len(acked) == N, f"producer: {len(acked)} of {N} acknowledged"
        wait_for(lambda: buffer.snapshot().num_rows >= N, 120, "the survivors to ingest the dead member's partitions")
    finally:
        for proc in procs[1:]:
            proc.send_signal(signal.SIGTERM)  # graceful: finish the batch, commit, leave the group
        for proc in procs:
            proc.wait(timeout=60)
    assert [p.returncode for p in procs[1:]] == [0] * (WORKERS - 1), [log.read_text()[-2000:] for log in logs]

    snap = buffer.snapshot()
    ids = snap["trace_id"].to_pylist()
    assert len(ids) == len(set(ids)) == N  # exactly once in the snapshot
    assert set(ids) == acked  # nothing acknowledged is missing
    assert len(writers_before_kill) == WORKERS  # the load was spread over all three before the kill
    raw = buffer.stats().trace_rows
    assert raw >= N  # raw segments may hold redeliveries
    print(f"raw trace rows {raw} for {N} traces ({raw - N} redelivered after the kill)")
