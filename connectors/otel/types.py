"""The values the OpenTelemetry source produces: one inference call, one feedback signal, or why a span or
payload was skipped or refused. Frozen dataclasses; the decoder returns them and never raises on bad input.

Messages are in the OpenAI chat shape (``{"role", "content", "tool_calls": [{"id", "type": "function",
"function": {"name", "arguments"}}], "tool_call_id"}``), the shape ``hourglass.trace/v2`` stores.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from connectors.schema import Rejected as _SchemaRejected

# Skip reasons (counted, not dead-lettered): spans that are not a GenAI inference call.
NOT_GENAI: Final = "not_genai"  # no gen_ai.operation.name (nor OpenLLMetry's llm.request.type)
NOT_INFERENCE: Final = "not_inference"  # embeddings, execute_tool, invoke_agent, ...
FAILED_CALL: Final = "failed_call"  # span status ERROR: the call produced no answer

# Reject reasons (dead letters). Payload level (the whole Kafka record):
EMPTY_VALUE: Final = "empty_value"
OVERSIZE: Final = "oversize"
INVALID_PROTOBUF: Final = "invalid_protobuf"  # not an ExportTraceServiceRequest
INVALID_JSON: Final = "invalid_json"  # not JSON text
INVALID_OTLP: Final = "invalid_otlp"  # JSON that is not OTLP/JSON (wrong types, bad hex ids, unknown enum)
TOO_MANY_SPANS: Final = "too_many_spans"
NESTING_TOO_DEEP: Final = "nesting_too_deep"
# Span level (one GenAI span or one feedback item):
NO_CONTENT: Final = "no_content"  # content capture is off: neither messages nor an answer recorded
NO_PROMPT: Final = "no_prompt"  # an answer but no input messages
NO_COMPLETION: Final = "no_completion"  # input messages but no answer (no text, no tool call)
NO_MODEL: Final = "no_model"  # no gen_ai.request.model / gen_ai.response.model and no otel.model_name
INVALID_SPAN: Final = "invalid_span"  # trace/span id of the wrong length, no usable timestamp
INVALID_CONTENT: Final = "invalid_content"  # a message attribute/event of the wrong shape or type
UNSUPPORTED_CONTENT: Final = "unsupported_content"  # media (blob/uri/file) or provider-side tool parts
OVERSIZE_ATTRIBUTE: Final = "oversize_attribute"
TOO_MANY_MESSAGES: Final = "too_many_messages"
TOO_MANY_TOOLS: Final = "too_many_tools"
INVALID_SIGNAL: Final = "invalid_signal"  # a feedback attribute whose value the rule cannot read
UNLINKED_FEEDBACK: Final = "unlinked_feedback"  # a feedback item with no link, parent or GenAI span to point at


@dataclass(frozen=True)
class Rejected(_SchemaRejected):
    """A payload or span that cannot be used: reason code, readable detail, and the span it is about (hex ids;
    None for the whole payload). A :class:`connectors.schema.Rejected`, so the dead-letter path takes it as is."""

    trace_id: str | None = None
    span_id: str | None = None


@dataclass(frozen=True)
class Skipped:
    """A span that is not a GenAI inference call (counted by reason, never dead-lettered)."""

    reason: str
    trace_id: str
    span_id: str


@dataclass(frozen=True)
class GenAICall:
    """One GenAI inference span (``gen_ai.operation.name`` = ``chat`` / ``text_completion``), decoded.

    ``trace_id`` / ``span_id`` are lowercase hex (32 / 16 digits); times are aware UTC datetimes.
    ``input_messages`` are OpenAI chat messages in the order sent (system instructions given apart, as
    ``gen_ai.system_instructions``, are in ``system_instructions``, not in the messages); ``tools`` are
    OpenAI tool definitions (``{"type": "function", "function": {"name", "description", "parameters"}}``);
    the output is the first choice only: ``output_text`` and ``output_tool_calls`` (OpenAI tool calls).
    ``layout`` names what the content was read from: ``semconv-1.37`` (``gen_ai.input.messages`` /
    ``gen_ai.output.messages`` on the span or its ``gen_ai.client.inference.operation.details`` event),
    ``semconv-1.36`` (``gen_ai.*.message`` / ``gen_ai.choice`` span events), ``semconv-1.27``
    (``gen_ai.content.prompt`` / ``gen_ai.content.completion`` events) or ``openllmetry``
    (``gen_ai.prompt.{i}.*`` / ``gen_ai.completion.{i}.*`` attributes).
    """

    trace_id: str
    span_id: str
    parent_span_id: str | None
    start: datetime
    end: datetime
    operation: str  # "chat" | "text_completion"
    request_model: str | None
    response_model: str | None
    provider: str | None
    input_messages: tuple[dict[str, Any], ...]
    system_instructions: str | None
    tools: tuple[dict[str, Any], ...]
    output_text: str
    output_tool_calls: tuple[dict[str, Any], ...]
    finish_reason: str | None
    input_tokens: int | None
    output_tokens: int | None
    conversation_id: str | None
    response_id: str | None
    user_id: str | None
    prompt_token_ids: tuple[int, ...] | None
    completion_token_ids: tuple[int, ...] | None
    layout: str
    service_name: str | None = None
    scope_name: str | None = None


@dataclass(frozen=True)
class FeedbackSignal:
    """One user signal about an earlier GenAI span, read from an OTel span or span event.

    ``target_trace_id`` / ``target_span_id`` (hex) name the GenAI span it is about; ``signals`` maps
    Hourglass signal names to values already in that signal's type (``"up"``/``"down"``, an int rating, a
    float reward, a bool); ``ts`` is when it was given (UTC); ``attributes`` are the OTel attributes read.
    """

    target_trace_id: str
    target_span_id: str
    signals: Mapping[str, Any]
    ts: datetime
    user_id: str | None
    attributes: tuple[str, ...]
    evaluation_name: str | None
    source_trace_id: str
    source_span_id: str
    source: str  # "span" | "event"


@dataclass
class OtelBatch:
    """Everything one payload (one Kafka record value) held, in span order.

    ``skipped`` counts spans by skip reason; ``rejected`` lists the payload's refusal (alone, when the whole
    payload is unusable) or each refused span / feedback item.
    """

    calls: list[GenAICall] = field(default_factory=list)
    feedback: list[FeedbackSignal] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    spans: int = 0
