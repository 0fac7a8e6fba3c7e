"""One OTLP span -> a :class:`~connectors.otel.types.GenAICall`, a :class:`Skipped` or a :class:`Rejected`.

A span is a GenAI inference call when ``gen_ai.operation.name`` is ``chat`` or ``text_completion`` (or,
on OpenLLMetry spans that predate that attribute, ``llm.request.type`` is ``chat`` / ``completion``).
Its content is read from the first of these layouts that is present:

1. ``semconv-1.37`` (semantic conventions 1.37 to 1.41, opted in by
   ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental``): the attributes ``gen_ai.input.messages``,
   ``gen_ai.output.messages``, ``gen_ai.system_instructions`` (JSON strings or structured values) on the
   span, else on its ``gen_ai.client.inference.operation.details`` span event;
2. ``semconv-1.36`` (1.28 to 1.36): span events ``gen_ai.system.message``, ``gen_ai.user.message``,
   ``gen_ai.assistant.message``, ``gen_ai.tool.message`` and ``gen_ai.choice``, whose body is the JSON
   attribute ``gen_ai.event.content`` (as the Azure AI and Semantic Kernel instrumentations record it) or
   the body's fields as attributes (``content``, ``role``, ``tool_calls``, ``id``, ``index``,
   ``finish_reason``, ``message``);
3. ``semconv-1.27``: span events ``gen_ai.content.prompt`` / ``gen_ai.content.completion`` with the JSON
   attributes ``gen_ai.prompt`` / ``gen_ai.completion`` (OpenAI-shaped messages);
4. ``openllmetry`` (Traceloop's instrumentations): attributes ``gen_ai.prompt.{i}.{role,content,
   tool_call_id,user}``, ``gen_ai.prompt.{i}.tool_calls.{j}.{id,name,arguments}``,
   ``gen_ai.completion.{i}.{role,content,finish_reason}`` and ``...tool_calls.{j}...``, tools in
   ``llm.request.functions.{i}.{name,description,parameters}``.

Semantic conventions read: open-telemetry/semantic-conventions v1.36.0 (``docs/gen-ai/gen-ai-events.md``,
``gen-ai-spans.md``) and v1.41.1 (``gen-ai-spans.md``, ``gen-ai-events.md``,
``non-normative/examples-llm-calls.md`` and the JSON schemas of input/output messages, system
instructions and tool definitions); v1.42 moved the GenAI conventions to their own repository.
Content recorded as OTel *log* events (the 1.36 events emitted through the Logs API) travels on the
Collector's logs pipeline, not in these payloads, and is not read here.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from connectors.otel import messages as msg
from connectors.otel.config import OtelSourceConfig
from connectors.otel.types import (
    FAILED_CALL,
    INVALID_CONTENT,
    INVALID_SPAN,
    NO_COMPLETION,
    NO_CONTENT,
    NO_PROMPT,
    NOT_GENAI,
    NOT_INFERENCE,
    OVERSIZE_ATTRIBUTE,
    TOO_MANY_MESSAGES,
    GenAICall,
    Rejected,
    Skipped,
)
from connectors.otel.wire import Attrs, Refused, json_text, kind_of

INFERENCE_OPERATIONS = frozenset({"chat", "text_completion"})
_OPENLLMETRY_TYPES = {"chat": "chat", "completion": "text_completion"}  # llm.request.type -> operation
DETAILS_EVENT = "gen_ai.client.inference.operation.details"
_V136_EVENTS = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
_CHOICE_EVENT = "gen_ai.choice"
_BODY_FIELDS = ("content", "role", "tool_calls", "id", "index", "finish_reason", "message")
_INDEXED = re.compile(r"gen_ai\.(prompt|completion)\.(\d{1,6})\.(.+)")
_FUNCTION = re.compile(r"llm\.request\.functions\.(\d{1,6})\.(name|description|parameters)")
_TOOL_CALL = re.compile(r"tool_calls\.(\d{1,6})\.(id|name|arguments)")
_INT32 = (-(2**31), 2**31 - 1)


def operation_of(attrs: Attrs) -> str | None:
    """The span's GenAI operation (``chat``, ``text_completion``, ``embeddings``...); None when not GenAI."""
    op = attrs.text("gen_ai.operation.name")
    if op is not None:
        return op
    legacy = attrs.text("llm.request.type")
    return None if legacy is None else _OPENLLMETRY_TYPES.get(legacy, legacy)


