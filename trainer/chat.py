"""Conversations as token ids: the prompt of a turn (messages and tools offered) and an answer, rendered by the
model's chat template the way vLLM renders a chat request.

Training uses the logged ids where a trace has them (``prompt_token_ids``, ``completion_token_ids``: what
vLLM served, never a second rendering); this module renders only rows that lack them (``hourglass.trace/v1``
events, replays, OpenTelemetry spans without token ids) and the rated answer of a tool-call trace whose
completion ids are missing.

vLLM 0.32 renders a chat request (``vllm/renderers/chat_utils.py``) after two rewrites this module repeats:
an assistant tool call's ``arguments`` JSON text becomes an object (malformed or not an object: ``{}``), and
a message's content parts become one text (text parts joined by newlines). The template text is rendered,
then tokenised without special tokens added.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from connectors.schema import content_text


def _arguments(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit: no arguments
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat template takes them (vLLM's rewrites, see the module doc)."""
    out = []
    for message in messages:
        shown = {k: v for k, v in message.items() if v is not None}
        shown["content"] = content_text(message.get("content"))
        calls = message.get("tool_calls")
        if calls:
            shown["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _arguments(call["function"].get("arguments"))}}
                for call in calls
                if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping)
            ]
        else:
            shown.pop("tool_calls", None)
        out.append(shown)
    return out


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    generation_prompt: bool,
) -> str:
    text: Any = tokenizer.apply_chat_template(
        template_messages(messages),
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=generation_prompt,
        tokenize=False,
    )
    return str(text)


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The prompt ids of one turn: ``messages`` (and the ``tools`` offered) under the tokenizer's chat
    template, with the generation prompt, as vLLM renders them."""
    text = _render(tokenizer, messages, tools, True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    answer: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int] | None:
    """The ids of ``answer`` (an assistant message: text and/or tool calls) as the template renders it after
    ``messages``, through its end-of-turn token (what the model generates, then stops on); None when the
    template's rendering of the conversation does not begin with its rendering of the prompt (a template
    that rewrites earlier turns: no answer tokens can be cut out of it)."""
    prompt = _render(tokenizer, messages, tools, True)
    full = _render(tokenizer, [*messages, answer], tools, False)
    if not full.startswith(prompt):
        return None
    text = full[len(prompt) :]
    eos = tokenizer.eos_token
    if isinstance(eos, str) and eos and eos in text:
        text = text[: text.rindex(eos) + len(eos)]  # the template's newline after the turn is not generated
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
