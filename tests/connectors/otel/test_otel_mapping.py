"""GenAI calls -> hourglass.trace/v2 dicts that the real parser accepts (user id hashed, derived trace id
stable across redelivery), and the conversation/tool fields the schema is about to gain."""

from __future__ import annotations

import json

from connectors.otel import (
    OtelSourceConfig,
    conversation_fields,
    decode_payload,
    derived_trace_id,
    native_events,
    trace_event,
)
from connectors.otel.mapping import CONVERSATION_FIELDS
from connectors.otel.types import GenAICall
from connectors.schema import Rejected, TraceEvent, UserHasher, parse_record
from tests.connectors.otel.otel_fixtures import (
    INSTRUCTIONS,
    INSTRUCTIONS_OUTPUT,
    SIMPLE_ATTRS,
    SIMPLE_INPUT,
    SIMPLE_OUTPUT,
    SPAN_ID,
    TOOL_CALL_ID,
    TOOL_DEFINITIONS,
    TOOL_SPAN1_ATTRS,
    TOOL_SPAN1_INPUT,
    TOOL_SPAN1_OUTPUT,
    TOOL_SPAN2_ATTRS,
    TOOL_SPAN2_INPUT,
    TOOL_SPAN2_OUTPUT,
    TRACE_ID,
    proto_bytes,
    span,
    v137_span,
)

CFG = OtelSourceConfig()
HASHER = UserHasher("k" * 32, ["user", "user_id"])


def call_of(sp: object, cfg: OtelSourceConfig = CFG) -> GenAICall:
    batch = decode_payload(proto_bytes(sp), cfg)  # type: ignore[arg-type]
    assert len(batch.calls) == 1, batch
    return batch.calls[0]


def ingest(event: dict) -> TraceEvent:
    """What the ingest parser makes of the dict (the same path as a native record)."""
    parsed = parse_record(json.dumps(event).encode(), max_record_bytes=1 << 20, hasher=HASHER)
    assert isinstance(parsed, TraceEvent), parsed
    return parsed


def test_trace_event_is_a_valid_native_trace_with_the_user_hashed() -> None:
    sp = v137_span(
        SIMPLE_INPUT,
        SIMPLE_OUTPUT,
        attrs={**SIMPLE_ATTRS, "user.id": "alice@example.com", "gen_ai.conversation.id": "conv_1"},
    )
    event = trace_event(call_of(sp), CFG)
    assert isinstance(event, dict)
    assert event["trace_id"] == f"otel-{TRACE_ID}-{SPAN_ID}" == derived_trace_id(TRACE_ID.upper(), SPAN_ID)
    assert (event["schema"], event["model"], event["adapter_version"], event["ts"]) == (
        "hourglass.trace/v2",
        "gpt-4",
        None,
        "2026-01-01T00:00:01.500000Z",
    )
    assert event["metadata"]["user"] == "alice@example.com"
    assert event["metadata"]["usage"] == {"prompt_tokens": 52, "completion_tokens": 47}
    assert event["metadata"]["otel"]["conversation_id"] == "conv_1"
    assert event["metadata"]["otel"]["response_model"] == "gpt-4-0613"
    stored = ingest(event)
    assert stored.metadata["user"].startswith("hmac-sha256:") and "alice" not in json.dumps(stored.metadata)
    assert stored.messages() == [
        {"role": "system", "content": "You are a helpful bot"},
        {"role": "user", "content": "Tell me a joke about OpenTelemetry"},
    ]
    assert stored.completion == SIMPLE_OUTPUT[0]["parts"][0]["content"]
    # the conversation fields of hourglass.trace/v2, from the span
    assert (stored.conversation_id, stored.turn, stored.parent_trace_id) == ("conv_1", 0, None)
    assert stored.usage is not None and (stored.usage.prompt_tokens, stored.usage.completion_tokens) == (52, 47)


