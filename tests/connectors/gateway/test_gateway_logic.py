"""The gateway's request and trace handling in process: the real app, an in-memory model server
(``httpx.MockTransport``), a recording sink, no socket, no broker, no vLLM.

What a client sees (status, OpenAI error body, headers, stripped extras) and what the trace and
feedback events carry (public model, adapter version, canary side, hashed user). The same paths run
against a real vLLM and a real broker in ``test_gateway.py``, ``test_gateway_vllm.py`` and
``test_canary_gateway.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from connectors.gateway.auth import KeyStore
from connectors.config import GatewayConfig, KafkaConfig
from connectors.errors import ConnectorConfigError
from connectors.gateway.app import FEEDBACK_HEADER, TRACE_HEADER, create_gateway_app
from connectors.gateway.events import TRACE_ERRORS
from connectors.schema import FeedbackEvent, TraceEvent
from tests.connectors.gateway.gateway_fakes import FakeSink, wait_for

KAFKA = KafkaConfig(bootstrap_servers=["127.0.0.1:9"])  # never dialled: a sink is injected
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
UPSTREAM_KEY = "vllm-secret-key"
ROUTES = {"hourglass": ("hourglass-v3", "3"), "plain": ("base", None)}


class Upstream:
    """A vLLM-shaped model server behind ``httpx.MockTransport``: records each request; ``reply`` may be
    replaced to script an answer (an ``httpx.Response``, or an exception to raise)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.reply: Callable[[dict[str, Any]], httpx.Response] = self.answer
        self.transport = httpx.MockTransport(self._handle)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        return self.reply(body)

    @staticmethod
    def answer(body: dict[str, Any]) -> httpx.Response:
        if body.get("stream"):
            chunks = [
                {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": word},
                            "token_ids": [tid],
                            "logprobs": {"content": [{"token": word, "logprob": -0.25}]},
                            "finish_reason": None,
                        }
                    ],
                }
                for word, tid in (("fo", 11), ("ur", 12))
            ]
            chunks[-1]["choices"][0]["finish_reason"] = "stop"
            sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})
        if "prompt" in body:
            choice = {
                "index": 0,
                "text": " 2",
                "token_ids": [7],
                "finish_reason": "length",
                "logprobs": {"tokens": [" 2"], "token_logprobs": [-0.5]},
            }
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": "4"},
                "token_ids": [19],
                "finish_reason": "stop",
                "logprobs": {"content": [{"token": "4", "logprob": -0.1}]},
            }
        return httpx.Response(
            200,
            json={
                "id": "x",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [choice],
                "prompt_token_ids": [1, 2],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            },
        )


class Keys:
    def __init__(self, folder: Path) -> None:
        self.store = KeyStore(folder / "gateway-keys.json")
        self.client = self.store.create("app")[1]
        self.grader = self.store.create("grader", trusted_grader=True)[1]
        record, self.revoked = self.store.create("old")
        self.store.revoke(record.key_id)


