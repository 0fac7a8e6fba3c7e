"""The ingest worker survives a broker outage longer than its session timeout: it reconnects,
rejoins the group and ingests what comes after, losing nothing.

Uses its own Tansu broker, frozen with SIGSTOP and thawed with SIGCONT (Tansu here keeps data
in memory only, so a real restart would empty it; a freeze keeps the log and still breaks every
connection, heartbeat and the group session).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest

from connectors.buffer import RewardBuffer
from connectors.config import BufferConfig, KafkaConfig
from connectors.ingest import IngestWorker
from connectors.kafka_admin import ensure_topics
from connectors.schema import TraceEvent
from connectors.sink import TraceSink, produce_events
from pipeline.stack import Service, broker_service, free_port

from tests.connectors.connector_helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[Service]:
    service = broker_service("127.0.0.1", free_port(), tmp_path / "logs")
    service.start()
    yield service
    service.stop()


def _traces(prefix: str, n: int) -> list[TraceEvent]:
    now = datetime.now(timezone.utc)
    return [TraceEvent(trace_id=f"{prefix}-{i}", ts=now, model="m", prompt="p", completion="c") for i in range(n)]


def test_worker_survives_broker_outage(own_broker: Service, buffer_cfg: BufferConfig) -> None:
    kafka = KafkaConfig(
        bootstrap_servers=[f"127.0.0.1:{own_broker.port}"],
        traces_topic="r-traces",
        feedback_topic="r-feedback",
        group_id="r-ingest",
        partitions=1,
        batch_timeout_ms=200,
        request_timeout_ms=5000,
    )
    ensure_topics(kafka)
    with TraceSink(kafka) as sink:
        assert produce_events(sink, _traces("before", 20)) == 20
    worker = IngestWorker(kafka, buffer_cfg)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: worker.stats().traces >= 20, 60, "records before the outage")
        assert own_broker.process is not None
        os.kill(own_broker.process.pid, signal.SIGSTOP)
        time.sleep(kafka.session_timeout_ms / 1000 + 4)  # past the session timeout: the member is gone
        os.kill(own_broker.process.pid, signal.SIGCONT)
        with TraceSink(kafka) as sink:
            assert produce_events(sink, _traces("after", 15)) == 15
        wait_for(lambda: worker.stats().traces >= 35, 120, "records after the outage")
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    ids = set(RewardBuffer(buffer_cfg).snapshot()["trace_id"].to_pylist())
    assert ids == {f"before-{i}" for i in range(20)} | {f"after-{i}" for i in range(15)}
