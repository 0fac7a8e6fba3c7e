"""OTLP payloads for the OTel source's tests, built with the real ``opentelemetry-proto`` classes, and the
GenAI semantic conventions' own examples as fixtures.

Sources of the examples (copied as data):
- v1.41.1 ``docs/gen-ai/non-normative/examples-llm-calls.md``: "Simple chat completion", "Tool calls
  (functions)" spans 1 and 2, "System instructions along with chat history", "Chat completion with
  reasoning", "Chat completion with multiple choices", "Multimodal inputs example";
- v1.36.0 ``docs/gen-ai/gen-ai-events.md``: "Chat completion", "Tools" (span 2), "Chat completion with
  multiple choices" event bodies.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"  # the examples' trace and span ids
SPAN_ID = "00f067aa0ba902b7"
START_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z
END_NS = START_NS + 1_500_000_000

# --- v1.41.1 examples ----------------------------------------------------------------------------------

SIMPLE_ATTRS: dict[str, Any] = {
    "gen_ai.provider.name": "openai",
    "gen_ai.operation.name": "chat",
    "gen_ai.request.model": "gpt-4",
    "gen_ai.request.max_tokens": 200,
    "gen_ai.request.top_p": 1.0,
    "gen_ai.response.id": "chatcmpl-9J3uIL87gldCFtiIbyaOvTeYBRA3l",
    "gen_ai.response.model": "gpt-4-0613",
    "gen_ai.usage.output_tokens": 47,
    "gen_ai.usage.input_tokens": 52,
    "gen_ai.response.finish_reasons": ["stop"],
}
SIMPLE_INPUT = [
    {"role": "system", "parts": [{"type": "text", "content": "You are a helpful bot"}]},
    {"role": "user", "parts": [{"type": "text", "content": "Tell me a joke about OpenTelemetry"}]},
]
JOKE = " Why did the developer bring OpenTelemetry to the party? Because it always knows how to trace the fun!"
SIMPLE_OUTPUT = [{"role": "assistant", "parts": [{"type": "text", "content": JOKE}], "finish_reason": "stop"}]

TOOL_SPAN1_ATTRS = {
    **SIMPLE_ATTRS,
    "gen_ai.usage.output_tokens": 17,
    "gen_ai.usage.input_tokens": 47,
    "gen_ai.response.finish_reasons": ["tool_calls"],
}
TOOL_SPAN1_INPUT = [{"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]}]
TOOL_CALL_ID = "call_VSPygqKTWdrhaFErNvMV18Yl"
TOOL_SPAN1_OUTPUT = [
    {
        "role": "assistant",
        "parts": [{"type": "tool_call", "id": TOOL_CALL_ID, "name": "get_weather", "arguments": {"location": "Paris"}}],
        "finish_reason": "tool_call",
    }
]
TOOL_DEFINITIONS = [
    {
        "type": "function",
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
        },
    }
]
TOOL_SPAN2_ATTRS = {
    **SIMPLE_ATTRS,
    "gen_ai.response.id": "chatcmpl-call_VSPygqKTWdrhaFErNvMV18Yl",
    "gen_ai.usage.output_tokens": 52,
    "gen_ai.usage.input_tokens": 97,
}
TOOL_SPAN2_INPUT = [
    {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]},
    {
        "role": "assistant",
        "parts": [{"type": "tool_call", "id": TOOL_CALL_ID, "name": "get_weather", "arguments": {"location": "Paris"}}],
    },
    {"role": "tool", "parts": [{"type": "tool_call_response", "id": TOOL_CALL_ID, "response": "rainy, 57°F"}]},
]
TOOL_SPAN2_OUTPUT = [
    {
        "role": "assistant",
        "parts": [{"type": "text", "content": "The weather in Paris is currently rainy with a temperature of 57°F."}],
        "finish_reason": "stop",
    }
]
INSTRUCTIONS = [{"type": "text", "content": "You must never tell jokes"}]
INSTRUCTIONS_OUTPUT = [
    {
        "role": "assistant",
        "parts": [{"type": "text", "content": "I'm sorry, but I can't assist with that"}],
        "finish_reason": "stop",
    }
]
REASONING_OUTPUT = [
    {
        "role": "assistant",
        "parts": [
            {"type": "reasoning", "content": "Alright, the user wants a joke about OpenTelemetry…"},
            {"type": "text", "content": JOKE},
        ],
        "finish_reason": "stop",
    }
]
PROMOTED = " Why did OpenTelemetry get promoted? It had great span of control!"
CHOICES_OUTPUT = [
    SIMPLE_OUTPUT[0],
    {"role": "assistant", "parts": [{"type": "text", "content": PROMOTED}], "finish_reason": "stop"},
]
MULTIMODAL_INPUT = [
    {
        "role": "user",
        "parts": [
            {"type": "text", "content": "What is in the attached data?"},
            {"type": "uri", "modality": "image", "mime_type": "image/png", "uri": "https://example.com/logo.png"},
        ],
    }
]

# --- v1.36.0 event bodies ------------------------------------------------------------------------------

V136_ATTRS = {k: v for k, v in SIMPLE_ATTRS.items() if k not in ("gen_ai.provider.name",)} | {"gen_ai.system": "openai"}
V136_CHAT_EVENTS = [
    ("gen_ai.system.message", {"content": "You're a helpful bot"}),
    ("gen_ai.user.message", {"content": "Tell me a joke about OpenTelemetry"}),
    (
        "gen_ai.choice",
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {
                "content": "Why did the developer bring OpenTelemetry to the party? Because it always knows how to trace the fun!"
            },
        },
    ),
]
V136_TOOLS_SPAN2_EVENTS = [
    ("gen_ai.user.message", {"content": "What's the weather in Paris?"}),
    (
        "gen_ai.assistant.message",
        {
            "tool_calls": [
                {
                    "id": TOOL_CALL_ID,
                    "function": {"name": "get_weather", "arguments": '{"location":"Paris"}'},
                    "type": "function",
                }
            ]
        },
    ),
    ("gen_ai.tool.message", {"content": "rainy, 57°F", "id": TOOL_CALL_ID}),
    (
        "gen_ai.choice",
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"content": "The weather in Paris is rainy and overcast, with temperatures around 57°F"},
        },
    ),
]
V136_CHOICES_EVENTS = [
    V136_CHAT_EVENTS[0],
    V136_CHAT_EVENTS[1],
    ("gen_ai.choice", {"index": 1, "finish_reason": "stop", "message": {"content": PROMOTED.strip()}}),
    V136_CHAT_EVENTS[2],
]
V136_CONTENT_OFF_EVENTS = [("gen_ai.choice", {"index": 0, "finish_reason": "stop", "message": {}})]


# --- builders --------------------------------------------------------------------------------------------


def any_value(value: Any) -> AnyValue:
    """A Python value as an OTLP AnyValue (dicts become kvlists, lists arrays)."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    if isinstance(value, dict):
        return AnyValue(kvlist_value=KeyValueList(values=[kv(k, v) for k, v in value.items()]))
    raise TypeError(type(value))


