"""What the gateway accepts of OpenAI tool calling: ``tools``, ``tool_choice``, assistant ``tool_calls`` and
``tool`` messages, each bounded (``gateway.max_tools``, ``max_tool_schema_bytes``, ``max_tool_calls``,
``max_tool_arguments_bytes``) and refused with a 400 naming the field (``param``) otherwise.

Upstream API: OpenAI Chat Completions function tools (``{"type": "function", "function": {"name",
"description", "parameters", "strict"}}``; names match ``^[A-Za-z0-9_-]{1,64}$``), as vLLM 0.32 reads them
(``ChatCompletionRequest.check_tool_usage``). A tool's ``parameters`` must be a valid JSON Schema (checked
against its meta-schema with ``jsonschema``): with ``tool_choice`` ``required`` or a named tool, vLLM compiles
it into a grammar, and a schema it cannot compile is a 500 there.

No I/O; every check raises :class:`ToolRefused` (message and ``param``), which the request checks turn into
a 400. :func:`ref_cycle` is the self-reference check of every JSON Schema a request carries (``response_format``
too).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import jsonschema

from connectors.config import GatewayConfig
from connectors.json_body import short
from connectors.errors import ConnectorError

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_ID_CHARS = 256  # tool call ids: OpenAI's are ~30 characters, vLLM's ~46
MAX_ARGUMENT_DEPTH = 64  # nesting of a tool call's arguments: real ones nest a few levels
TOOL_CHOICES = frozenset({"none", "auto", "required"})
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_CALL_KEYS = frozenset({"id", "type", "function"})
_CALL_FUNCTION_KEYS = frozenset({"name", "arguments"})
# Keys the official openai client sends back when an app appends a response's message object to its
# conversation (``model_dump(exclude_unset=True)`` of what vLLM answered): accepted when null (or an empty
# list) and dropped, since nothing renders them; anything else in them is refused.
NULL_ONLY_KEYS = frozenset({"refusal", "annotations", "audio", "function_call", "reasoning", "reasoning_content"})


class ToolRefused(ConnectorError, ValueError):
    """A tool field the gateway refuses (400): ``message`` and the OpenAI error ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_tools(tools: Any, cfg: GatewayConfig) -> tuple[frozenset[str], int]:
    """The offered tools: ``(their names, characters of their definitions)`` (the definitions are rendered
    into the prompt, so they count toward ``gateway.max_prompt_chars``).

    Raises:
        ToolRefused: param ``tools`` (not a non-empty list, more than ``gateway.max_tools``, a definition that
            is not a function tool, a name off the pattern or repeated, a definition above
            ``gateway.max_tool_schema_bytes``, all of them above ``gateway.max_prompt_chars``, ``parameters`` that
            is not a JSON Schema object).
    """
    if not isinstance(tools, list) or not tools:
        raise ToolRefused("field 'tools' must be a non-empty list of function tool definitions", "tools")
    if len(tools) > cfg.max_tools:
        raise ToolRefused(f"{len(tools)} tools, above gateway.max_tools={cfg.max_tools}", "tools")
    names: set[str] = set()
    chars = 0
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolRefused(f"{where} must be {{type: 'function', function: {{name, ...}}}}", where)
        extra = sorted(set(tool) - _TOOL_KEYS)
        if extra:
            raise ToolRefused(f"{where}.{short(extra[0])} is not accepted; a tool has only type and function", where)
        function = tool["function"]
        extra = sorted(set(function) - _FUNCTION_KEYS)
        if extra:
            raise ToolRefused(
                f"{where}.function.{short(extra[0])} is not accepted; a function has only {sorted(_FUNCTION_KEYS)}",
                where,
            )
        name = function.get("name")
        if not isinstance(name, str) or TOOL_NAME.fullmatch(name) is None:
            raise ToolRefused(
                f"{where}.function.name {str(name)[:80]!r} must match ^[A-Za-z0-9_-]{{1,64}}$", f"{where}.function.name"
            )
        if name in names:
            raise ToolRefused(f"{where}.function.name {name!r} is offered twice", f"{where}.function.name")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolRefused(f"{where}.function.description must be a string", f"{where}.function.description")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolRefused(f"{where}.function.strict must be true or false", f"{where}.function.strict")
        size = _utf8_len(_compact(function))
        if size > cfg.max_tool_schema_bytes:
            raise ToolRefused(
                f"{where}.function is {size} bytes, above gateway.max_tool_schema_bytes={cfg.max_tool_schema_bytes}",
                where,
            )
        chars += size
    # The cheap bound before the costly one: validating schemas takes ~3 s of CPU per MiB, so definitions that
    # cannot fit in the prompt are refused before any is validated.
    if chars > cfg.max_prompt_chars:
        raise ToolRefused(
            f"tool definitions hold {chars} characters, above gateway.max_prompt_chars={cfg.max_prompt_chars}", "tools"
        )
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        if parameters is not None:
            check_schema(parameters, f"tools.{i}.function.parameters")
    return frozenset(names), chars