def read_call(
    span: Span, attrs: Attrs, resource: Attrs, cfg: OtelSourceConfig, service: str | None, scope: str | None
) -> GenAICall | Skipped | Rejected:
    """The GenAI inference call of one span (see module doc); never raises on bad input."""
    trace_id, span_id = span.trace_id.hex(), span.span_id.hex()
    try:
        op = operation_of(attrs)
    except Refused as err:
        return Rejected(err.reason, err.detail, trace_id, span_id)
    if op is None:
        return Skipped(NOT_GENAI, trace_id, span_id)
    if op not in INFERENCE_OPERATIONS:
        return Skipped(NOT_INFERENCE, trace_id, span_id)
    if span.status.code == Status.STATUS_CODE_ERROR:
        return Skipped(FAILED_CALL, trace_id, span_id)
    try:
        return _call(span, op, attrs, resource, cfg, service, scope)
    except Refused as err:
        return Rejected(err.reason, err.detail, trace_id, span_id)


def span_ids(span: Span) -> tuple[str, str]:
    """(trace id, span id) as hex.

    Raises:
        Refused: ``invalid_span`` when they are not 16 / 8 bytes or all zeros (W3C trace context).
    """
    if len(span.trace_id) != 16 or not any(span.trace_id) or len(span.span_id) != 8 or not any(span.span_id):
        raise Refused(
            INVALID_SPAN,
            f"span {span.name[:80]!r} has trace id {span.trace_id.hex()!r} / span id {span.span_id.hex()!r}; "
            "expected 16 / 8 bytes, not all zero",
        )
    return span.trace_id.hex(), span.span_id.hex()