def test_redelivery_gives_the_same_trace_id_and_event() -> None:
    payload = proto_bytes(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT))
    assert native_events(payload, CFG).events == native_events(payload, CFG).events
    other = proto_bytes(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, span_id="00f067aa0ba902b8"))
    assert native_events(other, CFG).events[0]["trace_id"] != native_events(payload, CFG).events[0]["trace_id"]


def test_tool_call_trace_round_trips_through_the_parser() -> None:
    event = trace_event(call_of(v137_span(TOOL_SPAN2_INPUT, TOOL_SPAN2_OUTPUT, attrs=TOOL_SPAN2_ATTRS)), CFG)
    assert isinstance(event, dict)
    stored = ingest(event)
    messages = stored.messages()
    assert messages[1]["tool_calls"][0]["id"] == TOOL_CALL_ID and messages[1].get("content") is None
    assert messages[2] == {"role": "tool", "content": "rainy, 57°F", "tool_call_id": TOOL_CALL_ID}
    # a call that only calls tools: empty completion text, the calls in conversation_fields
    only_calls = trace_event(call_of(v137_span(TOOL_SPAN1_INPUT, TOOL_SPAN1_OUTPUT, attrs=TOOL_SPAN1_ATTRS)), CFG)
    assert isinstance(only_calls, dict) and ingest(only_calls).completion == ""
    stored_calls = ingest(only_calls)
    assert stored_calls.finish_reason == "tool_calls" and stored_calls.completion_tool_calls
    assert stored_calls.completion_tool_calls[0].function.name == "get_weather"


def test_system_instructions_lead_the_prompt_and_text_completions_are_text() -> None:
    event = trace_event(call_of(v137_span(SIMPLE_INPUT, INSTRUCTIONS_OUTPUT, instructions=INSTRUCTIONS)), CFG)
    assert isinstance(event, dict)
    assert event["prompt"][0] == {"role": "system", "content": "You must never tell jokes"}
    assert len(event["prompt"]) == 3
    text = {**SIMPLE_ATTRS, "gen_ai.operation.name": "text_completion"}
    user_only = [{"role": "user", "parts": [{"type": "text", "content": "Once upon a time"}]}]
    completion = trace_event(call_of(v137_span(user_only, SIMPLE_OUTPUT, attrs=text)), CFG)
    assert isinstance(completion, dict) and completion["prompt"] == "Once upon a time"
    assert ingest(completion).messages() == [{"role": "user", "content": "Once upon a time"}]


def test_model_name_setting_and_no_model() -> None:
    call = call_of(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT))
    renamed = trace_event(call, OtelSourceConfig(model_name="hourglass"))
    assert isinstance(renamed, dict) and renamed["model"] == "hourglass"
    assert renamed["metadata"]["otel"]["request_model"] == "gpt-4"
    nameless = {k: v for k, v in SIMPLE_ATTRS.items() if k not in ("gen_ai.request.model", "gen_ai.response.model")}
    refused = trace_event(call_of(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs=nameless)), CFG)
    assert isinstance(refused, Rejected) and refused.reason == "no_model"
    assert [
        r.reason
        for r in native_events(proto_bytes(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs=nameless)), CFG).rejected
    ] == ["no_model"]


def test_conversation_fields_of_a_tool_call_span() -> None:
    attrs = {
        **TOOL_SPAN1_ATTRS,
        "gen_ai.conversation.id": "conv_5j66UpCpwteGg4YSxUnt7lPY",
        "hourglass.prompt_token_ids": [1, 2],
        "hourglass.completion_token_ids": [3],
    }
    call = call_of(v137_span(TOOL_SPAN1_INPUT, TOOL_SPAN1_OUTPUT, attrs=attrs, tools=TOOL_DEFINITIONS))
    fields = conversation_fields(call)
    assert tuple(fields) == CONVERSATION_FIELDS
    assert fields["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_current_weather",
                "description": "Get the current weather in a given location",
                "parameters": TOOL_DEFINITIONS[0]["parameters"],
            },
        }
    ]
    assert fields["completion_tool_calls"] == [
        {
            "id": TOOL_CALL_ID,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
        }
    ]
    assert (fields["finish_reason"], fields["conversation_id"], fields["turn"]) == (
        "tool_calls",
        "conv_5j66UpCpwteGg4YSxUnt7lPY",
        0,
    )
    assert (fields["prompt_token_ids"], fields["completion_token_ids"]) == ([1, 2], [3])
    assert fields["usage"] == {"prompt_tokens": 47, "completion_tokens": 17}
    json.dumps(fields)  # plain JSON data


