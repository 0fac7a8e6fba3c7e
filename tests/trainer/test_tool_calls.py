"""Tool calls read from generated text (the Hermes format vLLM's ``hermes`` parser reads) and the built-in
tool-call rewards: JSON, the tool exists, the arguments validate against its schema."""

from __future__ import annotations

import json

import pytest

from trainer.tool_calls import hermes_tool_calls, tool_call_exists, tool_call_json, tool_call_valid

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
FREE = {"type": "function", "function": {"name": "now"}}  # no parameters schema: any object
META = {"tools": [ADD, FREE]}


def call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_blocks_are_read_in_order_including_an_unclosed_last_one() -> None:
    text = (
        "Let me add.\n"
        + call('{"name": "add", "arguments": {"a": 2, "b": 3}}')
        + '\n<tool_call>\n{"name": "now", "arguments": "{}"}'
    )
    calls = hermes_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 2, "b": 3}, None), ("now", {}, None)]
    assert hermes_tool_calls("no call here") == []
    broken = hermes_tool_calls(
        call('{"name": "add", "arguments": {"a": 2,') + call('["add"]') + call('{"name": "add", "arguments": 5}')
    )
    assert [c.error is not None for c in broken] == [True, True, True]


@pytest.mark.parametrize(
    ("completion", "json_ok", "exists", "valid"),
    [
        (call('{"name": "add", "arguments": {"a": 2, "b": 3}}'), 1.0, 1.0, 1.0),
        (call('{"name": "add", "arguments": {"a": 2, "b": "3"}}'), 1.0, 1.0, 0.0),  # wrong type
        (call('{"name": "add", "arguments": {"a": 2}}'), 1.0, 1.0, 0.0),  # missing required
        (call('{"name": "add", "arguments": {"a": 2, "b": 3, "c": 1}}'), 1.0, 1.0, 0.0),  # additional property
        (call('{"name": "mul", "arguments": {"a": 2, "b": 3}}'), 1.0, 0.0, 0.0),  # not offered
        (call('{"name": "now", "arguments": {"tz": "UTC"}}'), 1.0, 1.0, 1.0),  # no schema: any object
        (call('{"name": "add", "arguments": {"a": 2, "b": 3}'), 0.0, 0.0, 0.0),  # not JSON
        (
            call('{"name": "add", "arguments": {"a": 2, "b": 3}}') + call('{"name": "mul", "arguments": {}}'),
            1.0,
            0.0,
            0.0,
        ),
        ("5", 0.0, 0.0, 0.0),  # no call: no_call
    ],
)
def test_tool_call_rewards(completion: str, json_ok: float, exists: float, valid: float) -> None:
    assert tool_call_json([], completion, META) == json_ok
    assert tool_call_exists([], completion, META) == exists
    assert tool_call_valid([], completion, META) == valid


def test_no_call_is_a_setting_and_a_schema_that_cannot_be_evaluated_is_invalid_not_a_crash() -> None:
    assert tool_call_valid([], "5", META, no_call=0.5) == 0.5
    odd = {
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"$ref": "https://example.invalid/s.json"}}}
        ]
    }
    assert tool_call_valid([], call('{"name": "f", "arguments": {}}'), odd) == 0.0
    assert tool_call_valid([], call('{"name": "f", "arguments": {}}'), {"tools": []}) == 0.0


def test_the_tool_call_rewards_are_built_ins_a_candidate_can_name() -> None:
    from trainer.config import RewardTerm
    from trainer.rewards import build_reward

    mix = build_reward([RewardTerm(fn="tool_call_valid", weight=1.0)])
    assert mix([], call('{"name": "add", "arguments": {"a": 2, "b": 3}}'), META) == 1.0
    assert mix([], call('{"name": "add", "arguments": {"a": 2}}'), META) == 0.0


def test_nesting_past_the_json_parsers_limit_is_an_invalid_call_not_a_crash() -> None:
    from trainer.chat import template_messages

    deep = "[" * 8000 + "]" * 8000
    assert [c.error is not None for c in hermes_tool_calls(call(deep))] == [True]
    assert tool_call_valid([], call(deep), META) == 0.0
    history = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": deep}}],
        }
    ]
    assert template_messages(history)[0]["tool_calls"][0]["function"]["arguments"] == {}


def _fan_out(depth: int) -> dict:
    """A schema whose every level is two ``anyOf`` branches that ``$ref`` the next: 2**depth paths to try."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "$defs": defs}


@pytest.mark.parametrize(
    ("parameters", "arguments"),
    [
        (_fan_out(40), {"a": "x"}),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}, {"a": "a" * 40 + "!"}),
        ({"type": "object", "patternProperties": {"^(a|a)+$": {"type": "integer"}}}, {"a" * 40 + "!": 1}),
    ],
)
def test_a_schema_from_traffic_that_costs_exponential_time_is_an_invalid_call_not_a_hang(
    parameters: dict, arguments: dict
) -> None:
    """Found by a red-team pass: a client offers a tool whose schema makes validation exponential (anyOf branches
    that $ref the same next level, or a backtracking pattern) and has the model call it: tool_call_valid ran for
    hours, in a canary's monitors (holding the monitor's lock) or a round's rewards."""
    import time

    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    started = time.monotonic()
    valid = tool_call_valid([], call(json.dumps({"name": "f", "arguments": arguments})), {"tools": [tool]})
    assert valid == 0.0 and time.monotonic() - started < 10


def test_patterns_still_judge_arguments() -> None:
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"city": {"pattern": "^[A-Z]"}}}},
    }
    judge = lambda city: tool_call_valid(
        [], call(json.dumps({"name": "f", "arguments": {"city": city}})), {"tools": [tool]}
    )  # noqa: E731
    assert (judge("Paris"), judge("paris")) == (1.0, 0.0)


def test_long_legitimate_arguments_stay_within_the_step_budget() -> None:
    """The budget grows with the arguments' size: a 5000-item list of objects validates as before."""
    items = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}}, "required": ["x"]}
    schema = {"type": "object", "properties": {"rows": {"type": "array", "items": items}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    rows = [{"x": i} for i in range(5000)]
    text = call(json.dumps({"name": "f", "arguments": {"rows": rows}}))
    assert tool_call_valid([], text, {"tools": [tool]}) == 1.0
