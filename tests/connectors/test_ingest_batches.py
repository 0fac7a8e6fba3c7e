"""Unit tests of how the ingest worker cuts polled records into commit batches."""

from __future__ import annotations

from collections import namedtuple

from kafka import TopicPartition

from connectors.ingest import _next_offsets, _split_batch

Rec = namedtuple("Rec", "offset")
A, B = TopicPartition("traces", 0), TopicPartition("traces", 1)


def test_split_keeps_partition_order_and_commits_only_what_the_batch_holds() -> None:
    pending = {A: [Rec(o) for o in range(10, 16)], B: [Rec(o) for o in range(3)]}
    batch, rest = _split_batch(pending, 4)
    assert {tp: [r.offset for r in rs] for tp, rs in batch.items()} == {A: [10, 11, 12, 13]}
    assert {tp: [r.offset for r in rs] for tp, rs in rest.items()} == {A: [14, 15], B: [0, 1, 2]}
    assert {tp: m.offset for tp, m in _next_offsets(batch).items()} == {A: 14}  # not past 13: 14 is not stored yet
    second, left = _split_batch(rest, 4)
    assert {tp: [r.offset for r in rs] for tp, rs in second.items()} == {A: [14, 15], B: [0, 1]}
    assert {tp: m.offset for tp, m in _next_offsets(second).items()} == {A: 16, B: 2}
    assert {tp: [r.offset for r in rs] for tp, rs in left.items()} == {B: [2]}


def test_split_of_a_small_batch_takes_everything() -> None:
    pending = {A: [Rec(1)], B: [Rec(7), Rec(8)]}
    batch, rest = _split_batch(pending, 4)
    assert batch == pending and rest == {}


def _worker(tmp_path):  # type: ignore[no-untyped-def]
    from connectors.config import BufferConfig, KafkaConfig
    from connectors.ingest import IngestWorker

    return IngestWorker(KafkaConfig(), BufferConfig(root=str(tmp_path / "b"), dead_letter_root=str(tmp_path / "d")))


def test_a_failing_manifest_write_never_hides_the_error_that_ended_the_run(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    import pytest

    from connectors.errors import BufferStorageError

    worker = _worker(tmp_path)

    def session(stop: threading.Event) -> None:
        raise RuntimeError("the first error")

    def manifest(**_: object) -> None:
        raise BufferStorageError("disk full")

    monkeypatch.setattr(worker, "_session", session)
    monkeypatch.setattr(worker.buffer, "write_manifest", manifest)
    with pytest.raises(RuntimeError, match="the first error"):
        worker.run(threading.Event())


def test_a_failing_maintenance_pass_is_reported_not_raised(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from connectors.errors import BufferStorageError

    worker = _worker(tmp_path)

    def sweep(*_: object) -> int:
        raise BufferStorageError("could not write 'x': [Errno 28] No space left on device")

    monkeypatch.setattr(worker.buffer, "sweep_unmatched_feedback", sweep)
    worker._maintain_safely()
    health = worker.health()
    assert "No space left" in health["last_error"] and health["last_error"].startswith("maintenance:")
    assert health["storage_ok"] is True  # the write path itself is fine


def test_only_errors_raised_while_unpacking_records_count_as_undecodable() -> None:
    from connectors.ingest import _undecodable_at

    try:
        raise ValueError("some other failure")
    except ValueError as err:
        assert _undecodable_at(err) is None


def test_ingest_metrics_live_beside_the_service_metrics() -> None:
    """The service and the ingest worker share one Prometheus registry: no name may collide."""
    import prometheus_client

    import connectors.ingest
    import pipeline.service  # noqa: F401  (registers its gauges)

    names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert {"hourglass_ingest_rows_stored", "hourglass_dead_letters", "hourglass_ingest_storage_ok"} <= names
    assert connectors.ingest.RECORDS._name == "hourglass_ingest_rows_stored"
