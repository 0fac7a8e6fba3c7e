"""The app-side feedback client: retry policy (429 with Retry-After, 5xx, connection errors, bounded),
typed errors, headers read from a response; and, against the real gateway in front of the real vLLM and a
real Tansu broker, feedback posted through it lands on the feedback topic."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from kafka import KafkaConsumer, TopicPartition

from connectors.client import (
    FEEDBACK_HEADER,
    TRACE_HEADER,
    FeedbackClient,
    FeedbackRefused,
    FeedbackUnavailable,
    HourglassClient,
    NoFeedbackToken,
    ResponseRef,
)
from connectors.config import KafkaConfig
from tests.connectors.connector_helpers import wait_for

REF = ResponseRef("t-1", "token-1")


class Recorder:
    """An httpx MockTransport handler that answers from a script and records the requests."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def client(recorder: Recorder, waits: list[float], **kwargs: object) -> FeedbackClient:
    http = httpx.Client(transport=httpx.MockTransport(recorder))
    return FeedbackClient("http://gw.test/v1", "sk-1", http=http, sleep=waits.append, **kwargs)  # type: ignore[arg-type]


STORED = httpx.Response(200, json={"trace_id": "t-1", "status": "stored"})


def test_headers_match_the_gateway_and_are_read_from_a_response() -> None:
    from connectors.gateway.app import FEEDBACK_HEADER as GW_FEEDBACK
    from connectors.gateway.app import TRACE_HEADER as GW_TRACE

    assert (TRACE_HEADER, FEEDBACK_HEADER) == (GW_TRACE, GW_FEEDBACK)
    response = httpx.Response(200, headers={"X-Hourglass-Trace-Id": "abc", "x-hourglass-feedback-token": "tok"})
    assert ResponseRef.from_response(response) == ResponseRef("abc", "tok")
    with pytest.raises(NoFeedbackToken, match="feedback-token"):
        ResponseRef.from_response(httpx.Response(200, headers={"x-hourglass-trace-id": "abc"}))


def test_a_vote_is_posted_with_the_key_and_token() -> None:
    recorder, waits = Recorder(STORED), []
    assert client(recorder, waits).thumbs(REF, up=True, metadata={"surface": "chat"}) == {
        "trace_id": "t-1",
        "status": "stored",
    }
    (request,) = recorder.requests
    assert str(request.url) == "http://gw.test/v1/feedback" and request.headers["authorization"] == "Bearer sk-1"
    assert json.loads(request.content) == {
        "trace_id": "t-1",
        "feedback_token": "token-1",
        "thumbs": "up",
        "metadata": {"surface": "chat"},
    }
    assert waits == []


def test_a_correction_travels_with_a_vote_and_edited() -> None:
    recorder = Recorder(STORED)
    client(recorder, []).correction(REF, "42")
    assert json.loads(recorder.requests[0].content) == {
        "trace_id": "t-1",
        "feedback_token": "token-1",
        "thumbs": "down",
        "edited": True,
        "correction": "42",
    }


def test_429_and_5xx_and_connection_errors_are_retried_honouring_retry_after() -> None:
    recorder, waits = (
        Recorder(
            httpx.Response(429, headers={"retry-after": "3"}, json={"error": {"message": "slow down"}}),
            httpx.Response(503, json={"error": {"message": "not stored"}}),
            httpx.ConnectError("refused"),
            STORED,
        ),
        [],
    )
    assert client(recorder, waits).rating(REF, 4)["status"] == "stored"
    assert len(recorder.requests) == 4
    assert waits[0] == 3.0  # at least the Retry-After
    assert all(0 < w <= 8.0 for w in waits) and len(waits) == 3


def test_retries_are_bounded_then_feedback_unavailable() -> None:
    recorder, waits = Recorder(*[httpx.Response(502, text="bad gateway")] * 3), []
    with pytest.raises(FeedbackUnavailable, match="3 attempts.*502") as err:
        client(recorder, waits, max_attempts=3, max_wait_s=0.5).thumbs(REF, up=False)
    assert isinstance(err.value, ConnectionError) and len(recorder.requests) == 3
    assert all(w <= 0.5 for w in waits)


