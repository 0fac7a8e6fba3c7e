"""Tool calling and conversations through the gateway, in process (the real app, an in-memory model server,
a recording sink): what passes unchanged, what is refused with a 400 naming the field (and never reaches the
model server), what the trace records, and how turns of one conversation are linked.

The same paths against a real vLLM (hermes parser, SmolLM2's tools template) and the official ``openai``
client are in ``test_gateway_tools_vllm.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from connectors.config import GatewayConfig
from connectors.gateway import tools as gateway_tools
from connectors.gateway.app import TRACE_HEADER
from connectors.gateway.conversation import ConversationLinker
from tests.connectors.gateway.gateway_fakes import FakeSink
from tests.connectors.gateway.test_gateway_logic import Gateway, Keys, error, keys, make_gateway  # noqa: F401

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
TURN_1 = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 2+3?"}]


def tool_reply(body: dict[str, Any]) -> httpx.Response:
    """vLLM's answer with auto tool choice: one tool call (or, after a tool result, text), token ids, usage."""
    answered = any(m.get("role") == "tool" for m in body["messages"])
    message: dict[str, Any] = {"role": "assistant", "content": "5" if answered else None, "refusal": None}
    if not answered:
        message["tool_calls"] = [{**CALL, "id": f"call_{len(body['messages'])}"}]
    if body.get("stream"):
        delta_calls = [
            {"index": 0, "id": "call_s", "type": "function", "function": {"name": "add", "arguments": ""}},
            {"index": 0, "function": {"arguments": '{"a": 2, '}},
            {"index": 0, "function": {"arguments": '"b": 3}'}},
        ]
        chunks = [
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "model": body["model"],
                "prompt_token_ids": [1, 2, 3],
                "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": [], "finish_reason": None}
                ],
            },
        ]
        for n, call in enumerate(delta_calls):
            chunks.append(
                {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"tool_calls": [call]},
                            "token_ids": [40 + n],
                            "logprobs": {"content": [{"token": "t", "logprob": -0.5}]},
                            "finish_reason": None,
                        }
                    ],
                }
            )
        chunks[-1]["choices"][0]["finish_reason"] = "tool_calls"
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})
    return httpx.Response(
        200,
        json={
            "id": "x",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "token_ids": [31, 32, 33],
                    "finish_reason": "stop" if answered else "tool_calls",
                    "logprobs": {"content": [{"token": "t", "logprob": -0.5}] * 3},
                }
            ],
            "prompt_token_ids": [1, 2, 3, 4],
            "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
        },
    )


@pytest.fixture
def gw(keys: Keys) -> Iterator[Gateway]:  # noqa: F811
    sink = FakeSink()
    http, upstream = make_gateway(keys, sink, gateway=GatewayConfig(max_tools=4, max_tool_calls=3))
    upstream.reply = tool_reply
    with http:
        yield Gateway(http, upstream, sink, keys)


def chat(gw: Gateway, messages: list[dict[str, Any]], key: str | None = None, **extra: Any) -> httpx.Response:
    body = {"model": "hourglass", "messages": messages, "max_tokens": 8, "tools": [ADD], **extra}
    return gw.post("/v1/chat/completions", body, gw.keys.client if key is None else key)