class CanaryResolver:
    """A canary-aware resolver: routing keys in ``challenger_keys`` go to the challenger."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.challenger_keys: set[str] = set()

    def __call__(self, public: str) -> tuple[str, str | None]:
        return ROUTES[public]

    def route(self, public: str, routing_key: str) -> tuple[str, str | None, bool]:
        self.keys.append(routing_key)
        if routing_key in self.challenger_keys:
            return "hourglass-v4", "4", True
        return (*ROUTES[public], False)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


class Gateway:
    def __init__(self, http: TestClient, upstream: Upstream, sink: FakeSink, keys: Keys) -> None:
        self.http, self.upstream, self.sink, self.keys = http, upstream, sink, keys

    def post(self, path: str, body: Any, key: str | None, **headers: str) -> httpx.Response:
        if key:
            headers["authorization"] = f"Bearer {key}"
        return self.http.post(path, json=body, headers=headers)

    def chat(self, key: str | None = None, **extra: Any) -> httpx.Response:
        body = {"model": "hourglass", "messages": MESSAGES, "max_tokens": 4, **extra}
        return self.post("/v1/chat/completions", body, self.keys.client if key is None else key)

    def trace(self, response: httpx.Response) -> TraceEvent:
        return self.sink.trace(response.headers[TRACE_HEADER])


def make_gateway(keys: Keys, sink: Any, resolve: Any = None, **kwargs: Any) -> tuple[TestClient, Upstream]:
    upstream = Upstream()
    app = create_gateway_app(
        KAFKA,
        "http://vllm.internal:8000",
        resolve or (lambda name: ROUTES[name]),
        sink=sink,
        keys=keys.store,
        list_models=lambda: sorted(ROUTES),
        upstream_api_key=UPSTREAM_KEY,
        upstream_transport=upstream.transport,
        **kwargs,
    )
    return TestClient(app), upstream


@pytest.fixture
def gw(keys: Keys) -> Iterator[Gateway]:
    sink = FakeSink()
    http, upstream = make_gateway(keys, sink)
    with http:
        yield Gateway(http, upstream, sink, keys)


def error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# --- who may call ---------------------------------------------------------------------------------


def test_api_keys_are_checked_before_anything_reaches_the_model_server(gw: Gateway) -> None:
    missing = gw.chat(key="")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert error(missing)["code"] == "missing_api_key" and error(missing)["type"] == "authentication_error"
    unknown = gw.chat(key=gw.keys.client[:-4] + "AAAA")
    assert unknown.status_code == 403 and error(unknown)["code"] == "invalid_api_key"
    revoked = gw.chat(key=gw.keys.revoked)
    assert revoked.status_code == 403 and "revoked" in error(revoked)["message"]
    assert gw.http.get("/v1/models").status_code == 401
    assert gw.upstream.requests == []

    models = gw.http.get("/v1/models", headers={"authorization": f"Bearer {gw.keys.client}"})
    assert [m["id"] for m in models.json()["data"]] == ["hourglass", "plain"]
    assert gw.chat().status_code == 200


def test_two_host_headers_are_a_400_before_anything_runs(gw: Gateway) -> None:
    body = {"model": "hourglass", "messages": MESSAGES}
    headers = [("host", "testserver"), ("host", "evil.example"), ("authorization", f"Bearer {gw.keys.client}")]

    answer = gw.http.post("/v1/chat/completions", json=body, headers=headers)

    assert answer.status_code == 400 and error(answer)["code"] == "duplicate_host_header"
    assert "2 Host headers" in error(answer)["message"]
    assert gw.upstream.requests == [] and gw.chat().status_code == 200  # one Host header: served


def test_a_gateway_that_requires_keys_needs_a_key_store() -> None:
    with pytest.raises(ConnectorConfigError, match="no API key store"):
        create_gateway_app(KAFKA, "http://vllm.internal:8000", lambda name: ROUTES[name], sink=FakeSink())


def test_an_open_gateway_serves_callers_without_a_key_as_anonymous() -> None:
    sink, upstream = FakeSink(), Upstream()
    app = create_gateway_app(
        KAFKA,
        "http://vllm.internal:8000",
        lambda name: ROUTES[name],
        sink=sink,
        gateway=GatewayConfig(require_api_key=False),
        upstream_transport=upstream.transport,
    )
    with TestClient(app) as http:
        answer = http.post("/v1/chat/completions", json={"model": "hourglass", "messages": MESSAGES})
    assert answer.status_code == 200
    assert sink.trace(answer.headers[TRACE_HEADER]).metadata["user_hash"].startswith("hmac-sha256:")


# --- what goes upstream, what comes back, what is traced ---------------------------------------------


def test_a_chat_is_rewritten_for_vllm_and_its_trace_carries_the_adapter_version(gw: Gateway) -> None:
    answer = gw.chat(user="alice@example.com", metadata={"user_id": "u-42", "reference_answer": "5"})

    assert answer.status_code == 200
    sent = gw.upstream.requests[0]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["body"]["model"] == "hourglass-v3"  # the served name, never the public one
    assert sent["body"]["logprobs"] is True and sent["body"]["return_token_ids"] is True
    assert "user" not in sent["body"] and "metadata" not in sent["body"]
    assert sent["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"  # the gateway's key, not the client's

    body = answer.json()
    assert body["model"] == "hourglass"  # the public name: the served one tells a canary's side and versions
    assert body["choices"][0]["message"]["content"] == "4"
    assert body["choices"][0]["logprobs"] is None and "token_ids" not in body["choices"][0]
    assert "prompt_token_ids" not in body
    assert answer.headers[TRACE_HEADER] and answer.headers[FEEDBACK_HEADER]

    trace = gw.trace(answer)
    assert (trace.model, trace.adapter_version, trace.completion) == ("hourglass", "3", "4")
    assert trace.model_dump(mode="json", exclude_none=True)["prompt"] == MESSAGES
    assert trace.completion_token_ids == [19] and trace.completion_logprobs == [-0.1]
    meta = trace.metadata
    assert meta["served_name"] == "hourglass-v3" and meta["stream"] is False and meta["finish_reason"] == "stop"
    assert meta["endpoint"] == "chat" and meta["usage"] == {"prompt_tokens": 3, "completion_tokens": 1}
    assert meta["user_hash"].startswith("hmac-sha256:")
    assert meta["client"]["user_id"].startswith("hmac-sha256:")
    assert (
        "reference_answer" not in meta and meta["client"]["reference_answer"] == "5"
    )  # an untrusted key labels nothing
    assert "canary" not in meta
    assert "alice@example.com" not in trace.model_dump_json() and "u-42" not in trace.model_dump_json()


def test_a_trusted_graders_reference_answer_is_a_label(gw: Gateway) -> None:
    answer = gw.chat(key=gw.keys.grader, metadata={"reference_answer": "4"})

    assert gw.trace(answer).metadata["reference_answer"] == "4"


def test_the_user_hash_is_per_key_and_per_user(gw: Gateway) -> None:
    hashes = [
        gw.trace(r).metadata["user_hash"]
        for r in (
            gw.chat(user="alice"),
            gw.chat(user="alice"),
            gw.chat(user="bob"),
            gw.chat(key=gw.keys.grader, user="alice"),
            gw.chat(),
        )
    ]

    assert hashes[0] == hashes[1]
    assert len({hashes[0], hashes[2], hashes[3], hashes[4]}) == 4


def test_a_text_completion_of_the_base_has_no_adapter_version(gw: Gateway) -> None:
    answer = gw.post(
        "/v1/completions", {"model": "plain", "prompt": "1+1=", "max_tokens": 1, "logprobs": 1}, gw.keys.client
    )

    assert answer.status_code == 200
    assert answer.json()["choices"][0]["logprobs"] == {"tokens": [" 2"], "token_logprobs": [-0.5]}  # asked for: kept
    assert gw.upstream.requests[0]["body"]["model"] == "base"
    trace = gw.trace(answer)
    assert trace.adapter_version is None and trace.prompt == "1+1=" and trace.completion == " 2"
    assert trace.completion_logprobs == [-0.5] and trace.metadata["endpoint"] == "completions"


def test_a_stream_passes_chunks_through_stripped_and_publishes_one_full_trace(gw: Gateway) -> None:
    answer = gw.chat(stream=True)

    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    data = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "four"
    assert all(c["choices"][0]["logprobs"] is None and "token_ids" not in c["choices"][0] for c in chunks)
    assert {c["model"] for c in chunks} == {"hourglass"}
    trace = gw.trace(answer)
    assert (
        trace.completion == "four"
        and trace.completion_token_ids == [11, 12]
        and trace.completion_logprobs == [-0.25, -0.25]
    )
    assert trace.metadata["stream"] is True and trace.metadata["finish_reason"] == "stop"
    assert len([t for t in gw.sink.traces if t.trace_id == trace.trace_id]) == 1


def test_a_stream_that_ends_in_an_error_chunk_is_relayed_but_not_traced(gw: Gateway) -> None:
    sse = 'data: {"error": {"message": "engine died", "code": 500}}\n\ndata: [DONE]\n\n'
    gw.upstream.reply = lambda body: httpx.Response(
        200, content=sse.encode(), headers={"content-type": "text/event-stream"}
    )

    answer = gw.chat(stream=True)
    gw.upstream.reply = gw.upstream.answer
    gw.trace(gw.chat())  # a trace published after this one proves the publisher ran past the stream

    assert answer.status_code == 200 and "engine died" in answer.text
    assert answer.headers[TRACE_HEADER] not in {t.trace_id for t in gw.sink.traces}


class CutStream(httpx.AsyncByteStream):
    """An SSE body that breaks after its first bytes (the model server died mid-generation)."""

    def __init__(self, first: bytes) -> None:
        self.first = first

    async def __aiter__(self):  # type: ignore[override]
        yield self.first
        raise httpx.ReadError("connection reset by peer")


def _chunk(content: str, finish_reason: str | None = None) -> str:
    choice = {"index": 0, "delta": {"content": content}, "token_ids": [5], "finish_reason": finish_reason}
    return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [choice]})


STREAM_FAILURES = {
    "cut midway": lambda body: httpx.Response(
        200, stream=CutStream(f"{_chunk('fo')}\n\n".encode()), headers={"content-type": "text/event-stream"}
    ),
    "aborted": lambda body: httpx.Response(  # vLLM's finish reason of a request the engine aborted
        200,
        content=f"{_chunk('fo')}\n\n{_chunk('', 'abort')}\n\ndata: [DONE]\n\n".encode(),
        headers={"content-type": "text/event-stream"},
    ),
    "error chunk": lambda body: httpx.Response(
        200,
        content=f'{_chunk("fo")}\n\ndata: {{"error": {{"message": "engine died"}}}}\n\ndata: [DONE]\n\n'.encode(),
        headers={"content-type": "text/event-stream"},
    ),
}


@pytest.mark.parametrize("failure", sorted(STREAM_FAILURES))
def test_a_stream_that_fails_midway_is_not_traced_and_its_feedback_token_is_refused(gw: Gateway, failure: str) -> None:
    gw.upstream.reply = STREAM_FAILURES[failure]
    answer = gw.chat(stream=True)
    gw.upstream.reply = gw.upstream.answer
    complete = gw.chat(stream=True)
    gw.trace(complete)  # a trace published after the failed one proves the publisher ran past it

    assert answer.status_code == 200 and '"fo"' in answer.text  # the client got the first chunk and the token
    failed_id = answer.headers[TRACE_HEADER]
    assert failed_id not in {t.trace_id for t in gw.sink.traces}
    vote = {"trace_id": failed_id, "thumbs": "down"}
    refused = gw.post("/v1/feedback", vote, gw.keys.client, **{FEEDBACK_HEADER: answer.headers[FEEDBACK_HEADER]})
    assert refused.status_code == 409 and error(refused)["code"] == "trace_incomplete"  # was 200 "stored"
    assert error(refused)["param"] == "trace_id" and "did not complete" in error(refused)["message"]
    assert gw.sink.feedback == []

    vote = {"trace_id": complete.headers[TRACE_HEADER], "thumbs": "up"}
    stored = gw.post("/v1/feedback", vote, gw.keys.client, **{FEEDBACK_HEADER: complete.headers[FEEDBACK_HEADER]})
    assert stored.status_code == 200 and [e.trace_id for e in gw.sink.feedback] == [complete.headers[TRACE_HEADER]]


def test_batches_are_served_but_not_traced(gw: Gateway) -> None:
    answer = gw.post("/v1/completions", {"model": "plain", "prompt": ["a", "b"], "max_tokens": 1}, gw.keys.client)
    later = gw.chat()

    assert answer.status_code == 200
    gw.trace(later)
    assert answer.headers[TRACE_HEADER] not in {t.trace_id for t in gw.sink.traces}
    # no feedback token for an answer that is never traced: feedback on it would be accepted (200), then
    # dead-lettered as unmatched_feedback after the join window
    assert FEEDBACK_HEADER not in answer.headers and FEEDBACK_HEADER in later.headers
    refused = gw.post("/v1/feedback", {"trace_id": answer.headers[TRACE_HEADER], "thumbs": "up"}, gw.keys.client)
    assert refused.status_code == 400 and error(refused)["param"] == "feedback_token"


# --- the canary split ---------------------------------------------------------------------------------


def test_the_canary_side_is_in_the_trace_and_sticky_per_user(keys: Keys) -> None:
    sink, resolver = FakeSink(), CanaryResolver()
    http, upstream = make_gateway(keys, sink, resolver)
    gw = Gateway(http, upstream, sink, keys)
    with http:
        champion_side = gw.trace(gw.chat(user="carol"))
        carol_key = resolver.keys[-1]
        # keyed: not the user hash the client can read in its feedback token (canary_bucket is public)
        assert carol_key.startswith("hmac-sha256:") and carol_key != champion_side.metadata["user_hash"]
        resolver.challenger_keys.add(carol_key)
        first, second = gw.trace(gw.chat(user="carol")), gw.trace(gw.chat(user="carol"))
        anonymous = gw.chat()  # no user: a keyed hash of the trace id is the routing key
        anon_trace = gw.trace(anonymous)
        again = gw.chat(user="carol")

    assert champion_side.metadata["canary"] is False and champion_side.adapter_version == "3"
    assert first.metadata["canary"] is True and second.metadata["canary"] is True
    assert first.adapter_version == "4" and first.metadata["served_name"] == "hourglass-v4"
    assert [r["body"]["model"] for r in upstream.requests[1:3]] == ["hourglass-v4", "hourglass-v4"]
    assert (
        resolver.keys[-2] not in (anonymous.headers[TRACE_HEADER], carol_key) and anon_trace.metadata["canary"] is False
    )
    assert resolver.keys[-1] == carol_key and again.status_code == 200  # the same user: the same side


def test_a_client_cannot_set_the_canary_flag(gw: Gateway) -> None:
    trace = gw.trace(gw.chat(metadata={"canary": True}))

    assert "canary" not in trace.metadata
    assert trace.metadata["client"]["canary"] is True  # kept as the client's own key, never the gateway's flag


# --- refusals: 4xx with an OpenAI error body ---------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "headers", "status", "says"),
    [
        (b"model=hourglass", {"content-type": "text/plain"}, 415, "application/json"),
        (b"[1, 2]", {}, 400, "must be a JSON object"),
        (b"{not json", {}, 400, "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', {}, 400, "field 'model' is required"),
        (
            b'{"model": "hourglass", "messages": [{"role": "user", "content": "hi"}], "best_of": 3}',
            {},
            400,
            "'best_of' is not accepted",
        ),
        (
            b'{"model": "hourglass", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}',
            {},
            400,
            "gateway.max_tokens",
        ),
        (
            b'{"model": "hourglass", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            {},
            400,
            "finite",
        ),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', {}, 404, "`nope` does not exist"),
        (  # vLLM overflowed on it: a 500
            b'{"model": "hourglass", "messages": [{"role": "user", "content": "hi"}], "top_k": 1000000000000000000000000000000}',
            {},
            400,
            "body.top_k is 1000000000000000000000000000000...: integers must fit in 64 bits",
        ),
        # vLLM reads "false" as false, the gateway read it as true: served unstreamed, relayed as SSE, never traced
        (
            b'{"model": "hourglass", "messages": [{"role": "user", "content": "hi"}], "stream": "false"}',
            {},
            400,
            "'stream' must be true or false",
        ),
        (
            b'{"model": "hourglass", "messages": [{"role": "user", "content": "hi"}], "logprobs": "no"}',
            {},
            400,
            "'logprobs' must be true or false",
        ),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_never_reach_vllm(
    gw: Gateway, content: bytes, headers: dict, status: int, says: str
) -> None:
    answer = gw.http.post(
        "/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json", **headers, "authorization": f"Bearer {gw.keys.client}"},
    )

    assert answer.status_code == status
    assert says in error(answer)["message"]
    assert gw.upstream.requests == []


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b'{"model": "hourglass", "messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
        (b'{"model": "hourglass", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        (b'{"model": "hourglass", "messages": [{"role": "user", "content": "hi"}], "stream": "false"}', "stream"),
        (b'{"model": "hourglass", "messages": [{"role": "user", "content": "hi"}], "best_of": 3}', "best_of"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "model"),
    ],
)
def test_chat_refusals_name_the_field_in_param(gw: Gateway, content: bytes, param: str) -> None:
    answer = gw.http.post(
        "/v1/chat/completions",
        content=content,
        headers={"content-type": "application/json", "authorization": f"Bearer {gw.keys.client}"},
    )

    assert answer.status_code == 400 and error(answer)["param"] == param  # the lone surrogate's was null


def test_an_unknown_model_is_404_model_not_found(gw: Gateway) -> None:
    answer = gw.chat(model="nope")
    assert (
        answer.status_code == 404 and error(answer)["code"] == "model_not_found" and error(answer)["param"] == "model"
    )
    long = gw.chat(model=":" * 500_000)  # the name is quoted back, not all of it
    assert long.status_code == 404 and len(error(long)["message"]) < 200, len(long.text)


# --- upstream failures ---------------------------------------------------------------------------------


def test_an_upstream_4xx_passes_through_untraced_and_without_a_feedback_token(gw: Gateway) -> None:
    vllm_error = {
        "object": "error",
        "message": "max_tokens is too large: the model's context is 512",
        "type": "BadRequestError",
        "code": 400,
    }
    gw.upstream.reply = lambda body: httpx.Response(400, json=vllm_error)

    answer = gw.chat()

    assert answer.status_code == 400 and answer.json() == vllm_error
    assert answer.headers[TRACE_HEADER] and FEEDBACK_HEADER not in answer.headers
    gw.upstream.reply = gw.upstream.answer
    gw.trace(gw.chat())
    assert answer.headers[TRACE_HEADER] not in {t.trace_id for t in gw.sink.traces}


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_5xx_is_a_502_with_an_openai_error_not_its_internals(gw: Gateway, stream: bool) -> None:
    crash = 'Traceback (most recent call last):\n  File "/opt/vllm/engine.py", line 7\nEngineDeadError'
    gw.upstream.reply = lambda body: httpx.Response(500, text=crash)

    answer = gw.chat(stream=stream)

    assert answer.status_code == 502 and error(answer)["code"] == "upstream_error"  # was vLLM's 500, relayed
    assert "HTTP 500" in error(answer)["message"] and "/opt/vllm" not in answer.text
    assert answer.headers[TRACE_HEADER] and FEEDBACK_HEADER not in answer.headers


@pytest.mark.parametrize("stream", [False, True])
def test_an_unreachable_upstream_is_502_without_naming_it(gw: Gateway, stream: bool) -> None:
    def refuse(body: dict[str, Any]) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused: vllm.internal:8000")

    gw.upstream.reply = refuse
    answer = gw.chat(stream=stream)

    assert answer.status_code == 502
    assert error(answer)["code"] == "upstream_unreachable" and "unreachable" in error(answer)["message"]
    assert "vllm.internal" not in answer.text and "8000" not in answer.text


def test_an_upstream_answer_that_is_not_json_is_502(gw: Gateway) -> None:
    gw.upstream.reply = lambda body: httpx.Response(200, content=b"<html>proxy error</html>")

    answer = gw.chat()

    assert answer.status_code == 502 and error(answer)["type"] == "upstream_error"
    assert "not JSON" in error(answer)["message"]


def test_a_sink_that_fails_does_not_fail_the_client_and_is_counted(keys: Keys) -> None:
    class BrokenSink(FakeSink):
        def send_trace(self, event: TraceEvent, on_done: Callable[[Exception | None], None]) -> None:
            raise RuntimeError("broker gone")

    before = TRACE_ERRORS._value.get()
    http, _ = make_gateway(keys, BrokenSink())
    with http:
        answer = Gateway(http, _, FakeSink(), keys).chat()
        wait_for(lambda: TRACE_ERRORS._value.get() >= before + 1, 10, "the trace error to be counted")

    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "4"


# --- feedback -------------------------------------------------------------------------------------------


def test_feedback_with_the_responses_token_is_stored_with_the_voter_of_the_trace(gw: Gateway) -> None:
    answer = gw.chat(user="dave")
    trace = gw.trace(answer)
    vote = {
        "trace_id": trace.trace_id,
        "thumbs": "down",
        "rating": 2,
        "correction": "It is 4.",
        "metadata": {"user_hash": "forged", "user_id": "u-9", "surface": "chat"},
    }

    stored = gw.post("/v1/feedback", vote, gw.keys.client, **{FEEDBACK_HEADER: answer.headers[FEEDBACK_HEADER]})

    assert stored.status_code == 200 and stored.json() == {"trace_id": trace.trace_id, "status": "stored"}
    event: FeedbackEvent = gw.sink.feedback[-1]
    assert (event.trace_id, event.thumbs, event.rating, event.correction) == (trace.trace_id, "down", 2, "It is 4.")
    assert event.metadata["user_hash"] == trace.metadata["user_hash"] != "forged"
    assert event.metadata["user_id"].startswith("hmac-sha256:") and event.metadata["surface"] == "chat"
    assert event.ts is not None


def test_feedback_token_may_come_in_the_body(gw: Gateway) -> None:
    answer = gw.chat()
    vote = {"trace_id": answer.headers[TRACE_HEADER], "thumbs": "up", "feedback_token": answer.headers[FEEDBACK_HEADER]}

    assert gw.post("/v1/feedback", vote, gw.keys.client).status_code == 200
    assert gw.sink.feedback[-1].thumbs == "up"


def test_feedback_needs_the_token_of_that_trace_and_that_key(gw: Gateway) -> None:
    first, second = gw.chat(), gw.chat()
    token = first.headers[FEEDBACK_HEADER]
    vote = {"trace_id": first.headers[TRACE_HEADER], "thumbs": "up"}

    missing = gw.post("/v1/feedback", vote, gw.keys.client)
    assert missing.status_code == 400 and error(missing)["param"] == "feedback_token"
    other_trace = gw.post(
        "/v1/feedback", {**vote, "trace_id": second.headers[TRACE_HEADER]}, gw.keys.client, **{FEEDBACK_HEADER: token}
    )
    assert other_trace.status_code == 403 and error(other_trace)["code"] == "invalid_feedback_token"
    other_key = gw.post("/v1/feedback", vote, gw.keys.grader, **{FEEDBACK_HEADER: token})
    assert other_key.status_code == 403 and error(other_key)["code"] == "invalid_feedback_token"
    forged = gw.post("/v1/feedback", vote, gw.keys.client, **{FEEDBACK_HEADER: token[:-3] + "abc"})
    assert forged.status_code == 403
    assert gw.sink.feedback == []


def test_explicit_rewards_are_for_trusted_graders_only_and_clipped(gw: Gateway) -> None:
    mine = gw.chat()
    refused = gw.post(
        "/v1/feedback",
        {"trace_id": mine.headers[TRACE_HEADER], "reward": 0.9},
        gw.keys.client,
        **{FEEDBACK_HEADER: mine.headers[FEEDBACK_HEADER]},
    )
    assert refused.status_code == 403 and error(refused)["param"] == "reward"

    graded = gw.chat(key=gw.keys.grader)
    stored = gw.post(
        "/v1/feedback",
        {"trace_id": graded.headers[TRACE_HEADER], "reward": 7.5},
        gw.keys.grader,
        **{FEEDBACK_HEADER: graded.headers[FEEDBACK_HEADER]},
    )
    assert stored.status_code == 200
    assert [e.reward for e in gw.sink.feedback] == [1.0]


@pytest.mark.parametrize(
    ("body", "param", "complaint"),
    [
        ({"trace_id": "t1", "thumbs": "sideways"}, "thumbs", "thumbs"),
        ({"trace_id": "t1", "rating": 6}, "rating", "rating"),
        ({"trace_id": "t1", "rating": True}, "rating", "rating"),
        ({"thumbs": "up"}, "trace_id", "trace_id"),
        ({"trace_id": "t1"}, None, "at least one signal"),  # a rule across fields names none
        ({"trace_id": "t1", "thumbs": "up", "stars": 3}, "stars", "stars"),
        # type-strict signals: each was coerced (edited "yes" -> true, rating "1" -> 1 star) and stored
        ({"trace_id": "t1", "edited": "yes"}, "edited", "valid boolean"),
        ({"trace_id": "t1", "edited": 1}, "edited", "valid boolean"),
        ({"trace_id": "t1", "regenerated": "true"}, "regenerated", "valid boolean"),
        ({"trace_id": "t1", "rating": "1"}, "rating", "valid integer"),
        ({"trace_id": "t1", "reward": "0.5"}, "reward", "valid number"),
        ({"trace_id": "t1", "thumbs": "up", "metadata": "x"}, "metadata", "metadata"),
    ],
)
def test_bad_feedback_is_422_naming_the_field(gw: Gateway, body: dict, param: str | None, complaint: str) -> None:
    answer = gw.post("/v1/feedback", body, gw.keys.client)
    assert answer.status_code == 422 and complaint in error(answer)["message"]
    assert error(answer)["param"] == param  # was always null
    assert gw.sink.feedback == []


def test_feedback_flags_that_are_json_booleans_are_stored(gw: Gateway) -> None:
    answer = gw.chat()
    vote = {"trace_id": answer.headers[TRACE_HEADER], "edited": True, "regenerated": False}

    stored = gw.post("/v1/feedback", vote, gw.keys.client, **{FEEDBACK_HEADER: answer.headers[FEEDBACK_HEADER]})

    assert stored.status_code == 200
    assert (gw.sink.feedback[-1].edited, gw.sink.feedback[-1].regenerated) == (True, False)


def test_feedback_the_broker_did_not_acknowledge_is_503(keys: Keys) -> None:
    class NoAckSink(FakeSink):
        def send_feedback(self, event: FeedbackEvent, on_done: Callable[[Exception | None], None]) -> None:
            on_done(ConnectionError("broker at 10.1.2.3:9092 unreachable"))

    http, upstream = make_gateway(keys, NoAckSink())
    with http:
        gw = Gateway(http, upstream, FakeSink(), keys)
        answer = gw.chat()
        vote = {"trace_id": answer.headers[TRACE_HEADER], "thumbs": "up"}
        refused = gw.post("/v1/feedback", vote, keys.client, **{FEEDBACK_HEADER: answer.headers[FEEDBACK_HEADER]})

    assert refused.status_code == 503 and "not stored" in error(refused)["message"]
    assert "10.1.2.3" not in refused.text


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"correction": "x" * 4097}, "correction", "buffer.max_correction_chars=4096"),
        ({"correction": "7\u200b"}, "correction", "U+200B"),  # a zero-width space after the answer
        ({"correction": "\U000e0069\U000e0067\U000e006e 8"}, "correction", "U+E0069, U+E0067, U+E006E"),  # tags
        ({"correction": "8\u202e21"}, "correction", "U+202E"),  # a right-to-left override: shows "812", is "821"
        ({"correction": "8\x00"}, "correction", "U+0000"),
        ({"correction": "7\u200d"}, "correction", "U+200D"),  # a joiner after ASCII: "7" to a reader
        ({"correction": "\U0001f600" + "\ufe01" * 40}, "correction", "U+FE01"),  # a message in variation selectors
        ({"metadata": {"note": "x" * 17_000}}, "metadata", "gateway.max_metadata_bytes"),
    ],
)
def test_feedback_over_the_buffers_limits_is_refused_not_stored_then_dead_lettered(
    gw: Gateway, extra: dict, param: str, says: str
) -> None:
    answer = gw.chat()
    vote = {"trace_id": answer.headers[TRACE_HEADER], "thumbs": "down", **extra}
    refused = gw.post("/v1/feedback", vote, gw.keys.client, **{FEEDBACK_HEADER: answer.headers[FEEDBACK_HEADER]})

    assert refused.status_code == 400 and error(refused)["param"] == param and says in error(refused)["message"]
    assert gw.sink.feedback == []  # was 200 "stored", then a dead letter at ingest


def test_a_correction_keeps_the_joiners_and_direction_marks_of_its_script(gw: Gateway) -> None:
    answer = gw.chat()
    text = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0645 \u200f\U0001f469\u200d\U0001f4bb\n\t8"  # ZWNJ, RLM, ZWJ
    vote = {"trace_id": answer.headers[TRACE_HEADER], "thumbs": "down", "correction": text}
    stored = gw.post("/v1/feedback", vote, gw.keys.client, **{FEEDBACK_HEADER: answer.headers[FEEDBACK_HEADER]})
    assert stored.status_code == 200 and [e.correction for e in gw.sink.feedback] == [text]


@pytest.mark.parametrize(
    "answer",
    [
        [1],  # a JSON array
        {"choices": ["x"]},
        {"choices": {"a": 1}},
        {"choices": [{"index": 0, "message": "x", "logprobs": "x", "token_ids": 5, "finish_reason": ["x"]}]},
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}}], "usage": "x"},
    ],
)
def test_an_upstream_answer_of_odd_json_types_is_not_a_500(gw: Gateway, answer: Any) -> None:
    """Found by a red-team pass: a model server answer whose body, ``choices``, ``message``, ``logprobs`` or
    ``usage`` was another JSON type raised AttributeError in the trace assembly (a 500, or a lost trace with a
    traceback after the answer went out). A body that is not an object is a 502; odd parts count as absent."""
    gw.upstream.reply = lambda body: httpx.Response(200, json=answer)

    response = gw.chat()

    if isinstance(answer, list):
        assert response.status_code == 502 and error(response)["type"] == "upstream_error"
    else:
        assert response.status_code == 200


def test_a_stream_chunk_of_odd_json_types_does_not_cut_the_stream(gw: Gateway) -> None:
    """The same in a stream: a chunk whose choices are not objects raised in the relay and cut the stream."""
    chunks = [
        {"id": "c", "choices": ["x"]},
        {"id": "c", "choices": [{"index": 0, "delta": "x", "logprobs": {"content": ["x"]}}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "four"}, "finish_reason": "stop"}], "usage": "x"},
    ]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    gw.upstream.reply = lambda body: httpx.Response(
        200, content=sse.encode(), headers={"content-type": "text/event-stream"}
    )

    response = gw.chat(stream=True)

    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    assert gw.trace(response).completion == "four"


@pytest.mark.parametrize(
    ("change", "param", "says"),
    [
        ({"temperature": True}, "temperature", "must be a number"),  # vLLM read it as 1.0
        ({"temperature": "hot"}, "temperature", "must be a number"),
        ({"temperature": 2.5}, "temperature", "outside [0, 2]"),
        ({"top_p": 0}, "top_p", "outside (0, 1]"),
        ({"presence_penalty": 100}, "presence_penalty", "outside [-2, 2]"),
        ({"frequency_penalty": -100}, "frequency_penalty", "outside [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "outside (0, inf]"),
        ({"min_p": 2}, "min_p", "outside [0, 1]"),
        ({"top_k": -5}, "top_k", "outside [-1,"),
        ({"top_k": 2.5}, "top_k", "must be an integer"),
        ({"seed": False}, "seed", "must be an integer"),
        ({"top_logprobs": "x"}, "top_logprobs", "must be an integer"),
        ({"top_logprobs": 1_000_000}, "top_logprobs", "outside [0, 20]"),
        ({"min_tokens": 40, "max_tokens": 4}, "min_tokens", "above max_tokens=4"),
        ({"min_tokens": -1}, "min_tokens", "must be an integer >= 0"),
        # vLLM reads max_completion_tokens first: 50 against 5, not against 100
        ({"min_tokens": 50, "max_tokens": 100, "max_completion_tokens": 5}, "min_tokens", "above max_tokens=5"),
    ],
)
def test_sampling_numbers_are_checked_here_with_the_field_named(
    gw: Gateway, change: dict[str, Any], param: str, says: str
) -> None:
    answer = gw.chat(**change)  # vLLM's own 400 for these had param null (and took a true for 1)
    assert answer.status_code == 400, answer.text
    assert error(answer)["param"] == param and says in error(answer)["message"], error(answer)
    assert gw.upstream.requests == []


def test_sampling_numbers_within_vllms_ranges_pass() -> None:
    from connectors.gateway.request import _check_numbers

    _check_numbers(
        "chat", {"temperature": 0, "top_p": 1, "presence_penalty": -2.0, "top_k": -1, "seed": 7, "min_p": 0.0}
    )
    _check_numbers("completions", {"logprobs": 5})


@pytest.mark.parametrize(
    ("stop", "param", "says"),
    [
        (["x"] * 17, "stop", "17 strings, above gateway.max_stop=16"),  # vLLM searches each at every token
        ("", "stop", "non-empty string"),  # vLLM's own 400 named no field
        (["ok", ""], "stop.1", "non-empty string"),
        (["ok", 5], "stop.1", "non-empty string"),
        ("y" * 257, "stop", "257 characters, above gateway.max_stop_chars=256"),
        ({"a": 1}, "stop", "a string or a list of strings"),
    ],
)
def test_stop_strings_are_bounded_in_number_and_size(gw: Gateway, stop: Any, param: str, says: str) -> None:
    answer = gw.chat(stop=stop)
    assert answer.status_code == 400, answer.text
    assert error(answer)["param"] == param and says in error(answer)["message"], error(answer)
    assert gw.upstream.requests == []


def test_stop_strings_within_the_bounds_pass(gw: Gateway) -> None:
    assert gw.chat(stop="\n").status_code == 200
    assert gw.chat(stop=["\n"] * 16).status_code == 200
    assert gw.upstream.requests[-1]["body"]["stop"] == ["\n"] * 16


def test_min_tokens_above_the_default_bound_is_a_400_naming_it(keys: Keys) -> None:
    """A hostile-input pass: without max_tokens, min_tokens was compared with nothing and went upstream above
    the default bound the gateway adds (here serving.max_model_len 64), for vLLM's 400 without a field name."""
    http, upstream = make_gateway(keys, FakeSink(), max_model_len=64)
    with http:
        gw = Gateway(http, upstream, FakeSink(), keys)
        answer = gw.chat(max_tokens=None, min_tokens=100)
        assert answer.status_code == 400 and error(answer)["param"] == "min_tokens", answer.text
        assert "above max_tokens=64 (the gateway's default bound" in error(answer)["message"]
        assert gw.chat(max_tokens=None, min_tokens=64).status_code == 200
    assert upstream.requests[-1]["body"]["max_tokens"] == 64 and len(upstream.requests) == 1


