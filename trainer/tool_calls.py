"""Tool calls in generated text, and the built-in tool-call rewards.

A fresh rollout is raw text: the tool calls are in it in the format the model's chat template teaches and
its vLLM tool parser reads. :func:`hermes_tool_calls` reads the Hermes / ChatML format (the format of
Hourglass's ``chatml_tools`` template, Qwen2.5 and NousResearch Hermes models; vLLM's ``hermes`` parser):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the last one possibly unclosed at the
end of the text (vLLM's parser accepts that too).

Rewards (``(prompt_messages, completion, metadata) -> float``, registered as built-ins in
:mod:`trainer.rewards`) judge the calls against ``metadata["tools"]``, the OpenAI tool definitions the
prompt offered (the round puts them there; rows that offered none are left out of a candidate whose reward
needs them):

- ``tool_call_json``: every call's block and its ``arguments`` parse as JSON (the arguments an object);
- ``tool_call_exists``: every call names an offered tool;
- ``tool_call_valid``: both, and the arguments validate against the tool's JSON-Schema ``parameters``
  (``jsonschema``, the draft the schema names, 2020-12 by default).

Each is 1.0 when it holds for every call of a completion with at least one call, 0.0 when it fails for one,
and ``no_call`` (default 0.0) for a completion without tool calls.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

SCHEMA_STEPS = 10_000
SCHEMA_STEPS_PER_CHAR = 20
"""Most schema keywords one call's arguments may evaluate (:func:`tool_call_valid`): :data:`SCHEMA_STEPS` plus
this many per character of the arguments as JSON (a legitimate validation costs about linearly in the arguments'
size; a model's arguments are bounded by ``max_tokens``). The schema comes from
traffic: ``anyOf`` branches that each ``$ref`` the next level, n levels deep, cost 2**n steps, and a ``pattern``
like ``^(a+)+$`` backtracks exponentially in Python's ``re``; one answer then stalled a canary's monitors (and
their lock) or a round's rewards for hours. Past the budget, or a pattern past :data:`PATTERN_TIMEOUT_S`, the call
is invalid."""
PATTERN_TIMEOUT_S = 0.1


class _TooCostly(Exception):
    """Validating a call's arguments went past its step budget (:data:`SCHEMA_STEPS_PER_CHAR`)."""


def _search(pattern: str, text: str) -> Any:
    """``re.search`` run by the ``regex`` engine with a timeout (TimeoutError), where it is installed (transformers
    needs it: every host that trains or runs a canary); else by ``re``."""
    try:
        import regex
    except ImportError:
        return re.search(pattern, text)
    return regex.search(pattern, text, timeout=PATTERN_TIMEOUT_S)


def _pattern(validator: Any, patrn: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not _search(patrn, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")


def _pattern_properties(validator: Any, properties: Any, instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for patrn, subschema in properties.items():
        for k, v in instance.items():
            if _search(patrn, k):
                yield from validator.descend(v, subschema, path=k, schema_path=patrn)


_STEPS = threading.local()  # keywords evaluated by the current validation of this thread
_BOUNDED: dict[type, Any] = {}  # validator class -> its counted extension (built once: extend() costs ~2 ms)


def _counted(fn: Any) -> Any:
    def keyword(validator: Any, value: Any, instance: Any, sub: Any) -> Any:
        _STEPS.n += 1
        if _STEPS.n > _STEPS.budget:
            raise _TooCostly(f"validating the arguments took more than {_STEPS.budget} schema steps")
        return fn(validator, value, instance, sub)

    return keyword


def _bounded_valid(schema: dict[str, Any], arguments: Any) -> bool:
    """``arguments`` valid by ``schema`` (the draft it names, 2020-12 by default), every keyword counted against
    the step budget (:data:`SCHEMA_STEPS_PER_CHAR`) and every pattern run under :data:`PATTERN_TIMEOUT_S`.

    Raises:
        _TooCostly: past the step budget; TimeoutError: a pattern past its timeout.
    """
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    bounded = _BOUNDED.get(cls)
    if bounded is None:
        keywords = {**cls.VALIDATORS}
        for name, fn in (("pattern", _pattern), ("patternProperties", _pattern_properties)):
            if name in keywords:
                keywords[name] = fn
        bounded = _BOUNDED[cls] = jsonschema.validators.extend(cls, {k: _counted(f) for k, f in keywords.items()})
    _STEPS.n, _STEPS.budget = 0, SCHEMA_STEPS + SCHEMA_STEPS_PER_CHAR * len(json.dumps(arguments))
    return bool(bounded(schema).is_valid(arguments))


@dataclass(frozen=True)
class ParsedCall:
    """One tool call read from text: its name and arguments, or why it cannot be read (``error``)."""

    name: str | None
    arguments: Any
    error: str | None = None


def hermes_tool_calls(text: str) -> list[ParsedCall]:
    """The ``<tool_call>`` blocks of ``text``, in order (an empty list when there is none)."""
    calls = []
    for match in _BLOCK.finditer(text):
        body = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        try:
            value = json.loads(body)
        except (ValueError, RecursionError) as err:
            calls.append(ParsedCall(None, None, f"not JSON: {err}"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ParsedCall(None, None, 'not an object with a string "name"'))
            continue
        arguments = value.get("arguments", value.get("parameters"))
        if isinstance(arguments, str):  # arguments written as JSON text inside the JSON
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as err:
                calls.append(ParsedCall(value["name"], None, f"arguments are not JSON: {err}"))
                continue
        if not isinstance(arguments, dict):
            calls.append(ParsedCall(value["name"], None, "arguments are not a JSON object"))
            continue
        calls.append(ParsedCall(value["name"], arguments))
    return calls


def answer_text(content: str, tool_calls: Sequence[Mapping[str, Any]] | None) -> str:
    """A logged answer as the text the tool-call rewards read: its content, then one Hermes block per tool call
    (``tool_calls`` as the trace logs them, OpenAI's shape; the arguments as the model wrote them, so arguments
    that do not parse still fail ``tool_call_json``). ``content`` alone when there are no calls."""
    blocks = []
    for call in tool_calls or ():
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            continue
        arguments = fn.get("arguments")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
        blocks.append(f'<tool_call>\n{{"name": {json.dumps(fn.get("name"))}, "arguments": {text}}}\n</tool_call>')
    return "\n".join([content, *blocks] if content else blocks)


def offered_tools(metadata: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``metadata["tools"]`` (OpenAI tool definitions) by function name; none when it is not a list (metadata
    is free-form on traces a producer writes straight to Kafka)."""
    tools = metadata.get("tools")
    out = {}
    for tool in tools if isinstance(tools, list) else ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            out[function["name"]] = function
    return out


def _judge(completion: str, metadata: Mapping[str, Any], no_call: float, check: Any) -> float:
    calls = hermes_tool_calls(completion)
    if not calls:
        return no_call
    tools = offered_tools(metadata)
    return float(all(check(call, tools) for call in calls))


def tool_call_json(
    prompt_messages: Sequence[Mapping[str, Any]], completion: str, metadata: dict[str, Any], *, no_call: float = 0.0
) -> float:
    """1.0 when every tool call of the completion parses as JSON with object arguments (see the module doc)."""
    return _judge(completion, metadata, no_call, lambda call, tools: call.error is None)


def tool_call_exists(
    prompt_messages: Sequence[Mapping[str, Any]], completion: str, metadata: dict[str, Any], *, no_call: float = 0.0
) -> float:
    """1.0 when every tool call of the completion names a tool the prompt offered."""
    return _judge(completion, metadata, no_call, lambda call, tools: call.name in tools)


def tool_call_valid(
    prompt_messages: Sequence[Mapping[str, Any]], completion: str, metadata: dict[str, Any], *, no_call: float = 0.0
) -> float:
    """1.0 when every tool call parses, names an offered tool and its arguments validate against the tool's
    ``parameters`` schema (a tool without one accepts any object)."""

    def valid(call: ParsedCall, tools: dict[str, dict[str, Any]]) -> bool:
        if call.error is not None or call.name not in tools:
            return False
        schema = tools[call.name].get("parameters")
        if not isinstance(schema, dict):
            return True
        try:
            return _bounded_valid(schema, call.arguments)
        except Exception:  # noqa: BLE001 - a schema from traffic that cannot be evaluated (bad $ref, too deep, too costly): invalid
            return False

    return _judge(completion, metadata, no_call, valid)


# The rows a tool-call reward can score: those that offered tools (see trainer.rewards.RewardMix.accepts).
for _fn in (tool_call_json, tool_call_exists, tool_call_valid):
    _fn.required_metadata = ("tools",)  # type: ignore[attr-defined]