def test_tools_pass_through_both_ways_and_the_trace_records_the_turn(gw: Gateway) -> None:
    first = chat(gw, TURN_1, tool_choice="auto", parallel_tool_calls=False)
    assert first.status_code == 200, first.text
    sent = gw.upstream.requests[-1]["body"]
    assert sent["tools"] == [ADD] and sent["tool_choice"] == "auto" and sent["parallel_tool_calls"] is False
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"  # relayed as vLLM sent it
    assert choice["message"]["tool_calls"] == [{**CALL, "id": "call_2"}] and choice["message"]["content"] is None
    trace = gw.trace(first)
    assert trace.schema_ == "hourglass.trace/v2"
    assert [t.model_dump(exclude_none=True) for t in trace.tools or []] == [ADD]
    assert [c.model_dump() for c in trace.completion_tool_calls or []] == [{**CALL, "id": "call_2"}]
    assert (trace.finish_reason, trace.prompt_token_ids, trace.completion_token_ids) == (
        "tool_calls",
        [1, 2, 3, 4],
        [31, 32, 33],
    )
    assert trace.usage is not None and (trace.usage.prompt_tokens, trace.usage.completion_tokens) == (4, 3)
    assert (trace.turn, trace.parent_trace_id) == (0, None) and trace.conversation_id.startswith("conv-")
    assert trace.metadata["tool_choice"] == "auto" and trace.metadata["parallel_tool_calls"] is False

    # The app runs the tool and sends the result back, appending the SDK's message object (null extras).
    answer = {**choice["message"], "annotations": None, "audio": None, "function_call": None, "reasoning": None}
    messages = [*TURN_1, answer, {"role": "tool", "tool_call_id": "call_2", "content": "5"}]
    second = chat(gw, messages)
    assert second.status_code == 200, second.text
    forwarded = gw.upstream.requests[-1]["body"]["messages"]
    assert forwarded[2] == {"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": "call_2"}]}
    assert forwarded[3] == {"role": "tool", "tool_call_id": "call_2", "content": "5"}
    follow = gw.trace(second)
    assert (follow.turn, follow.parent_trace_id, follow.conversation_id) == (1, trace.trace_id, trace.conversation_id)
    assert follow.completion == "5" and follow.completion_tool_calls is None and follow.finish_reason == "stop"
    assert [m["role"] for m in follow.messages()] == ["system", "user", "assistant", "tool"]


