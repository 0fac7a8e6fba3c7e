"""Integration: the gateway against a real vLLM (tiny model) and a real Tansu broker.

The official ``openai`` client talks to the gateway through a real socket
(uvicorn in a thread); trace and feedback events are read back from Kafka with
kafka-python.
"""

from __future__ import annotations

import contextlib
import json
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from kafka import KafkaConsumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from connectors.gateway.auth import KeyStore
from connectors.config import GatewayConfig, KafkaConfig
from connectors.gateway.app import FEEDBACK_HEADER, TRACE_HEADER, create_gateway_app
from connectors.gateway.trace import (
    ClientAsked,
    Completion,
    strip_extras,
    upstream_body,
)
from connectors.kafka_admin import ensure_topics
from connectors.gateway.routes import RouteResolver, Route, write_route
from pipeline.stack import free_port

from tests.connectors.connector_helpers import wait_for
from tests.http_helpers import serve as http_serve

ROUTES = {"hourglass": ("base", None), "tagged": ("base", "7")}
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
N_TOKENS = 6  # ignore_eos + max_tokens: the tiny random model always produces exactly this many


def resolve(name: str) -> tuple[str, str | None]:
    return ROUTES[name]


def serve(app: FastAPI) -> contextlib.AbstractContextManager[str]:
    """The gateway on a free port (see :func:`http_helpers.serve`)."""
    return http_serve(app, "gateway")


