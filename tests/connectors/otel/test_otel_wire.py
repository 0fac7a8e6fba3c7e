"""Payload decoding: otlp_proto and otlp_json give the same calls (OTLP/JSON's hex ids, integer enums and
string int64s included), the real OTel SDK's OTLP encoder is read, and every malformed or oversized payload
or span is a Rejected value with a reason code, never an exception."""

from __future__ import annotations

import json

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from connectors.otel import OtelSourceConfig, decode_payload
from tests.connectors.otel.otel_fixtures import (
    SIMPLE_ATTRS,
    SIMPLE_INPUT,
    SIMPLE_OUTPUT,
    SPAN_ID,
    TRACE_ID,
    MULTIMODAL_INPUT,
    otlp_json_bytes,
    proto_bytes,
    request,
    span,
    v137_span,
)

CFG = OtelSourceConfig()
DEEP_PART_INPUT = [{"role": "user", "parts": [{"type": "text", "content": "hi", "meta": {"a": {"b": {"c": 1}}}}]}]
JSON_CFG = OtelSourceConfig(encoding="otlp_json")


def reasons(payload: bytes | None, cfg: OtelSourceConfig = CFG) -> list[str]:
    batch = decode_payload(payload, cfg)
    return [r.reason for r in batch.rejected]


def test_otlp_json_gives_the_same_calls_as_otlp_proto() -> None:
    spans = [
        v137_span(
            SIMPLE_INPUT, SIMPLE_OUTPUT, parent_span_id="1111111111111111", links=[(TRACE_ID, "2222222222222222")]
        ),
        v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, span_id="00f067aa0ba902b9", structured=True),
    ]
    from_proto = decode_payload(proto_bytes(*spans), CFG)
    raw = otlp_json_bytes(*spans)
    text = raw.decode()
    assert f'"traceId": "{TRACE_ID}"' in text and '"kind": 3' in text and '"startTimeUnixNano": "17' in text
    from_json = decode_payload(raw, JSON_CFG)
    assert from_json.calls == from_proto.calls and len(from_json.calls) == 2
    assert from_json.calls[0].parent_span_id == "1111111111111111"
    assert decode_payload(raw, OtelSourceConfig(encoding="auto")).calls == from_proto.calls
    assert decode_payload(proto_bytes(*spans), OtelSourceConfig(encoding="auto")).calls == from_proto.calls


def test_spans_from_the_real_opentelemetry_sdk_and_its_otlp_encoder() -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "sdk-app"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("chat gpt-4") as sp:
        for key, value in SIMPLE_ATTRS.items():
            sp.set_attribute(key, value)
        sp.set_attribute("gen_ai.input.messages", json.dumps(SIMPLE_INPUT))
        sp.set_attribute("gen_ai.output.messages", json.dumps(SIMPLE_OUTPUT))
        sp.set_attribute("user.id", "bob")
    payload = encode_spans(exporter.get_finished_spans()).SerializeToString()  # the bytes an OTLP exporter sends
    batch = decode_payload(payload, CFG)
    assert len(batch.calls) == 1 and not batch.rejected
    call = batch.calls[0]
    assert (call.service_name, call.user_id, call.output_text) == (
        "sdk-app",
        "bob",
        SIMPLE_OUTPUT[0]["parts"][0]["content"],
    )
    assert call.span_id == format(sp.get_span_context().span_id, "016x")


