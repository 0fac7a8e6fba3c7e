"""Against a real vLLM (tiny model): refused requests never reach vLLM (its own request counter
does not move), while an allowed one does; a request with no generation bound gets gateway.max_tokens. The hang-up abort is proven with a recording fake
upstream in test_gateway_attacks.py (the test vLLM runs with --disable-log-stats: no engine metrics)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from connectors.gateway.auth import KeyStore
from connectors.config import GatewayConfig, KafkaConfig
from connectors.gateway.app import TRACE_HEADER, create_gateway_app
from tests.connectors.gateway.gateway_fakes import FakeSink, serve, wait_for

BODY = {"model": "hourglass", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 2}


def vllm_chat_requests(url: str) -> float:
    """Chat requests vLLM's HTTP server has answered (any status), from its ``http_requests_total``."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "http_requests_total" and sample.labels.get("handler") == "/v1/chat/completions":
                total += sample.value
    return total


@pytest.fixture(scope="module")
def setup(vllm_tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    keys = KeyStore(tmp_path_factory.mktemp("keys") / "gateway-keys.json")
    _, key = keys.create("client")
    app = create_gateway_app(
        KafkaConfig(bootstrap_servers=["127.0.0.1:9"]), vllm_tiny, lambda n: ("base", None), sink=FakeSink(), keys=keys
    )
    with serve(app) as url:
        yield url, key


@pytest.mark.integration
@pytest.mark.parametrize(
    "extra",
    [
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"prompt_embeds": "AAAA"},
        {"n": 100_000},
        {"max_tokens": 10**9},
        {"chat_template": "{{ raise('x') }}"},
        # found by an attacker's pass: a schema that is only a reference to itself made vLLM fail with a 500
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
            }
        },
        # tools: a strict schema vLLM would compile into a grammar that matches nothing, one that is no schema
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}, "strict": True}}],
            "tool_choice": "required",
        },
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}, "strict": True}}]},
        # a reference to nothing in a strict schema (was forwarded)
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/x"}, "strict": True}}
            ],
            "tool_choice": "required",
        },
        {"tool_choice": "required"},
    ],
)
def test_refused_requests_never_reach_vllm(setup: tuple[str, str], vllm_tiny: str, extra: dict) -> None:
    gateway, key = setup
    headers = {"authorization": f"Bearer {key}"}
    before = vllm_chat_requests(vllm_tiny)
    bad = httpx.post(f"{gateway}/v1/chat/completions", json={**BODY, **extra}, headers=headers, timeout=60)
    assert bad.status_code == 400, bad.text
    good = httpx.post(f"{gateway}/v1/chat/completions", json=BODY, headers=headers, timeout=60)
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] is not None
    wait_for(lambda: vllm_chat_requests(vllm_tiny) >= before + 1, 10, "vLLM to count the allowed request")
    assert vllm_chat_requests(vllm_tiny) == before + 1, "only the allowed request reached vLLM"


BOUND = 8  # gateway.max_tokens of the bounded gateway; the test vLLM's context is 512 tokens


@pytest.fixture(scope="module")
def bounded(vllm_tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, FakeSink]]:
    """A gateway with ``gateway.max_tokens = 8`` in front of the real vLLM, recording its traces."""
    keys = KeyStore(tmp_path_factory.mktemp("keys") / "gateway-keys.json")
    _, key = keys.create("client")
    sink = FakeSink()
    app = create_gateway_app(
        KafkaConfig(bootstrap_servers=["127.0.0.1:9"]),
        vllm_tiny,
        lambda n: ("base", None),
        sink=sink,
        keys=keys,
        gateway=GatewayConfig(max_tokens=BOUND),
    )
    with serve(app) as url:
        yield url, key, sink


def _generated(response: httpx.Response, stream: bool) -> tuple[int, str]:
    """(completion tokens vLLM reports, trace id) of a plain or streamed answer."""
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["usage"]["completion_tokens"], response.headers[TRACE_HEADER]
    chunks = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data: {")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage, "the stream carried no usage chunk"
    return usage[-1]["completion_tokens"], response.headers[TRACE_HEADER]


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to 500."}], "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": None}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": None, "ignore_eos": True},
        ),
        ("/v1/completions", {"prompt": "Once upon a time", "ignore_eos": True}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": None, "ignore_eos": True}),
    ],
)
def test_a_request_without_a_bound_is_bounded_by_gateway_max_tokens(
    bounded, path: str, body: dict, stream: bool
) -> None:
    """Without max_tokens (absent or null), vLLM generated to the end of its context (about 500 tokens here):
    the gateway now sends gateway.max_tokens, and the trace records the bound that was applied."""
    gateway, key, sink = bounded
    request = {"model": "hourglass", "ignore_eos": True, **body}
    if stream:
        request |= {"stream": True, "stream_options": {"include_usage": True}}
    response = httpx.post(f"{gateway}{path}", json=request, headers={"authorization": f"Bearer {key}"}, timeout=120)
    tokens, trace_id = _generated(response, stream)
    assert tokens == BOUND
    assert sink.trace(trace_id).metadata["max_tokens"] == BOUND


@pytest.mark.integration
def test_a_clients_own_bound_is_kept_and_traced(bounded) -> None:
    gateway, key, sink = bounded
    body = {"model": "hourglass", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    for field in ("max_tokens", "max_completion_tokens"):
        response = httpx.post(
            f"{gateway}/v1/chat/completions",
            json={**body, field: 3},
            headers={"authorization": f"Bearer {key}"},
            timeout=120,
        )
        tokens, trace_id = _generated(response, False)
        assert tokens == 3 and sink.trace(trace_id).metadata["max_tokens"] == 3
