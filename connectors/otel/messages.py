"""GenAI message shapes -> OpenAI chat messages.

Two input shapes are read:

- the parts model of semantic conventions >= 1.37 (JSON schemas ``gen-ai-input-messages.json``,
  ``gen-ai-output-messages.json``, ``gen-ai-system-instructions.json``, ``gen-ai-tool-definitions.json``):
  ``{"role", "parts": [{"type": "text", "content"}, {"type": "tool_call", "id", "name", "arguments"},
  {"type": "tool_call_response", "id", "response"}, {"type": "reasoning", "content"}], "finish_reason"}``;
- the OpenAI-like bodies of 1.36 events and 1.27 / OpenLLMetry attributes: ``{"role", "content",
  "tool_calls": [{"id", "type", "function": {"name", "arguments"}}], "id" | "tool_call_id"}``.

Output: ``{"role", "content", "tool_calls"?, "tool_call_id"?, "name"?, "reasoning_content"?}`` (vLLM's
name for reasoning text). Several text parts of one message are joined with a newline (as vLLM joins
text content parts). Media parts (``blob``, ``uri``, ``file``) and provider-side tools
(``server_tool_call``) are refused as ``unsupported_content``: the trace would not hold what the model saw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from connectors.otel.config import OtelSourceConfig
from connectors.otel.types import INVALID_CONTENT, TOO_MANY_MESSAGES, TOO_MANY_TOOLS, UNSUPPORTED_CONTENT
from connectors.otel.wire import Refused, kind_of
from connectors.schema import CHAT_ROLES

_SEMCONV_FINISH = {"tool_call": "tool_calls"}  # semconv FinishReason -> OpenAI finish_reason


@dataclass(frozen=True)
class Answer:
    """The first choice of a call: its text (may be empty when it only calls tools), tool calls, finish reason."""

    text: str
    tool_calls: tuple[dict[str, Any], ...]
    finish_reason: str | None

    @property
    def empty(self) -> bool:
        return not self.text and not self.tool_calls


def finish_reason(value: Any) -> str | None:
    """A finish reason in OpenAI's words (``tool_call`` -> ``tool_calls``); None when absent or not a string."""
    if not isinstance(value, str) or not value:
        return None
    return _SEMCONV_FINISH.get(value, value)


# --- the parts model (>= 1.37) -----------------------------------------------------------------------


def parts_messages(value: Any, cfg: OtelSourceConfig, where: str) -> list[dict[str, Any]]:
    """``gen_ai.input.messages`` (a list of ChatMessage) as OpenAI chat messages, in order.

    Raises:
        Refused: ``invalid_content``, ``unsupported_content``, ``too_many_messages``, ``too_many_tools``.
    """
    items = _list(value, where)
    if len(items) > cfg.max_messages_per_span:
        raise Refused(
            TOO_MANY_MESSAGES,
            f"{where} has {len(items)} messages, above otel.max_messages_per_span={cfg.max_messages_per_span}",
        )
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        out.extend(_parts_message(item, cfg, f"{where}[{i}]"))
    if len(out) > cfg.max_messages_per_span:
        raise Refused(
            TOO_MANY_MESSAGES,
            f"{where} makes {len(out)} messages, above otel.max_messages_per_span={cfg.max_messages_per_span}",
        )
    return out