def kv(key: str, value: Any) -> KeyValue:
    return KeyValue(key=key, value=any_value(value))


def event(name: str, attributes: dict[str, Any], time_ns: int = START_NS + 1) -> Span.Event:
    return Span.Event(name=name, time_unix_nano=time_ns, attributes=[kv(k, v) for k, v in attributes.items()])


def body_event(name: str, body: dict[str, Any]) -> Span.Event:
    """A 1.36 event as a span event: the body as the ``gen_ai.event.content`` JSON attribute."""
    return event(name, {"gen_ai.system": "openai", "gen_ai.event.content": json.dumps(body)})


def span(
    attributes: dict[str, Any],
    *,
    trace_id: str = TRACE_ID,
    span_id: str = SPAN_ID,
    parent_span_id: str = "",
    events: list[Span.Event] | None = None,
    links: list[tuple[str, str]] | None = None,
    name: str = "chat gpt-4",
    error: bool = False,
    start_ns: int = START_NS,
    end_ns: int = END_NS,
) -> Span:
    return Span(
        trace_id=bytes.fromhex(trace_id),
        span_id=bytes.fromhex(span_id),
        parent_span_id=bytes.fromhex(parent_span_id),
        name=name,
        kind=Span.SPAN_KIND_CLIENT,
        start_time_unix_nano=start_ns,
        end_time_unix_nano=end_ns,
        attributes=[kv(k, v) for k, v in attributes.items()],
        events=events or [],
        links=[Span.Link(trace_id=bytes.fromhex(t), span_id=bytes.fromhex(s)) for t, s in links or []],
        status=Status(code=Status.STATUS_CODE_ERROR if error else Status.STATUS_CODE_OK),
    )


def request(*spans: Span, resource: dict[str, Any] | None = None) -> ExportTraceServiceRequest:
    res = Resource(attributes=[kv(k, v) for k, v in (resource or {"service.name": "shop-assistant"}).items()])
    scope = InstrumentationScope(name="opentelemetry.instrumentation.openai_v2", version="2.3b0")
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=res, scope_spans=[ScopeSpans(scope=scope, spans=list(spans))])]
    )


def proto_bytes(*spans: Span, resource: dict[str, Any] | None = None) -> bytes:
    """What the Kafka exporter writes with ``encoding: otlp_proto``."""
    return request(*spans, resource=resource).SerializeToString()


def otlp_json_bytes(*spans: Span, resource: dict[str, Any] | None = None) -> bytes:
    """What the Kafka exporter writes with ``encoding: otlp_json``: OTLP/JSON (lowerCamelCase keys, hex ids,
    integer enums, 64-bit integers as strings)."""
    data = json_format.MessageToDict(request(*spans, resource=resource), use_integers_for_enums=True)
    for rs in data.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in sp:
                        sp[key] = _b64_to_hex(sp[key])
                for link in sp.get("links", []):
                    for key in ("traceId", "spanId"):
                        link[key] = _b64_to_hex(link[key])
    return json.dumps(data).encode()


def _b64_to_hex(text: str) -> str:
    import base64

    return base64.b64decode(text).hex()


def v137_span(
    input_messages: Any = None,
    output_messages: Any = None,
    *,
    attrs: dict[str, Any] | None = None,
    instructions: Any = None,
    tools: Any = None,
    structured: bool = False,
    **kwargs: Any,
) -> Span:
    """A span with content on attributes (>= 1.37): JSON strings, or structured values when ``structured``."""
    encode = (lambda v: v) if structured else json.dumps
    values = dict(attrs if attrs is not None else SIMPLE_ATTRS)
    for key, value in (
        ("gen_ai.input.messages", input_messages),
        ("gen_ai.output.messages", output_messages),
        ("gen_ai.system_instructions", instructions),
        ("gen_ai.tool.definitions", tools),
    ):
        if value is not None:
            values[key] = encode(value)
    return span(values, **kwargs)
