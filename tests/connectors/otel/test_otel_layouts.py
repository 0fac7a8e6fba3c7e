"""Each GenAI content layout, read from the semantic conventions' own examples, gives the same OpenAI-shaped
call; spans that are not GenAI inference are skipped and counted; GenAI spans without content are refused
as ``no_content``."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from connectors.otel import GenAICall, OtelSourceConfig, decode_payload
from tests.connectors.otel.otel_fixtures import (
    CHOICES_OUTPUT,
    END_NS,
    INSTRUCTIONS,
    INSTRUCTIONS_OUTPUT,
    JOKE,
    REASONING_OUTPUT,
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
    V136_ATTRS,
    V136_CHAT_EVENTS,
    V136_CHOICES_EVENTS,
    V136_CONTENT_OFF_EVENTS,
    V136_TOOLS_SPAN2_EVENTS,
    body_event,
    event,
    proto_bytes,
    span,
    v137_span,
)

CFG = OtelSourceConfig()
JOKE_MESSAGES = [
    {"role": "system", "content": "You are a helpful bot"},
    {"role": "user", "content": "Tell me a joke about OpenTelemetry"},
]


def only_call(payload: bytes, cfg: OtelSourceConfig = CFG) -> GenAICall:
    batch = decode_payload(payload, cfg)
    assert not batch.rejected, batch.rejected
    assert len(batch.calls) == 1, batch
    return batch.calls[0]


def only_rejection(payload: bytes, cfg: OtelSourceConfig = CFG) -> tuple[str, str]:
    batch = decode_payload(payload, cfg)
    assert not batch.calls, batch.calls
    assert len(batch.rejected) == 1, batch.rejected
    return batch.rejected[0].reason, batch.rejected[0].detail


# --- semconv >= 1.37: content on span attributes -------------------------------------------------------------


@pytest.mark.parametrize("structured", [False, True], ids=["json-string", "structured"])
def test_simple_chat_completion_example(structured: bool) -> None:
    call = only_call(proto_bytes(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, structured=structured)))
    assert (call.trace_id, call.span_id, call.layout) == (TRACE_ID, SPAN_ID, "semconv-1.37")
    assert list(call.input_messages) == JOKE_MESSAGES
    assert (call.output_text, call.output_tool_calls, call.finish_reason) == (JOKE, (), "stop")
    assert (call.request_model, call.response_model, call.provider) == ("gpt-4", "gpt-4-0613", "openai")
    assert (call.input_tokens, call.output_tokens, call.operation) == (52, 47, "chat")
    assert call.response_id == "chatcmpl-9J3uIL87gldCFtiIbyaOvTeYBRA3l"
    assert call.end == datetime(2026, 1, 1, 0, 0, 1, 500000, tzinfo=UTC) and call.end.tzinfo is UTC
    assert call.start == datetime(2026, 1, 1, tzinfo=UTC)
    assert call.service_name == "shop-assistant"


def test_tool_call_examples_span_1_and_2() -> None:
    first = only_call(
        proto_bytes(v137_span(TOOL_SPAN1_INPUT, TOOL_SPAN1_OUTPUT, attrs=TOOL_SPAN1_ATTRS, tools=TOOL_DEFINITIONS))
    )
    assert first.output_text == "" and first.finish_reason == "tool_calls"  # semconv "tool_call" in OpenAI's words
    assert first.output_tool_calls == (
        {
            "id": TOOL_CALL_ID,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
        },
    )
    assert first.tools == (
        {
            "type": "function",
            "function": {
                "name": "get_current_weather",
                "description": "Get the current weather in a given location",
                "parameters": TOOL_DEFINITIONS[0]["parameters"],
            },
        },
    )
    second = only_call(proto_bytes(v137_span(TOOL_SPAN2_INPUT, TOOL_SPAN2_OUTPUT, attrs=TOOL_SPAN2_ATTRS)))
    assert list(second.input_messages) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": list(first.output_tool_calls)},
        {"role": "tool", "content": "rainy, 57°F", "tool_call_id": TOOL_CALL_ID},
    ]
    assert second.output_text.startswith("The weather in Paris is currently rainy")


def test_system_instructions_reasoning_and_multiple_choices_examples() -> None:
    call = only_call(proto_bytes(v137_span(SIMPLE_INPUT, INSTRUCTIONS_OUTPUT, instructions=INSTRUCTIONS)))
    assert call.system_instructions == "You must never tell jokes"
    assert list(call.input_messages) == JOKE_MESSAGES  # the instructions are kept apart, not in the history
    reasoning = only_call(proto_bytes(v137_span(SIMPLE_INPUT, REASONING_OUTPUT)))
    assert reasoning.output_text == JOKE  # the reasoning part is not the answer
    choices = only_call(proto_bytes(v137_span(SIMPLE_INPUT, CHOICES_OUTPUT)))
    assert choices.output_text == JOKE  # the first choice only, as the gateway traces index 0


def test_content_on_the_operation_details_event() -> None:
    details = event(
        "gen_ai.client.inference.operation.details",
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.input.messages": SIMPLE_INPUT,
            "gen_ai.output.messages": SIMPLE_OUTPUT,
        },
    )
    call = only_call(proto_bytes(span(SIMPLE_ATTRS, events=[details])))
    assert list(call.input_messages) == JOKE_MESSAGES and call.output_text == JOKE


def test_content_capture_off_is_no_content_and_other_spans_of_the_payload_still_count() -> None:
    off = span(SIMPLE_ATTRS, span_id="00f067aa0ba902b8")  # the example "when content capturing is disabled"
    batch = decode_payload(proto_bytes(off, v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT)), CFG)
    assert [r.reason for r in batch.rejected] == ["no_content"]
    assert batch.rejected[0].span_id == "00f067aa0ba902b8" and batch.rejected[0].trace_id == TRACE_ID
    assert len(batch.calls) == 1 and batch.calls[0].span_id == SPAN_ID


def test_input_without_answer_and_answer_without_input() -> None:
    assert only_rejection(proto_bytes(v137_span(SIMPLE_INPUT, None)))[0] == "no_completion"
    assert only_rejection(proto_bytes(v137_span(None, SIMPLE_OUTPUT)))[0] == "no_prompt"


# --- semconv 1.36: span events ---------------------------------------------------------------------------------


def test_v136_chat_completion_events() -> None:
    call = only_call(proto_bytes(span(V136_ATTRS, events=[body_event(n, b) for n, b in V136_CHAT_EVENTS])))
    assert call.layout == "semconv-1.36" and call.provider == "openai"
    assert list(call.input_messages) == [
        {"role": "system", "content": "You're a helpful bot"},
        {"role": "user", "content": "Tell me a joke about OpenTelemetry"},
    ]
    assert call.output_text == JOKE.strip() and call.finish_reason == "stop"


def test_v136_tools_events_and_body_fields_as_attributes() -> None:
    # The same events once with the body as gen_ai.event.content JSON, once with its fields as attributes.
    as_json = [body_event(n, b) for n, b in V136_TOOLS_SPAN2_EVENTS]
    as_fields = [
        event(n, {k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in b.items()})
        for n, b in V136_TOOLS_SPAN2_EVENTS
    ]
    calls = [only_call(proto_bytes(span(V136_ATTRS, events=evs))) for evs in (as_json, as_fields)]
    assert calls[0] == calls[1]
    assert list(calls[0].input_messages) == [
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": TOOL_CALL_ID,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "rainy, 57°F", "tool_call_id": TOOL_CALL_ID},
    ]


def test_v136_multiple_choices_take_index_0_and_content_off_is_no_content() -> None:
    call = only_call(proto_bytes(span(V136_ATTRS, events=[body_event(n, b) for n, b in V136_CHOICES_EVENTS])))
    assert call.output_text == JOKE.strip()
    off = span(V136_ATTRS, events=[body_event(n, b) for n, b in V136_CONTENT_OFF_EVENTS])
    assert only_rejection(proto_bytes(off))[0] == "no_content"


# --- semconv 1.27 events and OpenLLMetry attributes -------------------------------------------------------------


def test_v127_prompt_and_completion_events() -> None:
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    completion = [{"role": "assistant", "content": "The capital of France is Paris."}]
    events = [
        event("gen_ai.content.prompt", {"gen_ai.prompt": json.dumps(prompt)}),
        event("gen_ai.content.completion", {"gen_ai.completion": json.dumps(completion)}),
    ]
    call = only_call(proto_bytes(span(V136_ATTRS, events=events)))
    assert call.layout == "semconv-1.27"
    assert list(call.input_messages) == prompt and call.output_text == "The capital of France is Paris."


def test_openllmetry_indexed_attributes_with_tools_and_no_operation_name() -> None:
    attrs = {
        "llm.request.type": "chat",
        "gen_ai.system": "openai",
        "gen_ai.request.model": "gpt-4o",
        "gen_ai.usage.prompt_tokens": 30,
        "gen_ai.usage.completion_tokens": 9,
        "gen_ai.prompt.0.role": "user",
        "gen_ai.prompt.0.content": "Weather in Paris?",
        "gen_ai.prompt.1.role": "assistant",
        "gen_ai.prompt.1.tool_calls.0.id": TOOL_CALL_ID,
        "gen_ai.prompt.1.tool_calls.0.name": "get_weather",
        "gen_ai.prompt.1.tool_calls.0.arguments": '{"location": "Paris"}',
        "gen_ai.prompt.2.role": "tool",
        "gen_ai.prompt.2.content": "rainy, 57°F",
        "gen_ai.prompt.2.tool_call_id": TOOL_CALL_ID,
        "gen_ai.completion.0.role": "assistant",
        "gen_ai.completion.0.content": "Rainy, 57°F.",
        "gen_ai.completion.0.finish_reason": "stop",
        "llm.request.functions.0.name": "get_weather",
        "llm.request.functions.0.parameters": json.dumps({"type": "object", "properties": {}}),
    }
    call = only_call(proto_bytes(span(attrs)))
    assert call.layout == "openllmetry" and call.operation == "chat"
    assert [m["role"] for m in call.input_messages] == ["user", "assistant", "tool"]
    assert call.input_messages[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"location": "Paris"}',
    }
    assert call.input_messages[2]["tool_call_id"] == TOOL_CALL_ID
    assert (call.output_text, call.finish_reason, call.input_tokens, call.output_tokens) == (
        "Rainy, 57°F.",
        "stop",
        30,
        9,
    )
    assert call.tools == (
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}},
    )


def test_openllmetry_text_completion() -> None:
    attrs = {
        "llm.request.type": "completion",
        "gen_ai.request.model": "davinci-002",
        "gen_ai.prompt.0.user": "Tell me a joke about opentelemetry",
        "gen_ai.completion.0.content": "Trace it.",
    }
    call = only_call(proto_bytes(span(attrs)))
    assert call.operation == "text_completion"
    assert list(call.input_messages) == [{"role": "user", "content": "Tell me a joke about opentelemetry"}]


# --- what is skipped ------------------------------------------------------------------------------------------------


def test_spans_that_are_not_genai_inference_are_skipped_and_counted_by_reason() -> None:
    spans = [
        span({"http.request.method": "GET"}, span_id="0000000000000001", name="GET /"),
        span({"gen_ai.operation.name": "embeddings", "gen_ai.request.model": "e"}, span_id="0000000000000002"),
        span({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather"}, span_id="0000000000000003"),
        v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, span_id="0000000000000004", error=True),
        span({}, span_id="0000000000000005"),
        v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, end_ns=END_NS),
    ]
    batch = decode_payload(proto_bytes(*spans), CFG)
    assert dict(batch.skipped) == {"not_genai": 2, "not_inference": 2, "failed_call": 1}
    assert batch.spans == 6 and len(batch.calls) == 1 and not batch.rejected


# --- the user id and token ids ------------------------------------------------------------------------------------


def test_user_id_comes_from_the_configured_attribute_on_the_span_then_the_resource() -> None:
    on_span = v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs={**SIMPLE_ATTRS, "enduser.id": "alice"})
    assert only_call(proto_bytes(on_span)).user_id == "alice"
    plain = v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT)
    assert only_call(proto_bytes(plain, resource={"user.id": 42})).user_id == "42"
    custom = OtelSourceConfig(user_id_attributes=["app.customer"])
    assert only_call(proto_bytes(on_span), custom).user_id is None
    tagged = v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs={**SIMPLE_ATTRS, "app.customer": "c-7"})
    assert only_call(proto_bytes(tagged), custom).user_id == "c-7"


def test_token_ids_where_the_span_records_them() -> None:
    attrs = {**SIMPLE_ATTRS, "hourglass.prompt_token_ids": [1, 2, 3], "hourglass.completion_token_ids": [7, 8]}
    call = only_call(proto_bytes(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs=attrs)))
    assert (call.prompt_token_ids, call.completion_token_ids) == ((1, 2, 3), (7, 8))
    assert only_call(proto_bytes(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT))).completion_token_ids is None
    bad = {**SIMPLE_ATTRS, "hourglass.completion_token_ids": [1, 2**40]}
    assert only_rejection(proto_bytes(v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs=bad)))[0] == "invalid_content"


def test_every_setting_is_documented() -> None:
    from connectors.otel import OtelFeedbackRule

    for model in (OtelSourceConfig, OtelFeedbackRule):
        undocumented = [name for name, f in model.model_fields.items() if not (f.description or "").strip()]
        assert not undocumented, f"{model.__name__}: {undocumented}"


def test_openllmetry_list_content_recorded_as_json_text() -> None:
    parts = [{"type": "text", "text": "Describe"}, {"type": "text", "text": "this"}]
    attrs = {
        "llm.request.type": "chat",
        "gen_ai.request.model": "gpt-4o",
        "gen_ai.prompt.0.role": "user",
        "gen_ai.prompt.0.content": json.dumps(parts),
        "gen_ai.completion.0.content": "ok",
    }
    assert only_call(proto_bytes(span(attrs))).input_messages[0]["content"] == "Describe\nthis"
    image = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    assert (
        only_rejection(proto_bytes(span({**attrs, "gen_ai.prompt.0.content": json.dumps(image)})))[0]
        == "unsupported_content"
    )
