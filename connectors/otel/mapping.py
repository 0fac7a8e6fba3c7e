"""GenAI calls and feedback signals -> ``hourglass.trace/v2`` / ``hourglass.feedback/v1`` event dicts.

The trace id is derived from the OTel ids, ``otel-<trace id hex>-<span id hex>``: a redelivered payload
gives the same id (the buffer de-duplicates by it), and feedback that points at the span finds its trace.
The dicts are plain JSON data (``ts`` as RFC 3339 text); ingest validates them like any native record
(user ids under ``metadata.user`` are replaced by their keyed hash there).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Final

from connectors.otel.config import OtelSourceConfig
from connectors.otel.types import NO_MODEL, FeedbackSignal, GenAICall, Rejected
from connectors.schema import FEEDBACK_SCHEMA, TRACE_SCHEMA

# The keys of conversation_fields: hourglass.trace/v2's conversation fields a span can carry (no
# parent_trace_id: a span does not say which earlier call's answer it continues), and the completion's ids.
CONVERSATION_FIELDS: Final = (
    "tools",
    "completion_tool_calls",
    "finish_reason",
    "prompt_token_ids",
    "completion_token_ids",
    "conversation_id",
    "turn",
    "usage",
)


Digest = Callable[[str], str]  # the ingest's keyed hash of one text (``UserHasher.digest``)


def user_identity(user_id: str | None) -> str:
    """What an OTel user's ``metadata.user_hash`` hashes: ``otel\\x00<user id>``, or ``otel`` when the span
    names no user (then the whole source counts as one user, as a gateway API key without ``user`` does)."""
    return "otel" if user_id is None else f"otel\x00{user_id}"


def derived_trace_id(trace_id: str, span_id: str) -> str:
    """The Hourglass trace id of an OTel span: ``otel-<32 hex>-<16 hex>`` (lowercase, deterministic)."""
    return f"otel-{trace_id.lower()}-{span_id.lower()}"


def rfc3339(when: datetime) -> str:
    """An aware datetime as RFC 3339 UTC text with a ``Z`` (microseconds when not whole seconds)."""
    return when.isoformat().replace("+00:00", "Z")


def trace_event(call: GenAICall, cfg: OtelSourceConfig, digest: Digest | None = None) -> dict[str, Any] | Rejected:
    """The ``hourglass.trace/v2`` event of one call; ``no_model`` when no model name.

    ``prompt``: the chat messages, led by a system message holding ``gen_ai.system_instructions`` when the
    span recorded them apart; a text completion whose input is one user text is stored as that text (as
    the gateway stores ``/v1/completions``). ``completion``: the first choice's text (empty when it only
    calls tools). ``metadata``: ``user`` (the configured user id attribute; ingest hashes it),
    ``finish_reason`` and ``usage`` (as the gateway records them), ``otel`` (provenance: ids, service,
    scope, layout, operation, provider, request/response model, response and conversation ids), and, when
    ``digest`` is given (ingest's ``UserHasher.digest``), ``user_hash`` = ``digest(user_identity(user))``:
    the identity rounds cap per user (``rl.max_user_share``) and feedback counts one vote per, like the
    gateway's. Without it every OTel row counts as the one user ``anonymous``.
    The conversation fields (tools, tool calls, finish reason, token ids where the span recorded them,
    conversation id, turn, usage) come from :func:`conversation_fields`, those the span recorded only.
    """
    model = cfg.model_name or call.request_model or call.response_model
    if not model:
        return Rejected(
            NO_MODEL,
            "GenAI span without gen_ai.request.model or gen_ai.response.model; set otel.model_name",
            call.trace_id,
            call.span_id,
        )
    metadata: dict[str, Any] = {}
    if call.user_id is not None:
        metadata["user"] = call.user_id
    if digest is not None:
        metadata["user_hash"] = digest(user_identity(call.user_id))
    if call.finish_reason is not None:
        metadata["finish_reason"] = call.finish_reason
    usage = _usage(call)
    if usage is not None:
        metadata["usage"] = usage
    metadata["otel"] = {
        key: value
        for key, value in (
            ("trace_id", call.trace_id),
            ("span_id", call.span_id),
            ("parent_span_id", call.parent_span_id),
            ("service_name", call.service_name),
            ("scope_name", call.scope_name),
            ("layout", call.layout),
            ("operation", call.operation),
            ("provider", call.provider),
            ("request_model", call.request_model),
            ("response_model", call.response_model),
            ("response_id", call.response_id),
            ("conversation_id", call.conversation_id),
            ("start", rfc3339(call.start)),
        )
        if value is not None
    }
    return {
        "schema": TRACE_SCHEMA,
        "trace_id": derived_trace_id(call.trace_id, call.span_id),
        "ts": rfc3339(call.end),
        "model": model,
        "adapter_version": None,
        "prompt": _prompt(call),
        "completion": call.output_text,
        **{key: value for key, value in conversation_fields(call).items() if value is not None},
        "metadata": metadata,
    }


def conversation_fields(call: GenAICall) -> dict[str, Any]:
    """The conversation and tool fields of ``hourglass.trace/v2`` a span carries, exactly the keys of
    :data:`CONVERSATION_FIELDS` (None where the span recorded nothing):

    ``tools`` (OpenAI tool definitions offered), ``completion_tool_calls`` (the answer's tool calls,
    ``[{"id", "type": "function", "function": {"name", "arguments"}}]``), ``finish_reason`` (OpenAI
    words), ``prompt_token_ids`` / ``completion_token_ids`` (where the span recorded them),
    ``conversation_id`` (``gen_ai.conversation.id``), ``turn`` (0-based: the assistant messages already
    in the prompt, so each call of a conversation whose history is passed back has its own turn) and
    ``usage`` (``{"prompt_tokens", "completion_tokens"}``, the span's ``gen_ai.usage.*``).
    """
    return {
        "tools": [dict(tool) for tool in call.tools] or None,
        "completion_tool_calls": [dict(c) for c in call.output_tool_calls] or None,
        "finish_reason": call.finish_reason,
        "prompt_token_ids": list(call.prompt_token_ids) if call.prompt_token_ids is not None else None,
        "completion_token_ids": list(call.completion_token_ids) if call.completion_token_ids is not None else None,
        "conversation_id": call.conversation_id,
        "turn": sum(1 for m in call.input_messages if m.get("role") == "assistant"),
        "usage": _usage(call),
    }


def feedback_event(signal: FeedbackSignal, digest: Digest | None = None) -> dict[str, Any]:
    """The ``hourglass.feedback/v1`` event of one signal: the derived trace id of the GenAI span it points
    at, its signals, ``ts``, ``metadata.user`` (hashed at ingest), ``metadata.user_hash`` (the voter, when
    ``digest`` is given; see :func:`trace_event`) and ``metadata.otel`` provenance."""
    metadata: dict[str, Any] = {}
    if signal.user_id is not None:
        metadata["user"] = signal.user_id
    if digest is not None:
        metadata["user_hash"] = digest(user_identity(signal.user_id))
    otel: dict[str, Any] = {
        "trace_id": signal.source_trace_id,
        "span_id": signal.source_span_id,
        "source": signal.source,
        "attributes": list(signal.attributes),
    }
    if signal.evaluation_name is not None:
        otel["evaluation_name"] = signal.evaluation_name
    metadata["otel"] = otel
    return {
        "schema": FEEDBACK_SCHEMA,
        "trace_id": derived_trace_id(signal.target_trace_id, signal.target_span_id),
        "ts": rfc3339(signal.ts),
        **signal.signals,
        "metadata": metadata,
    }


def _prompt(call: GenAICall) -> list[dict[str, Any]] | str:
    messages = [dict(m) for m in call.input_messages]
    if call.operation == "text_completion" and not call.system_instructions and len(messages) == 1:
        only = messages[0]
        if only.get("role") == "user" and isinstance(only.get("content"), str) and set(only) == {"role", "content"}:
            return str(only["content"])
    if call.system_instructions:
        messages.insert(0, {"role": "system", "content": call.system_instructions})
    return messages


def _usage(call: GenAICall) -> dict[str, int] | None:
    if call.input_tokens is None and call.output_tokens is None:
        return None
    usage = {}
    if call.input_tokens is not None:
        usage["prompt_tokens"] = call.input_tokens
    if call.output_tokens is not None:
        usage["completion_tokens"] = call.output_tokens
    return usage
