"""Shared helpers of the connectors tests: per-test Kafka/buffer settings and a worker thread."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from connectors.config import BufferConfig, KafkaConfig
from connectors.ingest import IngestWorker


@pytest.fixture
def kafka_cfg(broker: str) -> KafkaConfig:
    """Settings on the session broker with topics and group unique to this test."""
    tag = uuid.uuid4().hex[:8]
    return KafkaConfig(bootstrap_servers=[broker], traces_topic=f"traces-{tag}", feedback_topic=f"feedback-{tag}",
                       group_id=f"ingest-{tag}", partitions=2, batch_timeout_ms=200)  # fmt: skip


@pytest.fixture
def buffer_cfg(tmp_path: Path) -> BufferConfig:
    return BufferConfig(root=str(tmp_path / "buffer"), dead_letter_root=str(tmp_path / "dead-letter"))


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until true; fail the test naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


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