def test_a_4xx_is_refused_at_once_with_the_gateway_reason() -> None:
    body = {
        "error": {
            "message": "feedback token is invalid",
            "type": "permission_error",
            "param": "feedback_token",
            "code": "invalid_feedback_token",
        }
    }
    recorder = Recorder(httpx.Response(403, json=body))
    with pytest.raises(FeedbackRefused) as err:
        client(recorder, []).thumbs(REF, up=True)
    assert (err.value.status, err.value.code, err.value.param) == (403, "invalid_feedback_token", "feedback_token")
    assert isinstance(err.value, ValueError) and len(recorder.requests) == 1


# --- against the real gateway, vLLM and broker ---------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(
    broker: str, vllm_tiny: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, KafkaConfig]]:
    from connectors.gateway.app import create_gateway_app
    from connectors.gateway.auth import KeyStore
    from connectors.kafka_admin import ensure_topics
    from tests.http_helpers import serve

    tag = uuid.uuid4().hex[:8]
    kafka = KafkaConfig(
        bootstrap_servers=[broker], traces_topic=f"cl-traces-{tag}", feedback_topic=f"cl-feedback-{tag}", partitions=1
    )
    ensure_topics(kafka)
    keys = KeyStore(tmp_path_factory.mktemp("keys") / "gateway-keys.json")
    _, key = keys.create("app")
    app = create_gateway_app(kafka, vllm_tiny, lambda name: ("base", None), keys=keys)
    with serve(app, "gateway") as url:
        yield url, key, kafka


def feedback_records(kafka: KafkaConfig, trace_id: str) -> list[dict]:
    consumer = KafkaConsumer(
        bootstrap_servers=kafka.bootstrap_servers, group_id=None, auto_offset_reset="earliest", enable_auto_commit=False
    )
    consumer.assign([TopicPartition(kafka.feedback_topic, 0)])
    found: list[dict] = []
    try:

        def arrived() -> bool:
            for records in consumer.poll(timeout_ms=500).values():
                found.extend(json.loads(r.value) for r in records)
            return any(e["trace_id"] == trace_id for e in found)

        wait_for(arrived, 30, f"feedback for {trace_id} on {kafka.feedback_topic}")
    finally:
        consumer.close()
    return [e for e in found if e["trace_id"] == trace_id]


@pytest.mark.integration
def test_feedback_through_the_client_arrives_on_the_feedback_topic(stack: tuple[str, str, KafkaConfig]) -> None:
    gateway, key, kafka = stack
    llm = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)
    raw = llm.chat.completions.with_raw_response.create(
        model="hourglass", messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=2
    )
    assert raw.parse().choices[0].message.content is not None
    ref = ResponseRef.from_response(raw)
    with FeedbackClient(gateway, key) as feedback:
        assert feedback.rating(ref, 5) == {"trace_id": ref.trace_id, "status": "stored"}
        with pytest.raises(FeedbackRefused) as err:  # a token is bound to its trace
            feedback.thumbs(ResponseRef(ref.trace_id, ref.feedback_token[:-4] + "AAAA"), up=True)
        assert err.value.status == 403 and err.value.code == "invalid_feedback_token"
    (event,) = feedback_records(kafka, ref.trace_id)
    assert event["schema"] == "hourglass.feedback/v1" and event["rating"] == 5 and event["metadata"]["user_hash"]


@pytest.mark.integration
def test_hourglass_client_chat_and_correction(stack: tuple[str, str, KafkaConfig]) -> None:
    gateway, key, kafka = stack
    with HourglassClient(gateway, key) as hg:
        completion, ref = hg.chat(model="hourglass", messages=[{"role": "user", "content": "2+2?"}], max_tokens=2)
        assert completion.choices[0].message.role == "assistant"
        hg.feedback.correction(ref, "4")
    (event,) = feedback_records(kafka, ref.trace_id)
    assert (event["thumbs"], event["edited"], event["correction"]) == ("down", True, "4")