def utc(unix_nano: int, what: str) -> datetime:
    """An OTLP ``*_unix_nano`` time as an aware UTC datetime.

    Raises:
        Refused: ``invalid_span`` (0, or past the datetime range).
    """
    if unix_nano <= 0:
        raise Refused(INVALID_SPAN, f"{what} is not set")
    try:
        return datetime.fromtimestamp(unix_nano / 1e9, tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise Refused(INVALID_SPAN, f"{what} {unix_nano} ns is outside the supported date range") from None


def _call(
    span: Span, op: str, attrs: Attrs, resource: Attrs, cfg: OtelSourceConfig, service: str | None, scope: str | None
) -> GenAICall:
    trace_id, span_id = span_ids(span)
    end = utc(span.end_time_unix_nano or span.start_time_unix_nano, "span end time")
    start = utc(span.start_time_unix_nano, "span start time") if span.start_time_unix_nano else end
    if len(span.events) > cfg.max_events_per_span:
        raise Refused(
            TOO_MANY_MESSAGES,
            f"span has {len(span.events)} events, above otel.max_events_per_span={cfg.max_events_per_span}",
        )
    content = _content(span, attrs, cfg)
    if content is None:
        raise Refused(NO_CONTENT, "GenAI span without recorded messages or answer (is content capture on?)")
    layout, messages, instructions, answer, tools = content
    if not messages and not instructions and (answer is None or answer.empty):
        raise Refused(NO_CONTENT, f"GenAI span ({layout}) without recorded messages or answer (is content capture on?)")
    if not messages and not instructions:
        raise Refused(NO_PROMPT, f"GenAI span ({layout}) has an answer but no input messages")
    if answer is None or answer.empty:
        raise Refused(NO_COMPLETION, f"GenAI span ({layout}) has input messages but no answer (no text, no tool call)")
    if not tools:
        tools = _span_tools(attrs, cfg)
    finish = answer.finish_reason or _first_finish_reason(attrs)
    return GenAICall(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=span.parent_span_id.hex() or None,
        start=start,
        end=end,
        operation=op,
        request_model=attrs.text("gen_ai.request.model"),
        response_model=attrs.text("gen_ai.response.model"),
        provider=attrs.text("gen_ai.provider.name") or attrs.text("gen_ai.system"),
        input_messages=tuple(messages),
        system_instructions=instructions,
        tools=tools,
        output_text=answer.text,
        output_tool_calls=answer.tool_calls,
        finish_reason=finish,
        input_tokens=_first_int(attrs, "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"),
        output_tokens=_first_int(attrs, "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"),
        conversation_id=attrs.text("gen_ai.conversation.id"),
        response_id=attrs.text("gen_ai.response.id"),
        user_id=user_id(cfg, attrs, resource),
        prompt_token_ids=_token_ids(attrs, cfg.prompt_token_ids_attribute, cfg),
        completion_token_ids=_token_ids(attrs, cfg.completion_token_ids_attribute, cfg),
        layout=layout,
        service_name=service,
        scope_name=scope,
    )


def user_id(cfg: OtelSourceConfig, *attr_sets: Attrs) -> str | None:
    """The first of ``cfg.user_id_attributes`` found, looked up in each attribute set in turn."""
    for attrs in attr_sets:
        for name in cfg.user_id_attributes:
            value = attrs.text(name)
            if value is not None:
                return value
    return None


_Content = tuple[str, list[dict[str, Any]], str | None, msg.Answer | None, tuple[dict[str, Any], ...]]


def _content(span: Span, attrs: Attrs, cfg: OtelSourceConfig) -> _Content | None:
    """(layout, input messages, system instructions, answer, tools) of the first layout present."""
    events = [(event.name, event) for event in span.events]
    details = next((e for name, e in events if name == DETAILS_EVENT), None)
    for source, where in (
        (attrs, "span"),
        (_event_attrs(details, cfg) if details is not None else None, DETAILS_EVENT),
    ):
        if source is not None and any(
            k in source for k in ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions")
        ):
            return _v137(source, cfg, where)
    if any(name in _V136_EVENTS or name == _CHOICE_EVENT for name, _ in events):
        return _v136(events, cfg)
    if any(name in ("gen_ai.content.prompt", "gen_ai.content.completion") for name, _ in events):
        return _v127(events, cfg)
    if any(key.startswith(("gen_ai.prompt.", "gen_ai.completion.")) for key in attrs.keys()):
        return _openllmetry(attrs, cfg)
    return None


def _event_attrs(event: Span.Event, cfg: OtelSourceConfig) -> Attrs:
    return Attrs(event.attributes, cfg, f"event {event.name[:80]!r}")


def _v137(source: Attrs, cfg: OtelSourceConfig, where: str) -> _Content:
    messages = msg.parts_messages(source.structured("gen_ai.input.messages"), cfg, f"{where} gen_ai.input.messages")
    instructions = msg.instructions_text(
        source.structured("gen_ai.system_instructions"), cfg, f"{where} gen_ai.system_instructions"
    )
    answer = msg.parts_answer(source.structured("gen_ai.output.messages"), cfg, f"{where} gen_ai.output.messages")
    tools_value = source.structured("gen_ai.tool.definitions")
    tools = msg.tool_definitions(tools_value, cfg, f"{where} gen_ai.tool.definitions") if tools_value else ()
    return "semconv-1.37", messages, instructions, answer, tools


def _v136(events: list[tuple[str, Span.Event]], cfg: OtelSourceConfig) -> _Content:
    messages: list[dict[str, Any]] = []
    choices: list[tuple[int, msg.Answer]] = []
    for n, (name, event) in enumerate(events):
        if name not in _V136_EVENTS and name != _CHOICE_EVENT:
            continue
        where = f"event {name} (#{n})"
        body = _event_body(_event_attrs(event, cfg), where)
        if name == _CHOICE_EVENT:
            index = body.get("index", 0)
            if not isinstance(index, int) or isinstance(index, bool):
                raise Refused(INVALID_CONTENT, f"{where} index is {kind_of(index)}, expected an integer")
            message = body.get("message") or {}
            if not isinstance(message, dict):
                raise Refused(INVALID_CONTENT, f"{where} message is {kind_of(message)}, expected an object")
            text = msg.content_text(message.get("content"), f"{where} message.content") or ""
            calls = msg.openai_tool_calls(message.get("tool_calls"), cfg, f"{where} message.tool_calls")
            choices.append((index, msg.Answer(text, tuple(calls), msg.finish_reason(body.get("finish_reason")))))
            continue
        message = msg.openai_message(body, cfg, where, default_role=_V136_EVENTS[name])
        if message.get("content") is None and "tool_calls" not in message:
            continue  # the event without its content (capture off for this field)
        messages.append(message)
    if len(messages) > cfg.max_messages_per_span:
        raise Refused(
            TOO_MANY_MESSAGES,
            f"span has {len(messages)} messages, above otel.max_messages_per_span={cfg.max_messages_per_span}",
        )
    answer = min(choices, key=lambda c: c[0])[1] if choices else None
    return "semconv-1.36", messages, None, answer, ()


def _event_body(attrs: Attrs, where: str) -> dict[str, Any]:
    """A 1.36 event's body: the ``gen_ai.event.content`` JSON attribute, else its fields as attributes."""
    if "gen_ai.event.content" in attrs:
        body = attrs.structured("gen_ai.event.content")
        if not isinstance(body, dict):
            raise Refused(INVALID_CONTENT, f"{where} gen_ai.event.content is {kind_of(body)}, expected an object")
        return body
    body = {}
    for key in _BODY_FIELDS:
        if key in attrs:
            body[key] = attrs.structured(key) if key in ("tool_calls", "message") else attrs.value(key)
    return body


def _v127(events: list[tuple[str, Span.Event]], cfg: OtelSourceConfig) -> _Content:
    messages: list[dict[str, Any]] = []
    answer: msg.Answer | None = None
    for name, event in events:
        attrs = _event_attrs(event, cfg)
        if name == "gen_ai.content.prompt" and "gen_ai.prompt" in attrs:
            items = attrs.structured("gen_ai.prompt")
            if not isinstance(items, list):
                raise Refused(INVALID_CONTENT, f"event {name} gen_ai.prompt is {kind_of(items)}, expected an array")
            if len(items) > cfg.max_messages_per_span:
                raise Refused(TOO_MANY_MESSAGES, f"event {name} has {len(items)} messages, above the limit")
            messages = [msg.openai_message(m, cfg, f"event {name} gen_ai.prompt[{i}]") for i, m in enumerate(items)]
        elif name == "gen_ai.content.completion" and "gen_ai.completion" in attrs:
            items = attrs.structured("gen_ai.completion")
            if isinstance(items, list) and items:
                first = msg.openai_message(
                    items[0], cfg, f"event {name} gen_ai.completion[0]", default_role="assistant"
                )
                calls = tuple(first.get("tool_calls", ()))
                answer = msg.Answer(first.get("content") or "", calls, None)
    return "semconv-1.27", messages, None, answer, ()


def _openllmetry(attrs: Attrs, cfg: OtelSourceConfig) -> _Content:
    fields: dict[tuple[str, int], dict[str, Any]] = {}
    for key in attrs.keys():
        match = _INDEXED.fullmatch(key)
        if match is None:
            continue
        side, index, rest = match.group(1), int(match.group(2)), match.group(3)
        if index >= cfg.max_messages_per_span:
            raise Refused(
                TOO_MANY_MESSAGES,
                f"attribute {key!r}: index above otel.max_messages_per_span={cfg.max_messages_per_span}",
            )
        fields.setdefault((side, index), {})[rest] = attrs.value(key)
    messages = [
        _openllmetry_message(fields[key], cfg, f"gen_ai.prompt.{key[1]}")
        for key in sorted(fields)
        if key[0] == "prompt"
    ]
    answer = None
    first = min((key for key in fields if key[0] == "completion"), default=None, key=lambda k: k[1])
    if first is not None:
        message = _openllmetry_message(fields[first], cfg, f"gen_ai.completion.{first[1]}", default_role="assistant")
        finish = fields[first].get("finish_reason")
        answer = msg.Answer(
            message.get("content") or "", tuple(message.get("tool_calls", ())), msg.finish_reason(finish)
        )
    return "openllmetry", messages, None, answer, _openllmetry_tools(attrs, cfg)


def _openllmetry_message(
    fields: dict[str, Any], cfg: OtelSourceConfig, where: str, default_role: str = "user"
) -> dict[str, Any]:
    if "user" in fields and "content" not in fields:  # text completions: gen_ai.prompt.0.user = the prompt
        fields = {**fields, "content": fields["user"], "role": fields.get("role", "user")}
    calls: dict[int, dict[str, Any]] = {}
    for key, value in fields.items():
        match = _TOOL_CALL.fullmatch(key)
        if match is not None:
            if int(match.group(1)) >= cfg.max_tools:
                raise Refused(INVALID_CONTENT, f"{where}.{key}: tool call index above otel.max_tools={cfg.max_tools}")
            calls.setdefault(int(match.group(1)), {})[match.group(2)] = value
    content = fields.get("content")
    if isinstance(content, str) and content.startswith("[{"):  # OpenLLMetry records a list content as JSON text
        try:
            parts = json_text(content, cfg, f"{where}.content")
        except Refused:
            parts = None
        if isinstance(parts, list) and all(isinstance(p, dict) and "type" in p for p in parts):
            content = parts
    body: dict[str, Any] = {"role": fields.get("role") or default_role, "content": content}
    if calls:
        body["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {"name": c.get("name"), "arguments": c.get("arguments")},
            }
            for _, c in sorted(calls.items())
        ]
    if fields.get("tool_call_id") is not None:
        body["tool_call_id"] = fields["tool_call_id"]
    return msg.openai_message(body, cfg, where)


