"""A span holding an OTLP ``bytes_value`` inside structured content (tool-call arguments, tool schemas) is
refused alone, as invalid content; the other spans of its payload still count (found by a red-team pass)."""

from __future__ import annotations

import json
import time

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from connectors.otel import OtelSourceConfig
from connectors.otel_records import expand_otel_records
from connectors.schema import UserHasher

CFG = OtelSourceConfig()
HASHER = UserHasher("k" * 32, ["user", "user_id", "email"])
NOW = time.time_ns()


def any_value(v: object) -> AnyValue:
    a = AnyValue()
    if isinstance(v, str):
        a.string_value = v
    elif isinstance(v, bytes):
        a.bytes_value = v
    elif isinstance(v, list):
        a.array_value.values.extend(any_value(x) for x in v)
    elif isinstance(v, dict):
        a.kvlist_value.values.extend(KeyValue(key=k, value=any_value(x)) for k, x in v.items())
    return a


def span(n: int, **attrs: object) -> Span:
    base: dict[str, object] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "m",
        "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]),
        "gen_ai.output.messages": json.dumps(
            [{"role": "assistant", "parts": [{"type": "text", "content": "yo"}], "finish_reason": "stop"}]
        ),
        "user.id": "u1",
        **attrs,
    }
    s = Span(
        trace_id=bytes([n]) * 16,
        span_id=bytes([n]) * 8,
        name="chat m",
        start_time_unix_nano=NOW - 1000,
        end_time_unix_nano=NOW,
    )
    s.attributes.extend(KeyValue(key=k, value=any_value(v)) for k, v in base.items())
    return s


class Record:
    def __init__(self, value: bytes) -> None:
        self.topic, self.partition, self.offset, self.key, self.value = CFG.topic, 0, 7, None, value


@pytest.mark.parametrize(
    "attrs",
    [
        {
            "gen_ai.output.messages": [
                {
                    "role": "assistant",
                    "parts": [{"type": "tool_call", "id": "c", "name": "f", "arguments": {"x": b"\x01"}}],
                }
            ]
        },
        {"gen_ai.tool.definitions": [{"type": "function", "name": "f", "parameters": {"x": b"\x00"}}]},
    ],
)
def test_bytes_inside_structured_content_refuse_that_span_only(attrs: dict) -> None:
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    spans.extend([span(1), span(2, **attrs), span(3)])
    out = expand_otel_records([Record(request.SerializeToString())], CFG, HASHER)
    assert len(out.records) == 2  # the good spans still count
    assert [d.reason for d in out.dead_letters] == ["invalid_content"]
    assert out.dead_letters[0].payload is None


@pytest.mark.parametrize("role", ["banana", "function", "model"])
def test_a_message_role_no_chat_template_knows_refuses_that_span_only(role: str) -> None:
    messages = json.dumps([{"role": role, "parts": [{"type": "text", "content": "hi"}]}])
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    spans.extend([span(1), span(2, **{"gen_ai.input.messages": messages}), span(3)])
    out = expand_otel_records([Record(request.SerializeToString())], CFG, HASHER)
    assert len(out.records) == 2
    assert [d.reason for d in out.dead_letters] == ["invalid_content"]
    assert repr(role) in out.dead_letters[0].detail