def check_schema(schema: Any, where: str) -> None:
    """A JSON Schema object valid against its meta-schema and not a bare self-reference; ToolRefused at ``where``."""
    if not isinstance(schema, dict):
        raise ToolRefused(f"{where} must be a JSON Schema object", where)
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        raise ToolRefused(f"{where}.$schema must be a string (a JSON Schema dialect URI)", f"{where}.$schema")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as err:
        at = "/".join(short(p) for p in err.absolute_path)  # a property name may be 15 kB long
        raise ToolRefused(f"{where} is not a valid JSON Schema{f' at {at}' if at else ''}: {err.message[:200]}", where)
    except (ValueError, TypeError, LookupError, ArithmeticError, RecursionError) as err:
        # e.g. a $schema URL the parser refuses, a pattern "a{99999999999}" that overflows re
        raise ToolRefused(f"{where} is not a valid JSON Schema: {type(err).__name__}: {str(err)[:160]}", where)
    cycle = ref_cycle(schema)
    if cycle is not None:
        raise ToolRefused(
            f"{where} refers to itself through {cycle[:100]!r} with nothing in between: no arguments can match it",
            where,
        )
    remote = outside_ref(schema)
    if remote is not None:
        raise ToolRefused(
            f"{where} refers outside itself ($ref {remote[:100]!r}): only local references ('#', '#/$defs/...') "
            "are taken, no schema is fetched",
            where,
        )
    dangling = dangling_ref(schema)
    if dangling is not None:
        raise ToolRefused(f"{where} refers to nothing: $ref {dangling[:100]!r} is not in the schema", where)


def check_tool_choice(choice: Any, names: frozenset[str] | None) -> None:
    """``tool_choice``: ``none`` / ``auto`` / ``required`` or ``{type: 'function', function: {name}}`` naming an
    offered tool; only with ``tools`` (``names`` None: the request offers none).

    Raises:
        ToolRefused: param ``tool_choice``.
    """
    if choice is None:
        return
    if names is None:
        raise ToolRefused("field 'tool_choice' needs 'tools': offer the tools it chooses from", "tool_choice")
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise ToolRefused(
                f"field 'tool_choice' {choice[:40]!r} is not one of {sorted(TOOL_CHOICES)} or a named function",
                "tool_choice",
            )
        return
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or set(choice) != {"type", "function"}
        or choice["type"] != "function"
        or not isinstance(function, dict)
        or set(function) != {"name"}
        or not isinstance(function["name"], str)
    ):
        raise ToolRefused(
            "field 'tool_choice' must be 'none', 'auto', 'required' or {type: 'function', function: {name}}",
            "tool_choice",
        )
    if function["name"] not in names:
        raise ToolRefused(
            f"field 'tool_choice' names {str(function['name'])[:80]!r}, which is not one of the offered tools",
            "tool_choice",
        )


@dataclass
class ToolHistory:
    """What the messages of one request said about tools so far (filled message by message, in order)."""

    calls: int = 0
    chars: int = 0
    call_ids: set[str] = field(default_factory=set)


def check_message_tools(message: dict[str, Any], where: str, history: ToolHistory, cfg: GatewayConfig) -> None:
    """The tool parts of one message: ``tool_calls`` only on assistant messages (each ``{id, type:
    'function', function: {name, arguments}}``, arguments text within ``gateway.max_tool_arguments_bytes``,
    all messages together within ``gateway.max_tool_calls``); ``tool_call_id`` on ``tool`` messages only,
    naming a tool call of an earlier assistant message; the :data:`NULL_ONLY_KEYS` null.

    Raises:
        ToolRefused: param = the path of the field (``messages.3.tool_calls.0.function.arguments``).
    """
    role = message.get("role")
    for key in NULL_ONLY_KEYS & message.keys():
        if message[key] not in (None, []):
            raise ToolRefused(
                f"{where}.{key} is not accepted (only null): this gateway serves no {key}", f"{where}.{key}"
            )
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        if role != "assistant":
            raise ToolRefused(f"{where}.tool_calls: only assistant messages carry tool calls", f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise ToolRefused(f"{where}.tool_calls must be a list of tool calls", f"{where}.tool_calls")
        history.calls += len(calls)
        if history.calls > cfg.max_tool_calls:
            raise ToolRefused(
                f"the messages hold more than gateway.max_tool_calls={cfg.max_tool_calls} tool calls",
                f"{where}.tool_calls",
            )
        for j, call in enumerate(calls):
            history.chars += _check_call(call, f"{where}.tool_calls.{j}", history, cfg)
    call_id = message.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str) or not 1 <= len(call_id) <= MAX_ID_CHARS:
            raise ToolRefused(
                f"{where}.tool_call_id must be the id (1-{MAX_ID_CHARS} characters) of the tool call it answers",
                f"{where}.tool_call_id",
            )
        if call_id not in history.call_ids:
            raise ToolRefused(
                f"{where}.tool_call_id {call_id[:80]!r} answers no tool call of an earlier assistant message",
                f"{where}.tool_call_id",
            )
    elif call_id is not None:
        raise ToolRefused(f"{where}.tool_call_id: only tool messages carry a tool_call_id", f"{where}.tool_call_id")