def _parts_message(item: Any, cfg: OtelSourceConfig, where: str) -> list[dict[str, Any]]:
    obj = _object(item, where)
    role = _role(obj.get("role"), where)
    texts, reasoning, calls, responses = _split_parts(obj.get("parts"), cfg, f"{where}.parts")
    out: list[dict[str, Any]] = []
    if texts or calls or reasoning or not responses:
        message: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts else (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        if isinstance(obj.get("name"), str) and obj["name"]:
            message["name"] = obj["name"]
        out.append(message)
    for call_id, response in responses:  # a tool result is a message of its own (role "tool")
        message = {"role": "tool", "content": response}
        if call_id is not None:
            message["tool_call_id"] = call_id
        out.append(message)
    return out


def parts_answer(value: Any, cfg: OtelSourceConfig, where: str) -> Answer | None:
    """The first message of ``gen_ai.output.messages`` (one message per choice) as an answer; None when empty.

    Raises:
        Refused: ``invalid_content``, ``unsupported_content``, ``too_many_messages``, ``too_many_tools``.
    """
    items = _list(value, where)
    if not items:
        return None
    if len(items) > cfg.max_messages_per_span:
        raise Refused(
            TOO_MANY_MESSAGES,
            f"{where} has {len(items)} choices, above otel.max_messages_per_span={cfg.max_messages_per_span}",
        )
    first = _object(items[0], f"{where}[0]")
    texts, _reasoning, calls, responses = _split_parts(first.get("parts"), cfg, f"{where}[0].parts")
    if responses:
        raise Refused(UNSUPPORTED_CONTENT, f"{where}[0].parts: a tool_call_response in the model's output")
    return Answer("\n".join(texts), tuple(calls), finish_reason(first.get("finish_reason")))


def instructions_text(value: Any, cfg: OtelSourceConfig, where: str) -> str | None:
    """``gen_ai.system_instructions`` (a list of parts, text only) as one text; None when empty.

    Raises:
        Refused: ``invalid_content``, ``unsupported_content``.
    """
    texts, reasoning, calls, responses = _split_parts(value, cfg, where)
    if calls or responses or reasoning:
        raise Refused(UNSUPPORTED_CONTENT, f"{where}: system instructions may hold text parts only")
    return "\n".join(texts) if texts else None


def _split_parts(
    value: Any, cfg: OtelSourceConfig, where: str
) -> tuple[list[str], list[str], list[dict[str, Any]], list[tuple[str | None, str]]]:
    """(texts, reasoning texts, OpenAI tool calls, (tool call id, response text)) of a parts list."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    responses: list[tuple[str | None, str]] = []
    for i, item in enumerate(_list(value, where)):
        part = _object(item, f"{where}[{i}]")
        kind = part.get("type")
        at = f"{where}[{i}]"
        if kind == "text":
            texts.append(_string(part.get("content"), f"{at}.content"))
        elif kind == "reasoning":
            reasoning.append(_string(part.get("content"), f"{at}.content"))
        elif kind == "tool_call":
            calls.append(_call(part.get("id"), part.get("name"), part.get("arguments"), at))
        elif kind == "tool_call_response":
            responses.append((_optional_id(part.get("id"), f"{at}.id"), _as_text(part.get("response"))))
        elif isinstance(kind, str):
            raise Refused(
                UNSUPPORTED_CONTENT,
                f"{at} is a {kind!r} part; Hourglass stores text, reasoning, tool calls and tool results only",
            )
        else:
            raise Refused(INVALID_CONTENT, f"{at}.type is {kind_of(kind)}, expected a part type string")
    if len(calls) > cfg.max_tools:
        raise Refused(TOO_MANY_TOOLS, f"{where} has {len(calls)} tool calls, above otel.max_tools={cfg.max_tools}")
    return texts, reasoning, calls, responses


# --- OpenAI-like bodies (1.36 events, 1.27 / OpenLLMetry attributes) -----------------------------------


def content_text(value: Any, where: str) -> str | None:
    """A message ``content``: a string, or a list of OpenAI / semconv text parts (joined with a newline);
    None when absent.

    Raises:
        Refused: ``unsupported_content`` (non-text parts), ``invalid_content``.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, item in enumerate(value):
            part = _object(item, f"{where}[{i}]")
            if part.get("type") != "text":
                raise Refused(UNSUPPORTED_CONTENT, f"{where}[{i}] is a {str(part.get('type'))[:40]!r} part; text only")
            texts.append(_string(part.get("text", part.get("content")), f"{where}[{i}].text"))
        return "\n".join(texts)
    raise Refused(INVALID_CONTENT, f"{where} is {kind_of(value)}, expected a string or a list of text parts")


def openai_tool_calls(value: Any, cfg: OtelSourceConfig, where: str) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` (``[{"id", "type", "function": {"name", "arguments"}}]``), normalized.

    Raises:
        Refused: ``invalid_content``, ``too_many_tools``.
    """
    items = _list(value, where)
    if len(items) > cfg.max_tools:
        raise Refused(TOO_MANY_TOOLS, f"{where} has {len(items)} tool calls, above otel.max_tools={cfg.max_tools}")
    calls = []
    for i, item in enumerate(items):
        call = _object(item, f"{where}[{i}]")
        function = call.get("function")
        fn = _object(function, f"{where}[{i}].function") if function is not None else call
        calls.append(_call(call.get("id"), fn.get("name"), fn.get("arguments"), f"{where}[{i}]"))
    return calls


def openai_message(value: Any, cfg: OtelSourceConfig, where: str, default_role: str | None = None) -> dict[str, Any]:
    """An OpenAI-like message, normalized (role, content text, tool_calls, tool_call_id from ``tool_call_id``
    or the 1.36 tool event's ``id``).

    Raises:
        Refused: ``invalid_content``, ``unsupported_content``, ``too_many_tools``.
    """
    obj = _object(value, where)
    role = _role(obj.get("role") or default_role, where)
    content = obj.get("content")
    if role == "tool" and content is not None and not isinstance(content, str):
        content = _as_text(content)  # a tool result recorded as structured data: its JSON text
    message: dict[str, Any] = {"role": role, "content": content_text(content, f"{where}.content")}
    if obj.get("tool_calls") is not None:
        calls = openai_tool_calls(obj["tool_calls"], cfg, f"{where}.tool_calls")
        if calls:
            message["tool_calls"] = calls
    call_id = obj.get("tool_call_id", obj.get("id") if role == "tool" else None)
    if call_id is not None:
        message["tool_call_id"] = _optional_id(call_id, f"{where}.tool_call_id")
    return message


# --- tool definitions ------------------------------------------------------------------------------------


def tool_definitions(value: Any, cfg: OtelSourceConfig, where: str) -> tuple[dict[str, Any], ...]:
    """``gen_ai.tool.definitions`` (semconv: ``{"type": "function", "name", "description"?, "parameters"?}``;
    the OpenAI shape ``{"type": "function", "function": {...}}`` is read too) as OpenAI tool definitions.

    Raises:
        Refused: ``invalid_content``, ``unsupported_content`` (a provider-side tool such as
            ``code_interpreter``), ``too_many_tools``.
    """
    items = _list(value, where)
    if len(items) > cfg.max_tools:
        raise Refused(TOO_MANY_TOOLS, f"{where} has {len(items)} tools, above otel.max_tools={cfg.max_tools}")
    tools = []
    for i, item in enumerate(items):
        tool = _object(item, f"{where}[{i}]")
        kind = tool.get("type", "function")
        if kind != "function":
            raise Refused(
                UNSUPPORTED_CONTENT, f"{where}[{i}] is a {str(kind)[:40]!r} tool; only function tools can be trained on"
            )
        fn = _object(tool["function"], f"{where}[{i}].function") if "function" in tool else tool
        tools.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}[{i}]"))
    return tuple(tools)


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """One OpenAI function tool definition.

    Raises:
        Refused: ``invalid_content``.
    """
    function: dict[str, Any] = {"name": _string(name, f"{where}.name", non_empty=True)}
    if description is not None:
        function["description"] = _string(description, f"{where}.description")
    if parameters is not None:
        function["parameters"] = _object(parameters, f"{where}.parameters")
    return {"type": "function", "function": function}


# --- small checks ----------------------------------------------------------------------------------------------


def _call(call_id: Any, name: Any, arguments: Any, where: str) -> dict[str, Any]:
    """An OpenAI tool call; arguments as JSON text (kept as is when already text, ``""`` when not recorded)."""
    call: dict[str, Any] = {
        "id": _optional_id(call_id, f"{where}.id") or "",
        "type": "function",
        "function": {"name": _string(name, f"{where}.name", non_empty=True), "arguments": _as_text(arguments)},
    }
    return call


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as err:  # an OTLP bytes_value inside structured content
        raise Refused(INVALID_CONTENT, f"structured content is not JSON data: {type(err).__name__}: {err}") from err


def _role(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise Refused(INVALID_CONTENT, f"{where}.role is {kind_of(value)}, expected a role name")
    if value not in CHAT_ROLES:
        raise Refused(INVALID_CONTENT, f"{where}.role {value[:64]!r} is not one of {sorted(CHAT_ROLES)}")
    return value


def _string(value: Any, where: str, non_empty: bool = False) -> str:
    if not isinstance(value, str) or (non_empty and not value):
        raise Refused(
            INVALID_CONTENT, f"{where} is {kind_of(value)}, expected a {'non-empty ' if non_empty else ''}string"
        )
    return value


def _optional_id(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise Refused(INVALID_CONTENT, f"{where} is {kind_of(value)}, expected a string id")


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise Refused(INVALID_CONTENT, f"{where} is {kind_of(value)}, expected an array")
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Refused(INVALID_CONTENT, f"{where} is {kind_of(value)}, expected an object")
    return value
