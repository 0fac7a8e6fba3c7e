"""Unit tests of the worker's asynchronous offset commits: acknowledgements, retries, errors.

A recording stand-in replaces the consumer because a real broker cannot be made to fail one
particular commit on demand; the end-to-end path is covered in test_ingest_kafka.py.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Callable

import pytest
from kafka import TopicPartition
from kafka.errors import CommitFailedError, GroupAuthorizationFailedError, NotCoordinatorError
from kafka.structs import OffsetAndMetadata

from connectors.config import BufferConfig, KafkaConfig
from connectors.ingest import IngestWorker

A, B = TopicPartition("traces", 0), TopicPartition("traces", 1)


class _RecordingConsumer:
    """Keeps async commits until the test answers them; records synchronous commits."""

    def __init__(self) -> None:
        self.pending: list[tuple[dict[TopicPartition, OffsetAndMetadata], Callable[..., None]]] = []
        self.sync: list[dict[TopicPartition, int]] = []

    def commit_async(self, offsets: dict[TopicPartition, OffsetAndMetadata], callback: Callable[..., None]) -> None:
        self.pending.append((offsets, callback))

    def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        self.sync.append({tp: meta.offset for tp, meta in offsets.items()})

    def answer(self, response: Any) -> None:
        offsets, callback = self.pending.pop(0)
        callback(offsets, response)

    def assignment(self) -> set[TopicPartition]:
        return {A, B}


def _offsets(**by_partition: int) -> dict[TopicPartition, OffsetAndMetadata]:
    tps = {"a": A, "b": B}
    return {tps[name]: OffsetAndMetadata(offset, "", -1) for name, offset in by_partition.items()}


@pytest.fixture
def worker(tmp_path: Path) -> IngestWorker:
    return IngestWorker(KafkaConfig(), BufferConfig(root=str(tmp_path / "b"), dead_letter_root=str(tmp_path / "d")))


def test_acknowledged_commits_count_and_nothing_is_resent_at_stop(worker: IngestWorker) -> None:
    consumer = _RecordingConsumer()
    worker._commit(consumer, _offsets(a=10))
    worker._commit(consumer, _offsets(a=20, b=5))
    assert worker.stats().commits == 0  # sent, not acknowledged
    consumer.answer({})
    consumer.answer({})
    assert worker.stats().commits == 2 and worker.stats().last_commit_unix_s is not None
    worker._settle_commits(consumer)
    assert consumer.sync == []


def test_stop_waits_for_unacknowledged_commits_with_the_newest_offsets(worker: IngestWorker) -> None:
    consumer = _RecordingConsumer()
    worker._commit(consumer, _offsets(a=10, b=3))
    worker._commit(consumer, _offsets(a=20))
    worker._settle_commits(consumer)
    assert consumer.sync == [{A: 20, B: 3}]


def test_retriable_failure_is_retried_only_where_no_newer_commit_was_sent(worker: IngestWorker) -> None:
    consumer = _RecordingConsumer()
    worker._commit(consumer, _offsets(a=10, b=3))
    worker._commit(consumer, _offsets(a=20))
    consumer.answer(NotCoordinatorError())  # the first commit failed; A=20 is on its way, B=3 is not
    worker._commit_done(consumer, deque(), block=False)
    assert consumer.sync == [{B: 3}]  # resending A=10 after A=20 would move the group back


def test_rebalance_failure_is_counted_and_other_errors_surface(worker: IngestWorker) -> None:
    consumer = _RecordingConsumer()
    worker._commit(consumer, _offsets(a=10))
    consumer.answer(CommitFailedError())
    assert worker.stats().commit_failures == 1
    worker._commit_done(consumer, deque(), block=False)  # lost to a rebalance: no error, no retry
    assert consumer.sync == []

    worker._commit(consumer, _offsets(a=20))
    consumer.answer(GroupAuthorizationFailedError())
    with pytest.raises(GroupAuthorizationFailedError):
        worker._commit_done(consumer, deque(), block=False)