@pytest.mark.parametrize(
    ("payload", "cfg", "reason"),
    [
        (None, CFG, "empty_value"),
        (b"", CFG, "empty_value"),
        (b"\xff\xff\xff not a protobuf", CFG, "invalid_protobuf"),
        (b"\x0a\x05abc", CFG, "invalid_protobuf"),  # a truncated length-delimited field
        (b"{not json", JSON_CFG, "invalid_json"),
        (b"\xff\xfe", JSON_CFG, "invalid_json"),
        (b"[1, 2]", JSON_CFG, "invalid_otlp"),
        (b'{"resourceSpans": {"a": 1}}', JSON_CFG, "invalid_otlp"),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "xyz"}]}]}]}', JSON_CFG, "invalid_otlp"),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 7}]}]}]}', JSON_CFG, "invalid_otlp"),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": 5, "kind": "NOPE"}]}]}]}', JSON_CFG, "invalid_otlp"),
        (
            b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "soon"}]}]}]}',
            JSON_CFG,
            "invalid_otlp",
        ),
        (b"[" * 100_000 + b"]" * 100_000, JSON_CFG, "nesting_too_deep"),
        (b"{}", JSON_CFG, "invalid_otlp"),
        (b'{"resourceLogs": []}', JSON_CFG, "invalid_otlp"),  # a logs export on the traces topic
        (b'{"resourceSpans": [], "resource_spans": []}', JSON_CFG, "invalid_otlp"),  # which one? (one was dropped)
        (b'{"resourceSpans": [{"scopeSpans": [], "scope_spans": [{"spans": [{}]}]}]}', JSON_CFG, "invalid_otlp"),
        (b"\x78\x01", CFG, "invalid_protobuf"),  # parses as an unknown varint field: no spans
        (b"x" * 2048, OtelSourceConfig(max_payload_bytes=1024), "oversize"),
    ],
)
def test_malformed_payloads_are_rejected_with_a_reason(
    payload: bytes | None, cfg: OtelSourceConfig, reason: str
) -> None:
    batch = decode_payload(payload, cfg)
    assert [r.reason for r in batch.rejected] == [reason], batch.rejected
    assert batch.rejected[0].span_id is None and not batch.calls


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _nested_array(depth: int) -> bytes:
    """A serialized AnyValue that is ``depth`` arrays deep (built as bytes: protobuf's own classes refuse to
    build what its parser refuses to read)."""
    value = AnyValue(string_value="leaf").SerializeToString()
    for _ in range(depth):
        array = b"\x0a" + _varint(len(value)) + value  # ArrayValue.values (field 1)
        value = b"\x2a" + _varint(len(array)) + array  # AnyValue.array_value (field 5)
    return value


@pytest.mark.parametrize(("depth", "reason"), [(40, "nesting_too_deep"), (5000, "invalid_protobuf")])
def test_deeply_nested_attribute_values_are_refused_not_a_crash(depth: int, reason: str) -> None:
    sp = span(SIMPLE_ATTRS)
    nested = _nested_array(depth)
    key = b"gen_ai.input.messages"
    pair = b"\x0a" + _varint(len(key)) + key + b"\x12" + _varint(len(nested)) + nested  # KeyValue{key, value}
    raw_span = sp.SerializeToString() + b"\x4a" + _varint(len(pair)) + pair  # Span.attributes (field 9)
    scope_spans = b"\x12" + _varint(len(raw_span)) + raw_span  # ScopeSpans.spans (field 2)
    resource_spans = b"\x12" + _varint(len(scope_spans)) + scope_spans  # ResourceSpans.scope_spans (field 2)
    payload = b"\x0a" + _varint(len(resource_spans)) + resource_spans  # ExportTraceServiceRequest.resource_spans
    assert reasons(payload) == [reason]


def test_too_many_spans_rejects_the_payload() -> None:
    spans = [span({"http.route": "/"}, span_id=f"{i + 1:016x}") for i in range(5)]
    assert reasons(proto_bytes(*spans), OtelSourceConfig(max_spans_per_payload=4)) == ["too_many_spans"]
    assert reasons(proto_bytes(*spans), OtelSourceConfig(max_spans_per_payload=5)) == []