def test_min_tokens_zero_is_vllms_default_and_passes(gw: Gateway) -> None:
    """A second hostile pass found min_tokens 0, which vLLM accepts (its default), refused as not positive."""
    answer = gw.chat(min_tokens=0, max_tokens=4)
    assert answer.status_code == 200, answer.text
    assert gw.upstream.requests[-1]["body"]["min_tokens"] == 0


def test_metrics_need_the_metrics_token_when_one_is_set(keys: Keys) -> None:
    """/metrics names every key's public id and its feedback volume; with gateway.metrics_token set, only a
    scraper holding it reads them. A client's API key is not the token."""
    token = "m" * 24
    http, _ = make_gateway(keys, FakeSink(), gateway=GatewayConfig(metrics_token=token))
    with http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"authorization": f"Bearer {keys.client}"}).status_code == 401
        assert http.get("/metrics", headers={"authorization": f"Bearer {token}x"}).status_code == 401
        answer = http.get("/metrics", headers={"authorization": f"Bearer {token}"})
        assert answer.status_code == 200 and "hourglass_gateway_requests_total" in answer.text
        assert token not in http.get("/metrics").text
    http, _ = make_gateway(keys, FakeSink())
    with http:
        assert http.get("/metrics").status_code == 200  # unset: open, as Prometheus scrapes expect
    with pytest.raises(ValueError, match="at least 16 characters"):
        GatewayConfig(metrics_token="short")
    assert GatewayConfig(metrics_token="").metrics_token is None