def test_conversation_fields_turn_counts_earlier_answers_and_absent_fields_are_none() -> None:
    second = conversation_fields(call_of(v137_span(TOOL_SPAN2_INPUT, TOOL_SPAN2_OUTPUT, attrs=TOOL_SPAN2_ATTRS)))
    assert second["turn"] == 1 and second["completion_tool_calls"] is None and second["tools"] is None
    bare = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"}
    fields = conversation_fields(
        call_of(
            span(
                {
                    **bare,
                    "gen_ai.input.messages": json.dumps(SIMPLE_INPUT),
                    "gen_ai.output.messages": json.dumps(SIMPLE_OUTPUT),
                }
            )
        )
    )
    assert fields["usage"] is None and fields["conversation_id"] is None and fields["finish_reason"] == "stop"
    assert fields["prompt_token_ids"] is None and fields["completion_token_ids"] is None


def test_the_events_go_through_the_ingest_batch_parser_as_native_records() -> None:
    """The proposed ingest hook: each mapped event re-enters parse_batch as a record of the OTel topic, so the
    window, hashing, storage rows and dead letters are the native ones."""
    from dataclasses import dataclass
    from datetime import UTC, datetime, timedelta

    from connectors.fast_parse import parse_batch
    from connectors.schema import TsWindow

    @dataclass
    class Record:
        topic: str
        partition: int
        offset: int
        key: bytes | None
        value: bytes | None

    spans = [
        v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs={**SIMPLE_ATTRS, "user.id": "alice"}),
        v137_span(TOOL_SPAN2_INPUT, TOOL_SPAN2_OUTPUT, attrs=TOOL_SPAN2_ATTRS, span_id="00f067aa0ba902b8"),
    ]
    out = native_events(proto_bytes(*spans), CFG)
    records = [Record("otlp_spans", 0, 7, e["trace_id"].encode(), json.dumps(e).encode()) for e in out.events]
    now = datetime(2026, 1, 1, 0, 5, tzinfo=UTC)
    batch = parse_batch(records, max_record_bytes=1 << 20, hasher=HASHER, window=TsWindow.around(now, 3600, 300))
    assert not batch.dead_letters and len(batch.traces) == 2
    table, _ = batch.tables(now)
    assert sorted(table.column("trace_id").to_pylist()) == sorted(e["trace_id"] for e in out.events)
    late = parse_batch(
        records, max_record_bytes=1 << 20, hasher=HASHER, window=TsWindow.around(now + timedelta(days=30), 3600, 300)
    )
    assert [d.reason for d in late.dead_letters] == ["ts_out_of_range"] * 2


def test_user_hash_is_the_keyed_identity_rounds_cap_and_votes_count_by() -> None:
    from connectors.otel.mapping import user_identity

    alice = call_of(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs={**SIMPLE_ATTRS, "user.id": "alice"}))
    nobody = call_of(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT))
    with_hash = trace_event(alice, CFG, HASHER.digest)
    assert isinstance(with_hash, dict)
    assert with_hash["metadata"]["user_hash"] == HASHER.digest("otel\x00alice") == HASHER.digest(user_identity("alice"))
    anonymous = trace_event(nobody, CFG, HASHER.digest)
    assert isinstance(anonymous, dict) and anonymous["metadata"]["user_hash"] == HASHER.digest("otel")
    plain = trace_event(alice, CFG)
    assert isinstance(plain, dict) and "user_hash" not in plain["metadata"]
    stored = ingest(with_hash)
    assert stored.metadata["user_hash"] == with_hash["metadata"]["user_hash"]  # not a user id key: kept as sent