def _openllmetry_tools(attrs: Attrs, cfg: OtelSourceConfig) -> tuple[dict[str, Any], ...]:
    functions: dict[int, dict[str, Any]] = {}
    for key in attrs.keys():
        match = _FUNCTION.fullmatch(key)
        if match is None:
            continue
        if int(match.group(1)) >= cfg.max_tools:
            raise Refused(INVALID_CONTENT, f"attribute {key!r}: index above otel.max_tools={cfg.max_tools}")
        value = attrs.structured(key) if match.group(2) == "parameters" else attrs.value(key)
        functions.setdefault(int(match.group(1)), {})[match.group(2)] = value
    return tuple(
        msg.function_tool(f.get("name"), f.get("description"), f.get("parameters"), f"llm.request.functions.{i}")
        for i, f in sorted(functions.items())
    )


def _span_tools(attrs: Attrs, cfg: OtelSourceConfig) -> tuple[dict[str, Any], ...]:
    value = attrs.structured("gen_ai.tool.definitions")
    if value:
        return msg.tool_definitions(value, cfg, "span gen_ai.tool.definitions")
    return _openllmetry_tools(attrs, cfg)


def _first_finish_reason(attrs: Attrs) -> str | None:
    reasons = attrs.value("gen_ai.response.finish_reasons")
    if isinstance(reasons, list) and reasons:
        return msg.finish_reason(reasons[0])
    return msg.finish_reason(reasons)


def _first_int(attrs: Attrs, *keys: str) -> int | None:
    for key in keys:
        value = attrs.integer(key)
        if value is not None:
            return value
    return None


def _token_ids(attrs: Attrs, key: str | None, cfg: OtelSourceConfig) -> tuple[int, ...] | None:
    if key is None or key not in attrs:
        return None
    values = attrs.value(key)
    if not isinstance(values, list):
        raise Refused(INVALID_CONTENT, f"attribute {key!r} is {kind_of(values)}, expected an int array")
    if len(values) > cfg.max_token_ids:
        raise Refused(
            OVERSIZE_ATTRIBUTE,
            f"attribute {key!r} has {len(values)} token ids, above otel.max_token_ids={cfg.max_token_ids}",
        )
    if not all(isinstance(v, int) and not isinstance(v, bool) and _INT32[0] <= v <= _INT32[1] for v in values):
        raise Refused(INVALID_CONTENT, f"attribute {key!r} holds a value that is not an int32 token id")
    return tuple(values)