@pytest.mark.parametrize(
    ("sp", "cfg", "reason"),
    [
        # content that is not JSON, or JSON of the wrong shape or types
        (
            v137_span(attrs={**SIMPLE_ATTRS, "gen_ai.input.messages": "{oops"}, output_messages=SIMPLE_OUTPUT),
            CFG,
            "invalid_content",
        ),
        (v137_span({"role": "user"}, SIMPLE_OUTPUT), CFG, "invalid_content"),
        (
            v137_span([{"role": "user", "parts": [{"type": "text", "content": 5}]}], SIMPLE_OUTPUT),
            CFG,
            "invalid_content",
        ),
        (v137_span([{"role": 3, "parts": []}], SIMPLE_OUTPUT), CFG, "invalid_content"),
        (v137_span([{"role": "user", "parts": [{"content": "no type"}]}], SIMPLE_OUTPUT), CFG, "invalid_content"),
        (v137_span(SIMPLE_INPUT, [{"role": "assistant", "parts": "text"}]), CFG, "invalid_content"),
        (
            v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs={**SIMPLE_ATTRS, "gen_ai.usage.input_tokens": "many"}),
            CFG,
            "invalid_content",
        ),
        # media and provider-side tools
        (v137_span(MULTIMODAL_INPUT, SIMPLE_OUTPUT), CFG, "unsupported_content"),
        (
            v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, tools=[{"type": "code_interpreter", "name": "ci"}]),
            CFG,
            "unsupported_content",
        ),
        # bounds
        (v137_span(SIMPLE_INPUT * 3, SIMPLE_OUTPUT), OtelSourceConfig(max_messages_per_span=5), "too_many_messages"),
        (
            v137_span([{"role": "user", "parts": [{"type": "text", "content": "x" * 400}]}], SIMPLE_OUTPUT),
            OtelSourceConfig(max_attribute_bytes=256),
            "oversize_attribute",
        ),
        (
            v137_span(DEEP_PART_INPUT, SIMPLE_OUTPUT, structured=True),
            OtelSourceConfig(max_json_depth=4),
            "nesting_too_deep",
        ),
        (
            v137_span(
                attrs={**SIMPLE_ATTRS, "gen_ai.input.messages": "[" * 40 + "]" * 40}, output_messages=SIMPLE_OUTPUT
            ),
            CFG,
            "nesting_too_deep",
        ),
        (
            v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, tools=[{"type": "function", "name": f"t{i}"} for i in range(3)]),
            OtelSourceConfig(max_tools=2),
            "too_many_tools",
        ),
        # ids, times, model
        (v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, trace_id="00" * 16), CFG, "invalid_span"),
        (v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, start_ns=0, end_ns=0), CFG, "invalid_span"),
    ],
)
def test_bad_spans_are_rejected_with_their_ids(sp: object, cfg: OtelSourceConfig, reason: str) -> None:
    batch = decode_payload(proto_bytes(sp), cfg)  # type: ignore[arg-type]
    assert [r.reason for r in batch.rejected] == [reason], batch.rejected
    assert not batch.calls
    rejected = batch.rejected[0]
    if reason != "invalid_span":
        assert (rejected.trace_id, rejected.span_id) == (TRACE_ID, SPAN_ID)


def test_otlp_json_ids_are_read_as_hex_not_base64() -> None:
    raw = otlp_json_bytes(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT))
    call = decode_payload(raw, JSON_CFG).calls[0]
    assert (call.trace_id, call.span_id) == (TRACE_ID, SPAN_ID)
    # snake_case keys (protobuf's own JSON names) are read too
    data = json.loads(raw)
    sp = data["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    sp["trace_id"], sp["span_id"] = sp.pop("traceId"), sp.pop("spanId")
    assert decode_payload(json.dumps(data).encode(), JSON_CFG).calls[0].trace_id == TRACE_ID


def test_a_request_with_no_spans_is_nothing_not_an_error() -> None:
    batch = decode_payload(request().SerializeToString() or b"\x0a\x00", CFG)
    assert not batch.rejected and not batch.calls and batch.spans == 0


def test_corrupted_payloads_never_raise() -> None:
    """Every byte-level corruption of a valid payload is decoded or refused; none raises."""
    import random

    rng = random.Random(7)
    spans = [
        v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, structured=True),
        v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, span_id="00f067aa0ba902b9"),
    ]
    for payload, cfg in ((proto_bytes(*spans), CFG), (otlp_json_bytes(*spans), JSON_CFG)):
        for _ in range(400):
            data = bytearray(payload)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            batch = decode_payload(bytes(data), cfg)
            assert batch.spans >= 0 and all(r.reason for r in batch.rejected)