def _check_call(call: Any, where: str, history: ToolHistory, cfg: GatewayConfig) -> int:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ToolRefused(f"{where} must be {{id, type: 'function', function: {{name, arguments}}}}", where)
    extra = sorted(set(call) - _CALL_KEYS) or sorted(set(call["function"]) - _CALL_FUNCTION_KEYS)
    if extra:
        raise ToolRefused(f"{where}: {short(extra[0])!r} is not accepted in a tool call", where)
    if call.get("type", "function") != "function":
        raise ToolRefused(f"{where}.type must be 'function'", f"{where}.type")
    call_id = call.get("id")
    if not isinstance(call_id, str) or not 1 <= len(call_id) <= MAX_ID_CHARS:
        raise ToolRefused(f"{where}.id must be a string of 1-{MAX_ID_CHARS} characters", f"{where}.id")
    history.call_ids.add(call_id)
    name, arguments = call["function"].get("name"), call["function"].get("arguments")
    # The model may have called a name off the pattern: a client replaying its history is not refused for that.
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise ToolRefused(f"{where}.function.name must be a string of 1-64 characters", f"{where}.function.name")
    if not isinstance(arguments, str):
        raise ToolRefused(
            f"{where}.function.arguments must be a string (the arguments as JSON text)", f"{where}.function.arguments"
        )
    size = _utf8_len(arguments)
    if size > cfg.max_tool_arguments_bytes:
        raise ToolRefused(
            f"{where}.function.arguments is {size} bytes, above gateway.max_tool_arguments_bytes="
            f"{cfg.max_tool_arguments_bytes}",
            f"{where}.function.arguments",
        )
    depth = json_depth(arguments)
    if depth > MAX_ARGUMENT_DEPTH:
        raise ToolRefused(
            f"{where}.function.arguments nests {depth} arrays or objects deep, above {MAX_ARGUMENT_DEPTH}",
            f"{where}.function.arguments",
        )
    return len(name) + len(arguments)


def json_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (brackets inside strings do not count), read
    without recursion: vLLM parses a tool call's arguments to render the chat template, and JSON thousands
    deep ends there in a RecursionError (a 500) however few bytes it takes."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def forwarded_message(message: dict[str, Any]) -> dict[str, Any]:
    """A checked message as it goes upstream and into the trace: the null-only keys and an empty
    ``tool_calls`` dropped (the same message whether the app built it or appended the SDK's object)."""
    if not (NULL_ONLY_KEYS & message.keys()) and message.get("tool_calls") != []:
        return message
    return {k: v for k, v in message.items() if k not in NULL_ONLY_KEYS and not (k == "tool_calls" and v == [])}


