"""The ingest worker's OTel path without a broker: polled records of ``otel.topic`` (Collector payloads)
go through the worker's own parse and store steps into the real buffer and dead-letter store.

The end-to-end test with a real broker and vLLM is ``tests/connectors/otel/test_otel_ingest_e2e.py``.
"""

from __future__ import annotations

import json
from collections import namedtuple
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from kafka import TopicPartition
from prometheus_client import REGISTRY

from connectors.buffer import RewardBuffer
from connectors.config import BufferConfig, KafkaConfig
from connectors.dead_letter import DeadLetterStore
from connectors.fast_parse import UndecodableRecord
from connectors.ingest import IngestWorker
from connectors.otel import OtelFeedbackRule, OtelSourceConfig
from connectors.schema import UserHasher
from tests.connectors.otel.otel_fixtures import SIMPLE_INPUT, SIMPLE_OUTPUT, proto_bytes, span, v137_span

Record = namedtuple("Record", "topic partition offset key value")
NOW_NS = int(datetime.now(timezone.utc).timestamp() * 1e9)
GENAI_TRACE = "0af7651916cd43dd8448eb211c80319c"
GENAI_SPAN, HTTP_SPAN, BARE_SPAN, VOTE_SPAN = (
    "b7ad6b7169203331",
    "00000000000000a1",
    "00000000000000b2",
    "00000000000000c3",
)
ATTRS = {
    "gen_ai.operation.name": "chat",
    "gen_ai.request.model": "base",
    "gen_ai.usage.input_tokens": 7,
    "gen_ai.usage.output_tokens": 3,
    "user.id": "alice@example.com",
}


def _otel() -> OtelSourceConfig:
    return OtelSourceConfig(
        topic="otlp_spans", feedback=[OtelFeedbackRule(attribute="feedback.thumbs", signal="thumbs")]
    )


def _worker(tmp_path: Path, otel: OtelSourceConfig | None) -> IngestWorker:
    buffer = BufferConfig(root=str(tmp_path / "b"), dead_letter_root=str(tmp_path / "d"))
    return IngestWorker(KafkaConfig(), buffer, otel=otel)


def _payloads() -> tuple[bytes, bytes]:
    when: dict[str, Any] = {
        "trace_id": GENAI_TRACE,
        "start_ns": NOW_NS - 2_000_000_000,
        "end_ns": NOW_NS - 1_000_000_000,
    }
    calls = proto_bytes(
        v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs=ATTRS, span_id=GENAI_SPAN, **when),
        span({"http.route": "/v1/chat"}, span_id=HTTP_SPAN, **when),
        span(ATTRS, span_id=BARE_SPAN, **when),  # a GenAI span recorded with content capture off
    )
    vote = proto_bytes(
        span(
            {"feedback.thumbs": "up", "user.id": "alice@example.com"},
            span_id=VOTE_SPAN,
            name="user_feedback",
            parent_span_id=GENAI_SPAN,
            trace_id=GENAI_TRACE,
            start_ns=NOW_NS - 500_000_000,
            end_ns=NOW_NS,
        )
    )
    return calls, vote


def _skipped(reason: str) -> float:
    return REGISTRY.get_sample_value("hourglass_otel_spans_skipped_total", {"reason": reason}) or 0.0


def test_otel_records_take_the_native_path_to_the_buffer(tmp_path: Path) -> None:
    import threading

    calls, vote = _payloads()
    worker = _worker(tmp_path, _otel())
    tp = TopicPartition("otlp_spans", 0)
    polled: dict[TopicPartition, list[Any]] = {
        tp: [
            Record("otlp_spans", 0, 10, b"k", calls),
            Record("otlp_spans", 0, 11, None, vote),
            Record("otlp_spans", 0, 12, None, calls),  # redelivered (a Collector retry)
            Record("otlp_spans", 0, 13, None, b"\x07 not an ExportTraceServiceRequest"),
            UndecodableRecord("otlp_spans", 0, 14, "UnsupportedCodecError: lz4"),
        ]
    }
    before = _skipped("not_genai")
    batch = worker._parse(polled)
    worker._store(batch, threading.Event())

    snap = RewardBuffer(worker.buffer.cfg).snapshot()
    assert snap["trace_id"].to_pylist() == [f"otel-{GENAI_TRACE}-{GENAI_SPAN}"]  # once, though delivered twice
    row = snap.filter(pc.equal(snap["trace_id"], snap["trace_id"][0]))
    assert json.loads(row["prompt"][0].as_py()) == [
        {"role": "system", "content": "You are a helpful bot"},
        {"role": "user", "content": "Tell me a joke about OpenTelemetry"},
    ]
    assert row["model"][0].as_py() == "base" and row["completion"][0].as_py().startswith(" Why did the developer")
    assert row["reward"][0].as_py() == 1.0  # the thumbs-up span, parented to the GenAI span, joined it
    metadata = json.loads(row["metadata"][0].as_py())
    hasher = UserHasher(worker.buffer.cfg.user_hash_key.get_secret_value(), worker.buffer.cfg.user_id_keys)
    assert metadata["user"] == hasher.digest("alice@example.com")  # never the address in clear
    assert metadata["user_hash"] == hasher.digest("otel\x00alice@example.com")
    assert metadata["usage"] == {"prompt_tokens": 7, "completion_tokens": 3}
    assert (row["topic"][0].as_py(), row["offset"][0].as_py()) == ("otlp_spans", 10)

    letters = DeadLetterStore(worker.buffer.cfg.dead_letter_root).list()
    by_offset = sorted((letter["offset"], letter["reason"]) for letter in letters)
    assert by_offset == [(10, "no_content"), (12, "no_content"), (13, "invalid_protobuf"), (14, "undecodable_record")]
    bare = next(letter for letter in letters if letter["offset"] == 10)
    assert BARE_SPAN in bare["detail"] and bare["key"] == "k"
    assert all(letter.get("payload") is None and "payload_b64" not in letter for letter in letters)
    assert "alice" not in json.dumps(letters)

    stats = worker.stats()
    # skipped: the HTTP span of each delivery, and the vote span (not an inference call; read for its vote)
    assert (stats.traces, stats.feedback, stats.otel_records, stats.otel_spans_skipped) == (2, 1, 4, 3)
    assert _skipped("not_genai") - before == 3


def test_without_an_otel_section_the_topic_is_not_read_and_records_stay_native(tmp_path: Path) -> None:
    calls, _ = _payloads()
    worker = _worker(tmp_path, None)
    assert "otlp_spans" not in worker._topics()
    batch = worker._parse({TopicPartition("otlp_spans", 0): [Record("otlp_spans", 0, 1, None, calls)]})
    assert not batch.traces and [letter.reason for letter in batch.dead_letters] == ["not_utf8"]


def test_the_otel_topic_is_added_to_the_subscription(tmp_path: Path) -> None:
    worker = _worker(tmp_path, _otel())
    kafka = worker.kafka
    assert worker._topics() == [kafka.traces_topic, kafka.feedback_topic, "otlp_spans"]