class TopicReader:
    """Reads a topic from the beginning (no consumer group) and indexes records by key."""

    def __init__(self, kafka: KafkaConfig, topic: str) -> None:
        self.consumer = KafkaConsumer(
            bootstrap_servers=kafka.bootstrap_servers,
            group_id=None,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        self.consumer.assign([TopicPartition(topic, p) for p in range(kafka.partitions)])
        self.by_key: dict[str, list[dict[str, Any]]] = {}

    def _poll(self) -> None:
        for records in self.consumer.poll(timeout_ms=500).values():
            for record in records:
                self.by_key.setdefault(record.key.decode(), []).append(json.loads(record.value))

    def get(self, key: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The one record with ``key`` (fails if none arrives within ``timeout_s``)."""

        def seen() -> bool:
            self._poll()
            return key in self.by_key

        wait_for(seen, timeout_s, f"record {key!r}")
        self._poll()
        assert len(self.by_key[key]) == 1, f"expected one record for {key}, got {self.by_key[key]}"
        return self.by_key[key][0]


@pytest.fixture(scope="module")
def kafka(broker: str) -> KafkaConfig:
    tag = uuid.uuid4().hex[:8]
    cfg = KafkaConfig(
        bootstrap_servers=[broker], traces_topic=f"gw-traces-{tag}", feedback_topic=f"gw-feedback-{tag}", partitions=2
    )
    ensure_topics(cfg)
    return cfg


OPEN = GatewayConfig(require_api_key=False)  # local tests only: every caller is the untrusted 'anonymous'


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> KeyStore:
    return KeyStore(tmp_path_factory.mktemp("keys") / "gateway-keys.json")


@pytest.fixture(scope="module")
def grader_key(keys: KeyStore) -> str:
    return keys.create("grader", trusted_grader=True)[1]


@pytest.fixture(scope="module")
def gateway(kafka: KafkaConfig, vllm_tiny: str, keys: KeyStore) -> Iterator[str]:
    app = create_gateway_app(kafka, vllm_tiny, resolve, list_models=lambda: sorted(ROUTES), keys=keys)
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def traces(kafka: KafkaConfig) -> Iterator[TopicReader]:
    reader = TopicReader(kafka, kafka.traces_topic)
    yield reader
    reader.consumer.close()


@pytest.fixture(scope="module")
def client(gateway: str, grader_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=grader_key, max_retries=0)


def metric(url: str, name: str, **labels: str) -> float:
    """Current value of one Prometheus sample served at ``url/metrics`` (0 when absent)."""
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def _assert_token_fields(trace: dict[str, Any]) -> None:
    ids, lps = trace["completion_token_ids"], trace["completion_logprobs"]
    assert len(ids) == N_TOKENS and all(isinstance(i, int) for i in ids)
    assert len(lps) == N_TOKENS and all(math.isfinite(v) and v <= 0.0 for v in lps)


# --- through the official openai client ------------------------------------------------


@pytest.mark.integration
def test_chat_completion_returns_text_and_publishes_its_trace(
    client: openai.OpenAI, gateway: str, traces: TopicReader
) -> None:
    before = metric(gateway, "hourglass_gateway_requests_total", endpoint="/v1/chat/completions", status="200")
    raw = client.chat.completions.with_raw_response.create(
        model="hourglass",
        messages=MESSAGES,
        max_tokens=N_TOKENS,
        user="alice@example.com",
        extra_body={"metadata": {"reference_answer": "4", "user_id": "u-42"}, "ignore_eos": True},
    )
    trace_id = raw.headers[TRACE_HEADER]
    response = raw.parse()
    text = response.choices[0].message.content
    assert isinstance(text, str) and text
    assert response.choices[0].logprobs is None, "logprobs the client did not ask for must be stripped"
    assert "token_ids" not in (response.choices[0].model_extra or {})

    trace = traces.get(trace_id)
    assert trace["schema"] == "hourglass.trace/v2" and trace["trace_id"] == trace_id
    # the conversation fields: the prompt as vLLM rendered it, the turn, the counts
    assert trace["prompt_token_ids"] and trace["usage"]["prompt_tokens"] == len(trace["prompt_token_ids"])
    assert trace["turn"] == 0 and trace["conversation_id"].startswith("conv-") and "parent_trace_id" not in trace
    assert trace["model"] == "hourglass" and "adapter_version" not in trace  # base: null, dropped on the wire
    assert trace["prompt"] == MESSAGES and trace["completion"] == text
    _assert_token_fields(trace)
    meta = trace["metadata"]  # a trusted grader's reference_answer is a label; other client keys stay under "client"
    assert meta["reference_answer"] == "4" and meta["served_name"] == "base" and meta["stream"] is False
    assert meta["user_hash"].startswith("hmac-sha256:") and meta["client"]["user_id"].startswith("hmac-sha256:")
    assert raw.headers[FEEDBACK_HEADER]
    assert "alice@example.com" not in json.dumps(trace) and "u-42" not in json.dumps(trace)
    assert (
        metric(gateway, "hourglass_gateway_requests_total", endpoint="/v1/chat/completions", status="200") == before + 1
    )


@pytest.mark.integration
def test_text_completion_keeps_asked_logprobs_and_tags_adapter_version(
    client: openai.OpenAI, traces: TopicReader
) -> None:
    raw = client.completions.with_raw_response.create(
        model="tagged", prompt="1+1=", max_tokens=N_TOKENS, logprobs=1, extra_body={"ignore_eos": True}
    )
    response = raw.parse()
    text = response.choices[0].text
    assert isinstance(text, str) and text
    asked = response.choices[0].logprobs
    assert asked is not None and len(asked.token_logprobs) == N_TOKENS, "logprobs the client asked for are kept"

    trace = traces.get(raw.headers[TRACE_HEADER])
    assert trace["model"] == "tagged" and trace["adapter_version"] == "7"
    assert trace["prompt"] == "1+1=" and trace["completion"] == text
    _assert_token_fields(trace)
    assert trace["completion_logprobs"] == pytest.approx(asked.token_logprobs)


@pytest.mark.integration
def test_streamed_chat_passes_chunks_through_and_publishes_one_full_trace(
    client: openai.OpenAI, traces: TopicReader
) -> None:
    with client.chat.completions.with_streaming_response.create(
        model="hourglass", messages=MESSAGES, max_tokens=N_TOKENS, stream=True, extra_body={"ignore_eos": True}
    ) as response:
        trace_id = response.headers[TRACE_HEADER]
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)

    trace = traces.get(trace_id)
    assert trace["completion"] == text and trace["metadata"]["stream"] is True
    assert trace["metadata"]["finish_reason"] == "length"
    _assert_token_fields(trace)


@pytest.mark.integration
def test_models_lists_public_names_and_unknown_model_is_404(client: openai.OpenAI) -> None:
    assert sorted(m.id for m in client.models.list()) == ["hourglass", "tagged"]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert err.value.code == "model_not_found" and "no-such-model" in err.value.message


@pytest.mark.integration
def test_upstream_error_passes_through_with_its_status(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:  # max_model_len is 512 (below gateway.max_tokens)
        client.chat.completions.create(model="hourglass", messages=MESSAGES, max_tokens=1000)
    assert err.value.status_code == 400 and "512" in str(err.value.message)


@pytest.mark.integration
def test_text_that_is_not_unicode_is_a_400_and_the_connection_survives(gateway: str, grader_key: str) -> None:
    body = b'{"model": "hourglass", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    auth = {"authorization": f"Bearer {grader_key}"}
    with httpx.Client(
        base_url=gateway, timeout=60, headers=auth
    ) as http:  # one keep-alive connection for both requests
        bad = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert "Unicode" in bad.json()["error"]["message"]
        good = http.post("/v1/chat/completions", json={"model": "hourglass", "max_tokens": 2, "messages": MESSAGES})
        assert good.status_code == 200


# --- feedback ----------------------------------------------------------------------------


@pytest.mark.integration
def test_feedback_is_published_and_joins_by_trace_id(
    client: openai.OpenAI, gateway: str, kafka: KafkaConfig, grader_key: str
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="hourglass", messages=MESSAGES, max_tokens=2, user="bob"
    )
    trace_id = raw.headers[TRACE_HEADER]
    body = {
        "trace_id": trace_id,
        "thumbs": "up",
        "rating": 5,
        "reward": 0.5,
        "edited": False,
        "metadata": {"user_id": "u-1", "surface": "chat", "user_hash": "forged"},
    }
    headers = {"authorization": f"Bearer {grader_key}", FEEDBACK_HEADER: raw.headers[FEEDBACK_HEADER]}
    answer = httpx.post(f"{gateway}/v1/feedback", json=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"trace_id": trace_id, "status": "stored"}

    reader = TopicReader(kafka, kafka.feedback_topic)
    try:
        event = reader.get(trace_id)
    finally:
        reader.consumer.close()
    assert event["schema"] == "hourglass.feedback/v1" and event["ts"]
    assert (event["thumbs"], event["rating"], event["reward"], event["edited"]) == ("up", 5, 0.5, False)
    assert event["metadata"]["surface"] == "chat" and event["metadata"]["user_id"].startswith("hmac-sha256:")
    traces = TopicReader(kafka, kafka.traces_topic)
    try:  # the vote is the user who got the answer, never what the client claims
        assert event["metadata"]["user_hash"] == traces.get(trace_id)["metadata"]["user_hash"] != "forged"
    finally:
        traces.consumer.close()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        ('{"trace_id": "t1", "thumbs": "sideways"}', "thumbs"),
        ('{"trace_id": "t1", "rating": 6}', "rating"),
        ('{"trace_id": "t1", "reward": NaN}', "reward"),
        ('{"thumbs": "up"}', "trace_id"),
        ('{"trace_id": "t1"}', "at least one signal"),
        ('{"trace_id": "t1", "thumbs": "up", "stars": 3}', "stars"),
        ('{"trace_id": "t1", "edited": "maybe"}', "edited"),
    ],
)
def test_bad_feedback_is_refused_with_a_clear_422(gateway: str, grader_key: str, body: str, complaint: str) -> None:
    headers = {"content-type": "application/json", "authorization": f"Bearer {grader_key}"}
    answer = httpx.post(f"{gateway}/v1/feedback", content=body, headers=headers)
    assert answer.status_code == 422
    assert complaint in answer.json()["error"]["message"]


# --- failures ----------------------------------------------------------------------------


@pytest.mark.integration
def test_unreachable_upstream_gives_502_without_naming_it(kafka: KafkaConfig) -> None:
    port = free_port()
    app = create_gateway_app(kafka, f"http://127.0.0.1:{port}", resolve, gateway=OPEN)
    with serve(app) as url:
        answer = httpx.post(f"{url}/v1/chat/completions", json={"model": "hourglass", "messages": MESSAGES})
    assert answer.status_code == 502
    assert "unreachable" in answer.json()["error"]["message"]
    assert str(port) not in answer.text and "127.0.0.1" not in answer.text, "error bodies never name internal addresses"


@pytest.mark.integration
def test_broken_sink_does_not_fail_the_client_and_is_counted(vllm_tiny: str) -> None:
    dead = KafkaConfig(bootstrap_servers=[f"127.0.0.1:{free_port()}"], request_timeout_ms=2000)
    app = create_gateway_app(dead, vllm_tiny, resolve, gateway=OPEN)
    with serve(app) as url:
        before = metric(url, "hourglass_gateway_trace_errors_total")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        tokens = {}
        for stream in (False, True):
            raw = client.chat.completions.with_raw_response.create(
                model="hourglass", messages=MESSAGES, max_tokens=3, stream=stream
            )
            tokens[raw.headers[TRACE_HEADER]] = raw.headers[FEEDBACK_HEADER]
            response = raw.parse()
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in response if c.choices)
            else:
                text = response.choices[0].message.content
            assert text, f"no answer with a broken sink (stream={stream})"
        wait_for(
            lambda: metric(url, "hourglass_gateway_trace_errors_total") >= before + 2, 60, "2 trace errors counted"
        )
        trace_id, token = next(iter(tokens.items()))
        vote = {"trace_id": trace_id, "thumbs": "up", "feedback_token": token}
        answer = httpx.post(f"{url}/v1/feedback", json=vote, timeout=60)
        assert answer.status_code == 503 and "not stored" in answer.json()["error"]["message"]
        assert str(dead.bootstrap_servers[0]) not in answer.text


# --- pure rewriting (unit) ---------------------------------------------------------------


def test_upstream_body_asks_for_logprobs_and_ids_and_strip_removes_them() -> None:
    body = {"model": "hourglass", "messages": MESSAGES, "metadata": {"k": "v"}}
    up = upstream_body("chat", body, "hourglass-v3")
    assert up["model"] == "hourglass-v3" and up["logprobs"] is True and up["top_logprobs"] == 0
    assert up["return_token_ids"] is True and "metadata" not in up and body["model"] == "hourglass"
    assert upstream_body("completions", {"model": "m", "prompt": "p", "logprobs": 0}, "b")["logprobs"] == 0
    assert upstream_body("completions", {"model": "m", "prompt": "p"}, "b")["logprobs"] == 1

    response = {
        "prompt_token_ids": [1],
        "choices": [
            {
                "index": 0,
                "message": {"content": "hi"},
                "token_ids": [5, 6],
                "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.0}]},
                "finish_reason": "stop",
            }
        ],
    }
    completion = Completion()
    completion.add_payload("chat", response, delta=False)
    assert completion.text == "hi" and completion.token_fields() == ([5, 6], [-0.5, -1.0])
    stripped = strip_extras(response, ClientAsked.of("chat", body))
    assert stripped == {
        "choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": None, "finish_reason": "stop"}]
    }


def test_misaligned_or_nonfinite_logprobs_are_dropped_not_published() -> None:
    completion = Completion(token_ids=[1, 2], logprobs=[-0.1])
    assert completion.token_fields() == ([1, 2], None)
    assert Completion(token_ids=[1], logprobs=[float("-inf")]).token_fields() == ([1], None)


def test_route_resolver_follows_the_routes_file_and_falls_back_to_base(tmp_path: Path) -> None:
    resolver = RouteResolver(tmp_path, "hourglass", "base", ttl_s=0.0)
    assert resolver("hourglass") == ("base", None) and resolver.names() == ["hourglass"]
    with pytest.raises(KeyError, match="nope"):
        resolver("nope")
    write_route(
        tmp_path, "hourglass", Route(served_name="hourglass-v3", version="3", updated_at="2026-01-01T00:00:00+00:00")
    )
    write_route(tmp_path, "other", Route(served_name="other-v1", version="1", updated_at="2026-01-01T00:00:00+00:00"))
    assert resolver("hourglass") == ("hourglass-v3", "3") and resolver("other") == ("other-v1", "1")
    assert resolver.names() == ["hourglass", "other"]