# What a schema's references are read against. Values of these keywords are data, not schemas (a "$ref" inside a
# const or an example is text); values of these maps are schemas by name (a property may be called "const").
_DATA_KEYWORDS = frozenset({"const", "enum", "examples", "default"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Keywords that apply their schemas to the same instance, in place: a loop through these (and $ref) and nothing
# else validates an instance against itself forever, and compiles into a grammar rule that consumes nothing.
_IN_PLACE_LISTS = ("allOf", "anyOf", "oneOf")
_IN_PLACE_ONE = ("not", "if", "then", "else")


def _objects(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every schema object in ``schema``, the schema itself first, not looking into data keywords (a loop, not
    recursion: the schema is size-capped before, its depth is not)."""
    stack: list[tuple[Any, bool]] = [(schema, True)]  # (node, is it a schema; else a map of names to schemas)
    while stack:
        node, is_schema = stack.pop()
        if isinstance(node, list):
            stack.extend((v, True) for v in node)
        elif isinstance(node, dict) and not is_schema:
            stack.extend((v, True) for v in node.values())
        elif isinstance(node, dict):
            yield node
            stack.extend((v, k not in _SCHEMA_MAPS) for k, v in node.items() if k not in _DATA_KEYWORDS)


def _is_local(ref: str) -> bool:
    return ref == "" or ref.startswith("#")  # "" is the document itself, like "#"


def _resolve(schema: dict[str, Any], ref: str, anchors: dict[str, dict[str, Any]]) -> Any:
    """What a local reference of ``schema`` points at: a JSON pointer (``#``, ``#/$defs/a``, percent-encoded as a
    URI fragment is, then ``~1`` / ``~0``) or an anchor name (``#name``); None when nothing."""
    fragment = unquote(ref[1:]) if ref else ""
    if fragment and not fragment.startswith("/"):
        return anchors.get(fragment)
    node: Any = schema
    for part in fragment[1:].split("/") if fragment else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


@dataclass
class _References:
    """A schema's references: each ``(the object holding it, the reference)``, its anchors by name, and whether a
    nested ``$id`` changes the base some of them resolve against (then they are not followed here)."""

    refs: list[tuple[dict[str, Any], str]]
    anchors: dict[str, dict[str, Any]]
    nested_id: bool

    @classmethod
    def of(cls, schema: dict[str, Any]) -> _References:
        refs: list[tuple[dict[str, Any], str]] = []
        anchors: dict[str, dict[str, Any]] = {}
        nested_id = False
        for node in _objects(schema):
            nested_id |= node is not schema and isinstance(node.get("$id"), str)
            refs += [(node, ref) for key in ("$ref", "$dynamicRef") if isinstance(ref := node.get(key), str)]
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(name := node.get(key), str):
                    anchors.setdefault(name, node)
        return cls(refs, anchors, nested_id)


def outside_ref(schema: dict[str, Any]) -> str | None:
    """The first ``$ref`` / ``$dynamicRef`` of ``schema`` that is not a local one (``#...``): a URL, a file or a
    relative name, which a grammar backend would have to fetch or could not resolve. None when every one is local."""
    return next((ref for _, ref in _References.of(schema).refs if not _is_local(ref)), None)


def dangling_ref(schema: dict[str, Any]) -> str | None:
    """The first local reference of ``schema`` that points at nothing (``#/$defs/missing``, or ``#name`` with no
    ``$anchor`` of that name) or at a value that is no schema (``#/minimum``): vLLM cannot compile such a schema into a grammar. None when every one resolves,
    and when a nested ``$id`` changes the base a reference resolves against (not followed here)."""
    found = _References.of(schema)
    if found.nested_id:
        return None
    for _, ref in found.refs:
        if _is_local(ref) and not isinstance(_resolve(schema, ref, found.anchors), (dict, bool)):
            return ref  # nothing there, or a value that is no schema (#/minimum, #/required/0)
    return None


def ref_cycle(schema: dict[str, Any]) -> str | None:
    """A reference of ``schema`` that leads back to where it started with nothing consumed in between: only
    through references and keywords that apply to the same value (``allOf``, ``anyOf``, ``oneOf``, ``not``,
    ``if`` / ``then`` / ``else``, ``dependentSchemas``), never a property or an item (``{"$ref": "#"}``,
    ``{"$ref": "#", "type": "object"}``, ``{"allOf": [{"$ref": "#"}]}``). Validating a value against it never
    ends, and vLLM's grammar for it accepts no token (a bare self-reference was a 500). Returns the reference
    (or keyword) that closes the loop, or None. One depth-first pass over the schema's objects: linear in its
    size (a chain of 560 references in each of 12 tools took 2.8 s when each was followed from every link)."""
    found = _References.of(schema)
    refs_of: dict[int, list[str]] = {}
    for node, ref in found.refs if not found.nested_id else []:
        if _is_local(ref):
            refs_of.setdefault(id(node), []).append(ref)

    def next_in_place(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
        yield from ((ref, _resolve(schema, ref, found.anchors)) for ref in refs_of.get(id(node), []))
        for key in _IN_PLACE_LISTS:
            if isinstance(node.get(key), list):
                yield from ((key, v) for v in node[key])
        for key in _IN_PLACE_ONE:
            yield key, node.get(key)
        if isinstance(node.get("dependentSchemas"), dict):
            yield from (("dependentSchemas", v) for v in node["dependentSchemas"].values())

    state: dict[int, bool] = {}  # id -> True while on the current path, False once every way out of it is done
    for root in _objects(schema):
        if id(root) in state:
            continue
        state[id(root)] = True
        path = [(id(root), next_in_place(root))]
        while path:
            for label, target in path[-1][1]:
                if not isinstance(target, dict):
                    continue
                seen = state.get(id(target))
                if seen:  # back on the current path: a loop that consumes nothing
                    return label
                if seen is None:
                    state[id(target)] = True
                    path.append((id(target), next_in_place(target)))
                    break
            else:
                state[path.pop()[0]] = False
    return None
