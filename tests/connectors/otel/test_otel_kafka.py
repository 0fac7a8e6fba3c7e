"""Against a real Tansu broker: the exporter's payloads (otlp_proto, compressed like a producer may send
them, and otlp_json) read back from a topic decode into the same GenAI calls and events."""

from __future__ import annotations

import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from connectors.otel import OtelSourceConfig, decode_payload, native_events
from tests.connectors.connector_helpers import wait_for
from tests.connectors.otel.otel_fixtures import (
    SIMPLE_INPUT,
    SIMPLE_OUTPUT,
    TRACE_ID,
    otlp_json_bytes,
    proto_bytes,
    span,
    v137_span,
)


@pytest.mark.integration
def test_payloads_round_trip_through_a_real_topic(broker: str) -> None:
    topic = f"otlp_spans-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=[broker])
    try:
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    spans = [v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT), span({"http.route": "/"}, span_id="0000000000000001")]
    payloads = [proto_bytes(*spans), otlp_json_bytes(*spans), b"\xffgarbage"]
    producer = KafkaProducer(bootstrap_servers=[broker], compression_type="gzip", acks="all")
    try:
        for value in payloads:
            producer.send(topic, value=value).get(timeout=30)
    finally:
        producer.close()
    consumer = KafkaConsumer(
        bootstrap_servers=[broker], group_id=None, auto_offset_reset="earliest", enable_auto_commit=False
    )
    consumer.assign([TopicPartition(topic, 0)])
    values: list[bytes] = []
    try:

        def all_read() -> bool:
            for records in consumer.poll(timeout_ms=500).values():
                values.extend(r.value for r in records)
            return len(values) >= 3

        wait_for(all_read, 30, f"3 records on {topic}")
    finally:
        consumer.close()
    assert values == payloads
    auto = OtelSourceConfig(topic=topic, encoding="auto")
    first, second, third = (decode_payload(v, auto) for v in values)
    assert first.calls == second.calls and len(first.calls) == 1 and first.calls[0].trace_id == TRACE_ID
    assert dict(first.skipped) == {"not_genai": 1}
    assert [r.reason for r in third.rejected] == ["invalid_protobuf"]
    assert native_events(values[0], auto).events[0]["trace_id"] == f"otel-{TRACE_ID}-{first.calls[0].span_id}"