def test_the_client_facing_port_serves_no_api_explorer(gw: Gateway) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):  # FastAPI's defaults listed every route to any client
        assert gw.http.get(path).status_code == 404, path


@pytest.mark.parametrize(
    ("change", "param"),
    [  # each was a 200 (the key ignored or read loosely) or vLLM's 400 with param null
        ({"stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options.include_usage"),
        ({"stream_options": {"foo": 1}, "stream": True}, "stream_options.foo"),
        ({"stream_options": [True], "stream": True}, "stream_options"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
        ({"response_format": {"type": "text", "extra": 1}}, "response_format.extra"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
            "response_format.json_schema.strict",
        ),
        (  # a reference outside the schema: was accepted (a grammar backend might fetch it)
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "file:///x"}}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_stream_options_and_response_format_take_only_their_own_keys(
    gw: Gateway, change: dict[str, Any], param: str
) -> None:
    answer = gw.chat(**change)
    assert answer.status_code == 400 and error(answer)["param"] == param, answer.text
    assert gw.upstream.requests == []


def test_a_feedback_token_given_twice_differently_is_refused(gw: Gateway) -> None:
    first, second = gw.chat(), gw.chat()
    gw.trace(first)
    token, other = first.headers[FEEDBACK_HEADER], second.headers[FEEDBACK_HEADER]
    vote = {"trace_id": first.headers[TRACE_HEADER], "thumbs": "up"}
    twice = gw.post("/v1/feedback", {**vote, "feedback_token": token}, gw.keys.client, **{FEEDBACK_HEADER: other})
    assert twice.status_code == 400 and error(twice)["param"] == "feedback_token", twice.text  # was 200: body won
    assert gw.sink.feedback == []
    same = gw.post("/v1/feedback", {**vote, "feedback_token": token}, gw.keys.client, **{FEEDBACK_HEADER: token})
    assert same.status_code == 200, same.text  # the same token in both places is one way of saying it


@pytest.mark.parametrize("logprobs", [True, "1", [], 21, -1, 0.5])
def test_completions_logprobs_is_a_count_checked_here(gw: Gateway, logprobs: Any) -> None:
    body = {"model": "plain", "prompt": "a", "max_tokens": 1, "logprobs": logprobs}  # was passed on as is
    answer = gw.post("/v1/completions", body, gw.keys.client)
    assert answer.status_code == 400 and error(answer)["param"] == "logprobs", answer.text
    assert gw.upstream.requests == []
