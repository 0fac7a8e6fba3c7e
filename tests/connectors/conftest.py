"""Shared helpers of the connectors tests: per-test Kafka/buffer settings and a worker thread."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from connectors.config import BufferConfig, KafkaConfig
from connectors.ingest import IngestWorker
from connector_helpers import wait_for  # noqa: F401  (re-exported for older imports)


@pytest.fixture
def kafka_cfg(broker: str) -> KafkaConfig:
    """Settings on the session broker with topics and group unique to this test."""
    tag = uuid.uuid4().hex[:8]
    return KafkaConfig(bootstrap_servers=[broker], traces_topic=f"traces-{tag}", feedback_topic=f"feedback-{tag}",
                       group_id=f"ingest-{tag}", partitions=2, batch_timeout_ms=200)  # fmt: skip


@pytest.fixture
def buffer_cfg(tmp_path: Path) -> BufferConfig:
    return BufferConfig(root=str(tmp_path / "buffer"), dead_letter_root=str(tmp_path / "dead-letter"))


@pytest.fixture
def run_worker() -> Iterator[Callable[[KafkaConfig, BufferConfig], IngestWorker]]:
    """Start an IngestWorker in a thread; stopped (gracefully) at teardown."""
    running: list[tuple[threading.Event, threading.Thread]] = []

    def start(kafka: KafkaConfig, buffer: BufferConfig) -> IngestWorker:
        worker = IngestWorker(kafka, buffer)
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        running.append((stop, thread))
        return worker

    yield start
    for stop, thread in running:
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive(), "ingest worker did not stop within 30 s of stop.set()"