def test_a_streamed_tool_call_is_relayed_unchanged_and_assembled_in_the_trace(gw: Gateway) -> None:
    response = chat(gw, TURN_1, stream=True)
    assert response.status_code == 200
    lines = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in lines if c["choices"][0]["delta"].get("tool_calls")]
    assert [d[0]["function"].get("arguments") for d in deltas] == ["", '{"a": 2, ', '"b": 3}']
    assert lines[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for c in lines)  # not asked for
    trace = gw.trace(response)
    assert [c.model_dump() for c in trace.completion_tool_calls or []] == [
        {"id": "call_s", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    ]
    assert trace.prompt_token_ids == [1, 2, 3] and trace.completion_token_ids == [40, 41, 42]
    assert trace.completion_logprobs == [-0.5] * 3 and trace.finish_reason == "tool_calls"
    assert trace.usage is not None and (trace.usage.prompt_tokens, trace.usage.completion_tokens) == (3, 3)


BIG = {"type": "function", "function": {"name": "big", "description": "x" * 20_000}}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": "add"}, "tools"),
        ({"tools": []}, "tools"),
        ({"tools": [ADD] * 5}, "tools"),  # gateway.max_tools = 4 here
        ({"tools": [{"type": "function", "function": {"name": "add two"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools.0.function.name"),
        ({"tools": [ADD, ADD]}, "tools.1.function.name"),
        ({"tools": [BIG]}, "tools.0"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0"),
        ({"tools": [{**ADD, "cache": True}]}, "tools.0"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools.0.function.parameters"),
        # a $schema that is not a string, or a URL jsonschema's parser refuses: was a 500 from jsonschema
        *(
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": bad}}}]}, param)
            for bad, param in [
                (True, "tools.0.function.parameters.$schema"),
                ([], "tools.0.function.parameters.$schema"),
                ({}, "tools.0.function.parameters.$schema"),
                ("http://[::1", "tools.0.function.parameters"),
            ]
        ),
        *(  # a reference outside the schema: no schema is fetched (was accepted; a backend might resolve it)
            (
                {"tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}]},
                "tools.0.function.parameters",
            )
            for bad in [
                {"$ref": "http://169.254.169.254/latest/meta-data"},
                {"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}},
                {"$defs": {"a": {"$dynamicRef": "other.json#x"}}},
            ]
        ),
        *(  # a local reference to nothing: vLLM cannot compile it (was accepted)
            (
                {"tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}]},
                "tools.0.function.parameters",
            )
            for bad in [
                {"$ref": "#/$defs/missing"},
                {"type": "object", "properties": {"a": {"$ref": "#/properties/b"}}},
                {"type": "object", "properties": {"a": {"$ref": "#no-such-anchor"}}},
                {"$defs": {"a": {"prefixItems": [{"$ref": "#/$defs/a/prefixItems/1"}]}}, "$ref": "#/$defs/a"},
                {"minimum": 1, "properties": {"a": {"$ref": "#/minimum"}}},  # a value, no schema
                {"required": ["a"], "properties": {"a": {"$ref": "#/required/0"}}},
            ]
        ),
        (  # a pattern whose repeat count overflows Python's re: was an OverflowError, a 500
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"pattern": "a{99999999999}"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools.0.function.strict"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "add", "x": 1}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"metadata": {"conversation_id": 7}}, "metadata.conversation_id"),
    ],
)
def test_bad_tool_fields_are_a_400_naming_the_field_and_never_reach_vllm(
    gw: Gateway, change: dict[str, Any], param: str
) -> None:
    body = {"model": "hourglass", "messages": TURN_1, "max_tokens": 8, "tools": [ADD], **change}
    body = {k: v for k, v in body.items() if v is not None}
    response = gw.post("/v1/chat/completions", body, gw.keys.client)
    assert response.status_code == 400, response.text
    assert error(response)["param"] == param, error(response)
    assert gw.upstream.requests == []


ANSWERED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "5"}


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (
            [*TURN_1, {**ANSWERED, "tool_calls": [{**CALL, "function": {"name": "add", "arguments": "x" * 20_000}}]}],
            "messages.2.tool_calls.0.function.arguments",
        ),
        (
            [*TURN_1, {**ANSWERED, "tool_calls": [{**CALL, "function": {"name": "add", "arguments": {"a": 1}}}]}],
            "messages.2.tool_calls.0.function.arguments",
        ),
        (  # 10 KB of brackets, within the byte cap: vLLM's parser recursed into a 500 on it
            [
                *TURN_1,
                {
                    **ANSWERED,
                    "tool_calls": [{**CALL, "function": {"name": "add", "arguments": "[" * 5000 + "]" * 5000}}],
                },
            ],
            "messages.2.tool_calls.0.function.arguments",
        ),
        ([*TURN_1, {**ANSWERED, "tool_calls": [{**CALL, "id": "c" * 257}]}], "messages.2.tool_calls.0.id"),
        ([*TURN_1, {**ANSWERED, "tool_calls": [{**CALL, "id": f"c{i}"} for i in range(4)]}], "messages.2.tool_calls"),
        ([*TURN_1, {**ANSWERED, "tool_calls": [{**CALL, "type": "code"}]}], "messages.2.tool_calls.0.type"),
        ([*TURN_1, {**ANSWERED, "tool_calls": [{**CALL, "extra": 1}]}], "messages.2.tool_calls.0"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages.0.tool_calls"),
        ([*TURN_1, ANSWERED, {"role": "tool", "content": "5"}], "messages.3.tool_call_id"),
        ([*TURN_1, ANSWERED, {**RESULT, "tool_call_id": "call_9"}], "messages.3.tool_call_id"),
        ([*TURN_1, {**RESULT}], "messages.2.tool_call_id"),  # a result before any call
        ([{"role": "user", "content": "x", "tool_call_id": "call_1"}], "messages.0.tool_call_id"),
        ([*TURN_1, {**ANSWERED, "refusal": "I will not"}], "messages.2.refusal"),
        ([*TURN_1, {**ANSWERED, "audio": {"id": "a"}}], "messages.2.audio"),
    ],
)
def test_bad_tool_messages_are_a_400_naming_the_field(gw: Gateway, messages: list[dict[str, Any]], param: str) -> None:
    response = chat(gw, messages)
    assert response.status_code == 400, response.text
    assert error(response)["param"] == param, error(response)
    assert gw.upstream.requests == []


def test_tool_definitions_count_toward_the_prompt_size(keys: Keys) -> None:  # noqa: F811
    sink = FakeSink()
    http, upstream = make_gateway(keys, sink, gateway=GatewayConfig(max_prompt_chars=200))
    with http:
        gw = Gateway(http, upstream, sink, keys)
        small = chat(gw, [{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "f"}}])
        assert small.status_code == 200
        big_tools = [{"type": "function", "function": {"name": "f", "description": "d" * 250}}]
        big = chat(gw, [{"role": "user", "content": "hi"}], tools=big_tools)  # the tools alone do not fit
        assert big.status_code == 400 and error(big)["param"] == "tools", big.text
        assert "tool definitions hold" in error(big)["message"]
        fit_tools = [{"type": "function", "function": {"name": "f", "description": "d" * 120}}]
        both = chat(gw, [{"role": "user", "content": "m" * 100}], tools=fit_tools)  # each fits, together they do not
        assert both.status_code == 400 and error(both)["param"] == "messages", both.text
        assert "tool definitions" in error(both)["message"]
        assert len(upstream.requests) == 1  # only the small request went upstream


# --- conversations ------------------------------------------------------------------------------------


def plain(gw: Gateway, messages: list[dict[str, Any]], key: str | None = None, **extra: Any) -> Any:
    """A chat without tools through ``gw``; returns its trace."""
    gw.upstream.reply = lambda body: httpx.Response(
        200,
        json={
            "id": "x",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "4"},
                    "token_ids": [9],
                    "finish_reason": "stop",
                }
            ],
            "prompt_token_ids": [1],
        },
    )
    body = {"model": "hourglass", "messages": messages, "max_tokens": 4, **extra}
    response = gw.post("/v1/chat/completions", body, gw.keys.client if key is None else key)
    assert response.status_code == 200, response.text
    return gw.trace(response)


def test_turns_of_one_conversation_are_linked_regenerations_are_siblings_and_edits_branch(gw: Gateway) -> None:
    opening = [{"role": "user", "content": "2+2?"}]
    first = plain(gw, opening)
    answer = {"role": "assistant", "content": "4"}
    second = plain(gw, [*opening, answer, {"role": "user", "content": "and 3+3?"}])
    assert (second.conversation_id, second.turn, second.parent_trace_id) == (first.conversation_id, 1, first.trace_id)
    again = plain(gw, [*opening, answer, {"role": "user", "content": "and 3+3?"}])  # regenerated: a sibling
    assert (again.parent_trace_id, again.turn) == (first.trace_id, 1)
    third = plain(
        gw, [*opening, answer, {"role": "user", "content": "and 3+3?"}, answer, {"role": "user", "content": "ok"}]
    )
    assert (third.parent_trace_id, third.turn) == (again.trace_id, 2)  # the latest answer of that prompt
    # the app edited the model's earlier answer: same conversation, no parent (no served answer matches)
    edited = plain(gw, [*opening, {"role": "assistant", "content": "four"}, {"role": "user", "content": "sure?"}])
    assert (edited.conversation_id, edited.parent_trace_id, edited.turn) == (first.conversation_id, None, 1)
    # a different first question is another conversation
    other = plain(gw, [{"role": "user", "content": "3+3?"}])
    assert other.conversation_id != first.conversation_id and other.parent_trace_id is None
    # the request's metadata continues to travel under metadata.client
    assert second.metadata["conversation"]["continues"] == first.metadata["conversation"]["answer"]


def test_keys_never_link_into_each_others_conversations(gw: Gateway) -> None:
    opening = [{"role": "user", "content": "2+2?"}]
    mine = plain(gw, opening)
    theirs = plain(
        gw, [*opening, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x"}], key=gw.keys.grader
    )
    assert theirs.parent_trace_id is None and theirs.conversation_id != mine.conversation_id
    user_a = plain(gw, opening, user="a")
    user_b = plain(gw, opening, user="b")
    assert len({mine.conversation_id, user_a.conversation_id, user_b.conversation_id}) == 3  # per end user too


def test_a_client_conversation_id_is_a_hint_inside_its_key_only(gw: Gateway) -> None:
    hinted = plain(gw, [{"role": "user", "content": "hi"}], metadata={"conversation_id": "chat-42"})
    later = plain(gw, [{"role": "user", "content": "another opening"}], metadata={"conversation_id": "chat-42"})
    assert hinted.conversation_id == later.conversation_id != "chat-42"
    derived = plain(gw, [{"role": "user", "content": "hi"}])
    assert derived.conversation_id != hinted.conversation_id
    foreign = plain(
        gw, [{"role": "user", "content": "hi"}], key=gw.keys.grader, metadata={"conversation_id": "chat-42"}
    )
    assert foreign.conversation_id != hinted.conversation_id
    assert hinted.metadata["client"]["conversation_id"] == "chat-42"  # the hint itself stays client metadata


def test_remembered_answers_expire_and_are_bounded() -> None:
    now = [0.0]
    linker = ConversationLinker(b"k" * 32, entries=2, ttl_s=60, clock=lambda: now[0])
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    for i, prompt in enumerate(prompts):
        _, prompt_hash = linker.link("ns", prompt, None)
        linker.remember(prompt_hash.with_answer({"role": "assistant", "content": "a"}), f"t{i}")

    def parent(i: int) -> str | None:
        return linker.link("ns", [*prompts[i], {"role": "assistant", "content": "a"}], None)[0].parent_trace_id

    assert [parent(i) for i in range(3)] == [None, "t1", "t2"]  # the oldest went first
    now[0] = 61.0
    assert parent(2) is None  # expired
    assert ConversationLinker(b"k" * 32, entries=0, ttl_s=60).link("ns", prompts[0], None)[0].parent_trace_id is None


def test_the_trace_header_is_the_trace_id(gw: Gateway) -> None:
    response = chat(gw, TURN_1)
    assert gw.trace(response).trace_id == response.headers[TRACE_HEADER]


@pytest.mark.parametrize("name", [["add"], {}, 5, None])
def test_a_named_tool_choice_whose_name_is_not_a_string_is_a_400(name: object) -> None:
    from connectors.gateway.tools import ToolRefused, check_tool_choice

    with pytest.raises(ToolRefused) as refused:
        check_tool_choice({"type": "function", "function": {"name": name}}, frozenset({"add"}))
    assert refused.value.param == "tool_choice"


def test_argument_depth_counts_brackets_outside_strings_only() -> None:
    from connectors.gateway.tools import MAX_ARGUMENT_DEPTH, json_depth

    assert (
        json_depth('{"a": [1, {"b": "[[[[\\"]]"}]}') == 3
    )  # the brackets in the string (and its escaped quote) are text
    assert json_depth('"x"') == 0 and json_depth("{}") == 1
    deep = "[" * MAX_ARGUMENT_DEPTH + "]" * MAX_ARGUMENT_DEPTH
    assert json_depth(deep) == MAX_ARGUMENT_DEPTH and json_depth(f"[{deep}]") == MAX_ARGUMENT_DEPTH + 1


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"n": {"type": "number"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
        {"definitions": {"n~/m": {"type": "number"}}, "properties": {"a": {"$ref": "#/definitions/n~0~1m"}}},
        {"$defs": {"n": {"$anchor": "num", "type": "number"}}, "properties": {"a": {"$ref": "#num"}}},
        {"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#"}}}},  # recursion with content
        {"prefixItems": [{"type": "string"}, {"$ref": "#/prefixItems/0"}]},
    ],
)
def test_schemas_whose_references_resolve_are_taken(schema: dict[str, Any]) -> None:
    gateway_tools.check_schema(schema, "tools.0.function.parameters")  # no ToolRefused


def test_a_reference_to_nothing_is_named_in_the_refusal() -> None:
    with pytest.raises(gateway_tools.ToolRefused) as err:
        gateway_tools.check_schema({"properties": {"a": {"$ref": "#/$defs/gone"}}}, "tools.0.function.parameters")
    assert "'#/$defs/gone' is not in the schema" in str(err.value)
    assert err.value.param == "tools.0.function.parameters"


@pytest.mark.parametrize(
    "schema",
    [  # loops that consume nothing, which the bare-reference check missed (helper-30); each was forwarded
        {"$anchor": "r", "$ref": "#r"},
        {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#", "type": "object"},
        {"$ref": "#", "type": "object"},
        {"allOf": [{"$ref": "#"}]},
        {"anyOf": [{"type": "string"}, {"$ref": "#"}]},
        {"not": {"$ref": "#"}},
        {"$dynamicAnchor": "r", "$dynamicRef": "#r"},
        {"type": "object", "properties": {"a": {"$ref": ""}}, "if": {"$ref": ""}},
        {"$defs": {"a": {"oneOf": [{"$ref": "#/$defs/b"}]}, "b": {"then": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"},
    ],
)
def test_a_schema_that_loops_back_to_itself_in_place_is_refused(gw: Gateway, schema: dict[str, Any]) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"model": "hourglass", "messages": TURN_1, "max_tokens": 8, "tools": [tool]}
    response = gw.post("/v1/chat/completions", body, gw.keys.client)
    assert response.status_code == 400 and "refers to itself" in error(response)["message"], response.text
    assert gw.upstream.requests == []


@pytest.mark.parametrize(
    "schema",
    [  # valid schemas the checks refused (helper-30): data keywords hold text, not schemas; URI-encoded pointers
        {"type": "object", "const": {"$ref": "https://x/y"}},
        {"type": "object", "examples": [{"$ref": "#/definitions/X"}]},
        {"enum": [{"$ref": "#/nope"}, 1]},
        {"type": "object", "default": {"$ref": "#/nope"}},
        {"$defs": {"a b": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/a%20b"}}},
        {"$defs": {"Foo[int]": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/Foo%5Bint%5D"}}},
        {"$defs": {"a": {"type": "string"}}, "properties": {"x": {"$ref": "#/%24defs/a"}}},
        {"type": "object", "properties": {"child": {"$ref": ""}}},  # "" is the document: recursion with content
        {
            "$defs": {"node": {"anyOf": [{"type": "null"}, {"properties": {"next": {"$ref": "#/$defs/node"}}}]}},
            "$ref": "#/$defs/node",
        },
    ],
)
def test_valid_schemas_with_references_in_data_or_encoded_pointers_are_taken(schema: dict[str, Any]) -> None:
    gateway_tools.check_schema(schema, "tools.0.function.parameters")  # no ToolRefused


def test_a_property_named_like_a_data_keyword_is_still_a_schema() -> None:
    with pytest.raises(gateway_tools.ToolRefused, match="refers to nothing"):
        gateway_tools.check_schema({"properties": {"const": {"$ref": "#/$defs/nope"}}}, "p")


def test_a_long_chain_of_references_is_checked_in_one_pass() -> None:
    """Each link was followed from every link: 12 tools of 560 links took 2.8 s of the event loop (helper-30).
    6,000 links: well under a second in one pass, minutes the old way."""
    import time

    links = 6_000
    schema = {"$defs": {str(i): {"$ref": f"#/$defs/{i + 1}"} for i in range(links)}}
    schema["$defs"][str(links)] = {"type": "string"}
    started = time.perf_counter()
    assert gateway_tools.ref_cycle(schema) is None
    schema["$defs"][str(links)] = {"$ref": "#/$defs/0"}  # close the loop
    assert gateway_tools.ref_cycle(schema) is not None
    assert time.perf_counter() - started < 5.0


def test_a_schema_error_names_a_long_property_cut(gw: Gateway) -> None:
    """The meta-schema error's path held a 15 kB property name in full (a 15 kB error; helper-30)."""
    schema = {"type": "object", "properties": {"k" * 15_000: {"type": 5}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    response = gw.post(
        "/v1/chat/completions", {"model": "hourglass", "messages": TURN_1, "tools": [tool]}, gw.keys.client
    )
    assert response.status_code == 400, response.text
    assert len(response.content) < 2_000, f"{len(response.content)} bytes"
