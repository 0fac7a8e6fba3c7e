"""Attacks on the real gateway app (uvicorn on a real socket) in front of a recording fake upstream.

Each test is one attack from the security review: what the attacker sends, what
they get back, and what reached the model server and the trace stream.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from connectors.gateway.auth import FeedbackSigner, FeedbackTokenError, KeyStore
from connectors.config import GatewayConfig, KafkaConfig
from connectors.gateway.app import FEEDBACK_HEADER, TRACE_HEADER, create_gateway_app
from tests.connectors.gateway.gateway_fakes import FakeSink, FakeUpstream, serve, wait_for
from pipeline.stack import free_port

MESSAGES = [{"role": "user", "content": "What is 20+22?"}]
UPSTREAM_KEY = "upstream-secret-key"


class Keys:
    def __init__(self, store: KeyStore) -> None:
        self.store = store
        self.grader = store.create("grader", trusted_grader=True)[1]
        self.client = store.create("client")[1]
        self.other = store.create("other client")[1]
        self.slow = store.create("rate-limited", rate_per_min=2)[1]
        self.single = store.create("one-at-a-time", concurrency=1)[1]
        record, self.revoked = store.create("revoked")
        store.revoke(record.key_id)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(KeyStore(tmp_path_factory.mktemp("keys") / "gateway-keys.json"))


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream()
    with serve(fake.app) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture(scope="module")
def sink() -> FakeSink:
    return FakeSink()


@pytest.fixture(scope="module")
def gateway(upstream: FakeUpstream, sink: FakeSink, keys: Keys) -> Iterator[str]:
    kafka = KafkaConfig(bootstrap_servers=["127.0.0.1:9"])  # never used: the sink is injected
    app = create_gateway_app(
        kafka,
        upstream.url,
        lambda name: {"hourglass": ("base", None)}[name],
        sink=sink,  # type: ignore[attr-defined]
        keys=keys.store,
        upstream_api_key=UPSTREAM_KEY,
        gateway=GatewayConfig(disconnect_poll_s=0.05),
    )
    with serve(app) as url:
        yield url


def post(
    url: str,
    path: str,
    key: str | None,
    body: Any = None,
    *,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> httpx.Response:
    h = {"authorization": f"Bearer {key}"} if key else {}
    h.update(headers or {})
    if content is not None:
        h.setdefault("content-type", "application/json")
        return httpx.post(f"{url}{path}", content=content, headers=h, timeout=timeout)
    return httpx.post(f"{url}{path}", json=body, headers=h, timeout=timeout)


def chat(url: str, key: str, **extra: Any) -> httpx.Response:
    return post(
        url, "/v1/chat/completions", key, {"model": "hourglass", "messages": MESSAGES, "max_tokens": 4, **extra}
    )


def error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body  # OpenAI error shape
    return body["error"]


# --- who may call --------------------------------------------------------------------------------


def test_missing_key_is_401_and_unknown_or_revoked_key_is_403(gateway: str, keys: Keys, upstream: FakeUpstream) -> None:
    seen = len(upstream.requests)
    missing = chat(gateway, "")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert "API key is required" in error(missing)["message"]
    unknown = chat(gateway, keys.client[:-4] + "AAAA")
    assert unknown.status_code == 403 and error(unknown)["code"] == "invalid_api_key"
    revoked = chat(gateway, keys.revoked)
    assert revoked.status_code == 403 and "revoked" in error(revoked)["message"]
    assert httpx.get(f"{gateway}/v1/models").status_code == 401
    assert len(upstream.requests) == seen, "refused requests must not reach the model server"
    assert chat(gateway, keys.client).status_code == 200


def test_client_authorization_and_raw_user_never_go_upstream(
    gateway: str, keys: Keys, upstream: FakeUpstream, sink: FakeSink
) -> None:
    answer = chat(gateway, keys.client, user="alice@example.com")
    assert answer.status_code == 200
    sent = upstream.requests[-1]
    assert sent["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"  # the gateway's own vLLM key
    assert keys.client not in json.dumps(sent) and "alice@example.com" not in json.dumps(sent)
    assert "user" not in sent["body"] and sent["body"]["model"] == "base"
    trace = sink.trace(answer.headers[TRACE_HEADER])
    assert trace.metadata["user_hash"].startswith("hmac-sha256:") and "alice" not in trace.model_dump_json()


def test_forged_reference_answer_from_an_untrusted_key_is_not_a_label(gateway: str, keys: Keys, sink: FakeSink) -> None:
    forged = {"reference_answer": "41", "user_hash": "someone-else", "task": "x"}
    untrusted = chat(gateway, keys.client, metadata=forged)
    trace = sink.trace(untrusted.headers[TRACE_HEADER])
    assert "reference_answer" not in trace.metadata, "an untrusted key's metadata is never a label"
    assert trace.metadata["client"] == {"reference_answer": "41", "task": "x"}  # stored, not used
    assert trace.metadata["user_hash"] != "someone-else"

    graded = chat(gateway, keys.grader, metadata={"reference_answer": "42", "task": "x"})
    graded_trace = sink.trace(graded.headers[TRACE_HEADER])
    assert graded_trace.metadata["reference_answer"] == "42" and graded_trace.metadata["client"] == {"task": "x"}

    # What a round makes of both rows: exact_answer trains and evaluates on the grader's row only.
    from trainer.config import RewardTerm
    from trainer.rewards import build_reward
    from trainer.types import Prompt
    from trainer.data import prompts_from_table, snapshot_table

    rows = [Prompt(prompt_id=t.trace_id, messages=MESSAGES, metadata=t.metadata) for t in (trace, graded_trace)]
    mix = build_reward([RewardTerm(fn="exact_answer")])
    usable = [p.prompt_id for p in prompts_from_table(snapshot_table(rows)) if mix.accepts(p.metadata)]
    assert usable == [graded_trace.trace_id]


def test_the_same_user_of_two_keys_is_two_identities(gateway: str, keys: Keys, sink: FakeSink) -> None:
    a = sink.trace(chat(gateway, keys.client, user="u1").headers[TRACE_HEADER]).metadata["user_hash"]
    b = sink.trace(chat(gateway, keys.other, user="u1").headers[TRACE_HEADER]).metadata["user_hash"]
    c = sink.trace(chat(gateway, keys.client, user="u2").headers[TRACE_HEADER]).metadata["user_hash"]
    assert len({a, b, c}) == 3


def test_traces_and_feedback_name_the_key_they_came_through_hashed_and_unforgeable(
    gateway: str, keys: Keys, sink: FakeSink
) -> None:
    """A key that sends a new ``user`` on every request is many users but one key: the trace and the feedback
    carry the keyed hash of the caller's key id (what rounds and canaries cap per client), never the id in
    clear, and a client cannot set it."""
    forged = {"key_hash": "someone-else", "reference_answer": "42"}
    traces = [
        sink.trace(chat(gateway, keys.client, user=f"u{i}", metadata=forged).headers[TRACE_HEADER]) for i in range(3)
    ]
    other = sink.trace(chat(gateway, keys.other, user="u0").headers[TRACE_HEADER])
    hashes = {t.metadata["key_hash"] for t in traces}
    client_id = keys.client.split("-")[1]
    assert len(hashes) == 1 and hashes != {other.metadata["key_hash"]}
    assert len({t.metadata["user_hash"] for t in traces}) == 3, "three users of one key"
    (key_hash,) = hashes
    assert key_hash.startswith("hmac-sha256:") and client_id not in json.dumps(traces[0].metadata)
    assert "someone-else" not in traces[0].model_dump_json()

    trace_id, token = _served(gateway, keys.client, user="dave")
    body = {"trace_id": trace_id, "thumbs": "up", "feedback_token": token, "metadata": {"key_hash": "forged"}}
    assert post(gateway, "/v1/feedback", keys.client, body).status_code == 200
    (vote,) = [f for f in sink.feedback if f.trace_id == trace_id]
    assert vote.metadata["key_hash"] == key_hash == sink.trace(trace_id).metadata["key_hash"]


# --- what may be sent -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"chat_template": "{{ 7*7 }}"}, "chat_template"),
        ({"chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"n": 100_000}, "gateway.max_n"),
        ({"max_tokens": 1_000_000_000}, "gateway.max_tokens"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://10.0.0.1/"}}]}
                ]
            },
            "text part",
        ),
        ({"messages": [{"role": "user", "content": "x"}] * 300}, "gateway.max_messages"),
        ({"messages": [{"role": "user", "content": "x" * 200_001}]}, "gateway.max_prompt_chars"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": ["a" * 9000]}}}},
            "gateway.max_schema_bytes",
        ),
    ],
)
def test_disallowed_fields_and_over_cap_values_are_400_and_never_reach_upstream(
    gateway: str, keys: Keys, upstream: FakeUpstream, extra: dict[str, Any], named: str
) -> None:
    seen = len(upstream.requests)
    answer = chat(gateway, keys.client, **extra)
    assert answer.status_code == 400, answer.text
    assert named in error(answer)["message"]
    assert len(upstream.requests) == seen


def test_text_plain_is_415_oversize_is_413_deep_nesting_and_surrogates_are_400(
    gateway: str, keys: Keys, upstream: FakeUpstream
) -> None:
    seen = len(upstream.requests)
    body = json.dumps({"model": "hourglass", "messages": MESSAGES}).encode()
    plain = post(gateway, "/v1/chat/completions", keys.client, content=body, headers={"content-type": "text/plain"})
    assert plain.status_code == 415 and error(plain)["code"] == "unsupported_media_type"
    huge = post(gateway, "/v1/chat/completions", keys.client, content=b'{"x": "' + b"a" * (2 << 20) + b'"}')
    assert huge.status_code == 413
    deep = post(gateway, "/v1/chat/completions", keys.client, content=b"[" * 200_000)
    assert deep.status_code == 400 and "deeper" in error(deep)["message"]
    deep_meta = {"model": "hourglass", "messages": MESSAGES, "metadata": {"a": json.loads("[" * 40 + "]" * 40)}}
    assert chat(gateway, keys.client, **{k: v for k, v in deep_meta.items() if k == "metadata"}).status_code == 400
    surrogate_model = post(
        gateway, "/v1/chat/completions", keys.client, content=b'{"model": "\\ud800", "messages": []}'
    )
    assert surrogate_model.status_code == 400 and "Unicode" in error(surrogate_model)["message"]
    assert len(upstream.requests) == seen


def test_rate_and_concurrency_limits_give_429_with_retry_after(gateway: str, keys: Keys) -> None:
    codes = [chat(gateway, keys.slow).status_code for _ in range(3)]
    assert codes[:2] == [200, 200] and codes[2] == 429
    limited = chat(gateway, keys.slow)
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert error(limited)["type"] == "rate_limit_error"

    import threading

    slow = threading.Thread(
        target=lambda: chat(gateway, keys.single, messages=[{"role": "user", "content": "slow"}], stream=True),
        daemon=True,
    )
    slow.start()
    time.sleep(1.0)
    busy = chat(gateway, keys.single)
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert error(busy)["code"] == "too_many_concurrent_requests"


def test_generation_tokens_per_minute_bound_a_key_by_the_work_it_asks_for(
    gateway: str, keys: Keys, upstream: FakeUpstream
) -> None:
    """Request limits alone let one key ask for n x max_tokens of work per request (20 concurrent n=8,
    max_tokens=200 requests slowed another key's 8-token answer from 0.67 s to 14.6 s, within its limits): a
    key's generation tokens per minute bound it; the cost is n x max_tokens (x a completions batch's prompts)."""
    key = keys.store.create("greedy", tokens_per_min=1000)[1]
    other = keys.store.create("bystander", tokens_per_min=1000)[1]
    seen = len(upstream.requests)
    big = chat(gateway, key, n=2, max_tokens=300)  # 600 of the key's 1000
    assert big.status_code == 200, big.text
    spent = chat(gateway, key, n=2, max_tokens=300)  # 600 more: 400 left (plus the refill of a second or so)
    assert spent.status_code == 429 and error(spent)["code"] == "tokens_rate_limited"
    assert int(spent.headers["retry-after"]) >= 10  # ~200 missing tokens at 1000/min
    assert (
        "1000 generation tokens per minute" in error(spent)["message"] and "may generate 600" in error(spent)["message"]
    )
    assert chat(gateway, key, max_tokens=300).status_code == 200  # what is left still serves smaller requests
    assert chat(gateway, other, n=2, max_tokens=300).status_code == 200  # another key's bucket is its own
    too_big = chat(gateway, other, n=4, max_tokens=300)  # 1200 alone: can never fit, so not "retry later"
    assert too_big.status_code == 400 and error(too_big)["param"] == "max_tokens"
    assert "may generate 1200 tokens (n=4 x max_tokens=300)" in error(too_big)["message"]
    batch = post(
        gateway, "/v1/completions", other, {"model": "hourglass", "prompt": ["a", "b", "c"], "max_tokens": 200, "n": 2}
    )
    assert batch.status_code == 400 and "x 3 prompts" in error(batch)["message"]  # 2 x 200 x 3 = 1200
    assert len(upstream.requests) == seen + 3  # the refused ones never reached upstream


def test_a_request_that_fails_gets_its_generation_tokens_back(gateway: str, keys: Keys) -> None:
    """A hostile-input pass: a 404 for a mistyped model kept the request's charge, so the corrected request got
    a 429 for a minute although nothing was generated. The charge comes after the model is known, and a request
    that fails upstream gets it back."""
    key = keys.store.create("typo", tokens_per_min=1000)[1]
    typo = chat(gateway, key, model="hourglas", max_tokens=900)
    assert typo.status_code == 404 and error(typo)["code"] == "model_not_found"
    assert chat(gateway, key, max_tokens=900).status_code == 200  # the typo cost nothing
    key = keys.store.create("defaulted", tokens_per_min=1000)[1]
    answer = post(gateway, "/v1/chat/completions", key, {"model": "hourglass", "messages": MESSAGES})
    assert answer.status_code == 400 and error(answer)["param"] == "max_tokens"
    assert "the gateway's default: the request sets none" in error(answer)["message"]  # not a field it sent
    key = keys.store.create("unreachable", tokens_per_min=1000)[1]
    app = create_gateway_app(
        KafkaConfig(bootstrap_servers=["127.0.0.1:9"]),
        f"http://127.0.0.1:{free_port()}",  # nothing listens: every request is a 502
        lambda n: ("base", None),
        sink=FakeSink(),
        keys=keys.store,
        timeout_s=2,
    )
    with serve(app) as url:
        codes = [chat(url, key, max_tokens=900).status_code for _ in range(3)]
    assert codes == [502, 502, 502]  # not 429: nothing was generated, so nothing stays charged


# --- client hang-ups -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_aborts_its_upstream_generation(
    gateway: str, keys: Keys, upstream: FakeUpstream, stream: bool
) -> None:
    before = len(upstream.events)
    body = {"model": "hourglass", "messages": [{"role": "user", "content": "slow"}], "max_tokens": 4, "stream": stream}
    with httpx.Client(timeout=httpx.Timeout(30, read=1.0)) as http:
        try:
            with http.stream(
                "POST", f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {keys.other}"}
            ) as r:
                assert r.status_code == 200
                next(r.iter_raw())  # the first streamed bytes, then the client hangs up
        except httpx.ReadTimeout:  # not streamed: no answer within 1 s, the client gives up
            assert not stream
    started = time.monotonic()
    wait_for(lambda: len(upstream.events) > before, 15, "the upstream to see the hang-up")
    assert upstream.events[before] == ("cancelled" if stream else "disconnected")
    assert time.monotonic() - started < upstream.slow_s / 2, "aborted, not run to the end"


def test_a_body_that_never_arrives_is_408_and_frees_the_keys_slot(keys: Keys, upstream: FakeUpstream) -> None:
    import socket
    from urllib.parse import urlparse

    from prometheus_client import REGISTRY

    def count(status: str) -> float:
        labels = {"endpoint": "/v1/chat/completions", "status": status}
        return REGISTRY.get_sample_value("hourglass_gateway_requests_total", labels) or 0.0

    timed_out, hung_up = count("408"), count("499")

    app = create_gateway_app(
        KafkaConfig(bootstrap_servers=["127.0.0.1:9"]),
        upstream.url,  # type: ignore[attr-defined]
        lambda name: ("base", None),
        sink=FakeSink(),
        keys=keys.store,
        gateway=GatewayConfig(body_timeout_s=1.0),
    )
    with serve(app) as url:
        where = urlparse(url)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {keys.single}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        ).encode()
        with socket.create_connection((where.hostname, where.port), timeout=10) as slow:
            slow.sendall(head)  # 1 of the 100 declared bytes, then nothing: was no answer, ever
            answer = slow.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408") and "gateway.body_timeout_s=1" in answer
        assert chat(url, keys.single).status_code == 200  # the key's only concurrency slot is free again

        with socket.create_connection((where.hostname, where.port), timeout=10) as gone:
            gone.sendall(head)  # hangs up mid-body: was an "Exception in ASGI application" traceback (500)
        wait_for(
            lambda: count("499") == hung_up + 1, 10, "the hang-up to be counted (was an unhandled ClientDisconnect)"
        )
        assert chat(url, keys.single).status_code == 200
    assert count("408") == timed_out + 1


def test_error_bodies_do_not_name_internal_addresses(keys: Keys) -> None:
    port = free_port()
    app = create_gateway_app(
        KafkaConfig(bootstrap_servers=["127.0.0.1:9"]),
        f"http://10.1.2.3:{port}",
        lambda n: ("base", None),
        sink=FakeSink(),
        keys=keys.store,
        timeout_s=2,
    )
    with serve(app) as url:
        answer = chat(url, keys.client)
    assert answer.status_code == 502 and error(answer)["code"] == "upstream_unreachable"
    assert "10.1.2.3" not in answer.text and str(port) not in answer.text


# --- feedback ---------------------------------------------------------------------------------------


def _served(gateway: str, key: str, **extra: Any) -> tuple[str, str]:
    answer = chat(gateway, key, **extra)
    assert answer.status_code == 200
    return answer.headers[TRACE_HEADER], answer.headers[FEEDBACK_HEADER]


def test_feedback_needs_the_token_of_that_trace_and_that_key(gateway: str, keys: Keys, sink: FakeSink) -> None:
    trace_id, token = _served(gateway, keys.client)
    other_trace, other_token = _served(gateway, keys.client)
    stored = len(sink.feedback)
    cases = [
        (keys.client, {"trace_id": trace_id, "thumbs": "up"}, 400, "feedback token"),
        (keys.client, {"trace_id": trace_id, "thumbs": "up", "feedback_token": token[:-3] + "AAA"}, 403, "signature"),
        (keys.client, {"trace_id": trace_id, "thumbs": "up", "feedback_token": other_token}, 403, "another trace"),
        (keys.other, {"trace_id": trace_id, "thumbs": "up", "feedback_token": token}, 403, "another API key"),
        (keys.client, {"trace_id": "never-issued", "thumbs": "up", "feedback_token": token}, 403, "another trace"),
        (None, {"trace_id": trace_id, "thumbs": "up", "feedback_token": token}, 401, "API key"),
        (keys.client, {"trace_id": trace_id, "reward": 10, "feedback_token": token}, 403, "trusted-grader"),
    ]
    for key, body, status, says in cases:
        answer = post(gateway, "/v1/feedback", key, body)
        assert answer.status_code == status and says in error(answer)["message"], (body, answer.text)
    assert len(sink.feedback) == stored, "refused feedback is never published"
    surrogate = post(
        gateway,
        "/v1/feedback",
        keys.client,
        content=b'{"trace_id": "t", "thumbs": "up", "metadata": {"note": "\\ud800"}}',
    )
    assert surrogate.status_code == 400 and "Unicode" in error(surrogate)["message"]

    header_token = post(
        gateway,
        "/v1/feedback",
        keys.client,
        {"trace_id": other_trace, "thumbs": "down"},
        headers={FEEDBACK_HEADER: other_token},
    )
    assert header_token.status_code == 200


def test_repeated_votes_carry_one_voter_identity_and_rewards_are_graders_only_and_clipped(
    gateway: str, keys: Keys, sink: FakeSink
) -> None:
    trace_id, token = _served(gateway, keys.client, user="carol")
    voter = sink.trace(trace_id).metadata["user_hash"]
    for thumbs in ("up", "down", "up"):
        body = {
            "trace_id": trace_id,
            "thumbs": thumbs,
            "feedback_token": token,
            "metadata": {"user_hash": f"sock-{thumbs}"},
        }
        assert post(gateway, "/v1/feedback", keys.client, body).status_code == 200
    votes = [f for f in sink.feedback if f.trace_id == trace_id]
    assert len(votes) == 3 and {v.metadata["user_hash"] for v in votes} == {voter}, (
        "one voter: the buffer keeps one vote"
    )

    graded_id, graded_token = _served(gateway, keys.grader)
    answer = post(
        gateway, "/v1/feedback", keys.grader, {"trace_id": graded_id, "reward": 10, "feedback_token": graded_token}
    )
    assert answer.status_code == 200
    assert [f.reward for f in sink.feedback if f.trace_id == graded_id] == [1.0], (
        "explicit rewards are clipped to [-1, 1]"
    )
    metrics = httpx.get(f"{gateway}/metrics").text
    grader_id = keys.grader.split("-")[1]
    assert f'hourglass_gateway_feedback_total{{key_id="{grader_id}"}}' in metrics
    assert 'hourglass_feedback_reward_bucket{le="1.0"}' in metrics


def test_feedback_tokens_expire_and_do_not_survive_a_key_rotation() -> None:
    signer = FeedbackSigner(b"k" * 32, ttl_s=60)
    token = signer.issue("t1", "key1", "user", now=1000.0)
    assert signer.verify(token, "t1", "key1", now=1059.0).user_hash == "user"
    with pytest.raises(FeedbackTokenError, match="expired"):
        signer.verify(token, "t1", "key1", now=1061.0)
    with pytest.raises(FeedbackTokenError, match="signature"):
        FeedbackSigner(b"n" * 32, ttl_s=60).verify(token, "t1", "key1", now=1001.0)


# --- the key store -------------------------------------------------------------------------------------


def test_keys_are_stored_hashed_in_a_private_file_and_listed_without_secrets(tmp_path: Path) -> None:
    from pipeline.cli.main import app

    conf = tmp_path / "h.toml"
    conf.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    runner = CliRunner()
    created = runner.invoke(
        app, ["keys", "create", "acme", "--rate-per-min", "30", "--tokens-per-min", "5000", "--json", "-c", str(conf)]
    )
    assert created.exit_code == 0, created.output
    record = json.loads(created.stdout)
    key, key_id = record["key"], record["key_id"]
    file = tmp_path / "state" / "gateway-keys.json"
    assert stat.S_IMODE(os.stat(file).st_mode) == 0o600
    assert key not in file.read_text() and key_id in file.read_text()
    assert KeyStore(file).authenticate(key).rate_per_min == 30
    assert KeyStore(file).authenticate(key).tokens_per_min == 5000
    table = runner.invoke(app, ["keys", "list", "-c", str(conf)], env={"COLUMNS": "80"})
    assert key_id in table.stdout  # the id `keys revoke` takes is never cut, even on a narrow terminal
    listed = runner.invoke(app, ["keys", "list", "--json", "-c", str(conf)])
    assert key not in listed.stdout and "sha256" not in listed.stdout and json.loads(listed.stdout)[0]["name"] == "acme"
    assert runner.invoke(app, ["keys", "revoke", key_id, "-c", str(conf)]).exit_code == 0
    assert json.loads(runner.invoke(app, ["keys", "list", "--json", "-c", str(conf)]).stdout)[0]["revoked"] is True
    assert runner.invoke(app, ["keys", "revoke", "000000000000", "-c", str(conf)]).exit_code == 1
    small = runner.invoke(app, ["keys", "create", "tiny", "--tokens-per-min", "500", "-c", str(conf)])
    assert small.exit_code == 0 and "must send max_tokens <= 500" in " ".join(small.stdout.split())


# --- the configured gateway (hourglass gateway) --------------------------------------------------------


def test_the_configured_gateway_uses_the_state_dir_keys_and_a_private_signing_key(
    tmp_path: Path, upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.cli.gateway import build_gateway, feedback_signer, key_store
    from pipeline.config import load_config

    conf = tmp_path / "h.toml"
    conf.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[serving]\nreplicas = ["{upstream.url}"]\n'  # type: ignore[attr-defined]
        '[kafka]\nbootstrap_servers = ["127.0.0.1:9"]\n'
    )
    monkeypatch.setenv("HOURGLASS_SERVING__API_KEY", UPSTREAM_KEY)
    cfg = load_config(conf)
    _, key = key_store(cfg).create("cli-made")
    with serve(build_gateway(cfg)) as url:
        assert chat(url, "").status_code == 401
        answer = chat(url, key)
        assert (
            answer.status_code == 200 and upstream.requests[-1]["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
        )
    signing = tmp_path / "state" / "gateway-feedback.key"
    assert stat.S_IMODE(os.stat(signing).st_mode) == 0o600
    trace_id, token = answer.headers[TRACE_HEADER], answer.headers[FEEDBACK_HEADER]
    key_id = key.split("-")[1]
    assert feedback_signer(cfg).verify(token, trace_id, key_id), "a restarted gateway still verifies its tokens"
    monkeypatch.setenv("HOURGLASS_GATEWAY__FEEDBACK_SIGNING_KEY", "r" * 40)  # rotation: old tokens stop verifying
    with pytest.raises(FeedbackTokenError, match="signature"):
        feedback_signer(load_config(conf)).verify(token, trace_id, key_id)


def test_a_damaged_key_file_refuses_everyone_with_503(tmp_path: Path, upstream: FakeUpstream) -> None:
    store = KeyStore(tmp_path / "gateway-keys.json")
    _, key = store.create("client")
    app = create_gateway_app(
        KafkaConfig(bootstrap_servers=["127.0.0.1:9"]),
        upstream.url,
        lambda n: ("base", None),  # type: ignore[attr-defined]
        sink=FakeSink(),
        keys=store,
    )
    with serve(app) as url:
        assert chat(url, key).status_code == 200
        (tmp_path / "gateway-keys.json").write_text("{not json")
        answer = chat(url, key)
    assert answer.status_code == 503 and error(answer)["type"] == "service_unavailable"


def test_a_short_signing_key_is_refused_without_being_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    monkeypatch.setenv("HOURGLASS_GATEWAY__FEEDBACK_SIGNING_KEY", "short-secret-value")
    with pytest.raises(ConfigError) as err:
        load_config(None)
    problems = " ".join(err.value.problems)
    assert (
        "gateway.feedback_signing_key" in problems
        and "32 characters" in problems
        and "short-secret-value" not in problems
    )


def test_nan_literals_non_ascii_token_signatures_and_boolean_ratings_are_4xx() -> None:
    """Found by a red-team pass: NaN/Infinity literals in a forwarded field, a feedback token whose signature
    part is not ASCII, and a boolean rating each gave a 500 or were stored; each is a 400/403 now."""
    from connectors.gateway.auth import FeedbackSigner, FeedbackTokenError
    from connectors.gateway.app import FeedbackIn
    from connectors.config import GatewayConfig
    from connectors.gateway.request import RequestRefused, check_request, parse_json

    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        body = parse_json(
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":' + literal + b"}", max_depth=32
        )
        with pytest.raises(RequestRefused) as refused:
            check_request("chat", body, GatewayConfig())
        assert (
            refused.value.status == 400 and refused.value.param == "temperature" and "finite" in refused.value.message
        )
    signer = FeedbackSigner(b"k" * 32, ttl_s=600)
    token = signer.issue("trace-1", "key-1", "user-1")
    with pytest.raises(FeedbackTokenError):
        signer.verify(token.partition(".")[0] + ".é", trace_id="trace-1", key_id="key-1")
    for forged in ("é." + token.partition(".")[2], "\ud800.abc"):  # a non-ASCII payload was a 500
        with pytest.raises(FeedbackTokenError):
            signer.verify(forged, trace_id="trace-1", key_id="key-1")
    for rating in (True, 3.0):
        with pytest.raises(ValueError):
            FeedbackIn(trace_id="t", rating=rating)
    with pytest.raises(ValueError) as echoed:  # a red-team pass: the whole value came back in the 422
        FeedbackIn(trace_id="t", thumbs="x" * 100_000)
    assert "thumbs" in str(echoed.value) and len(str(echoed.value)) < 1000


def test_a_content_length_of_unicode_digits_is_not_a_500() -> None:
    """Found by a red-team pass: "²".isdigit() is True and int("²") raises, so a Content-Length of b"\\xb2"
    (headers are read as Latin-1) escaped read_body as a ValueError where the ASGI server lets it through."""
    import asyncio

    from starlette.requests import Request

    from connectors.gateway.request import read_body

    async def body(length: bytes) -> bytes:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", length)]}
        return await read_body(Request(scope, receive), max_bytes=100, timeout_s=5)

    for length in (b"\xb2", b"1\xb9"):
        assert asyncio.run(body(length)) == b"{}"  # the bytes that arrived are what is capped


def test_a_huge_integer_is_a_400_without_cpython_advice() -> None:
    """Found by a red-team pass: the 400 told the client to call sys.set_int_max_str_digits()."""
    from connectors.gateway.request import RequestRefused, parse_json

    with pytest.raises(RequestRefused) as refused:
        parse_json(b'{"rating":' + b"9" * 5000 + b"}", max_depth=32)
    assert refused.value.status == 400 and "digits" in refused.value.message
    assert "sys." not in refused.value.message


# --- one reading of every input, and limits that do not spend each other (issue 24) -------------------------


@pytest.mark.parametrize(
    ("content", "content_type", "status", "complaint"),
    [
        (b"\xef\xbb\xbf" + json.dumps({"model": "hourglass", "messages": MESSAGES}).encode(), None, 400, "byte order"),
        (json.dumps({"model": "hourglass", "messages": MESSAGES}).encode("utf-16"), None, 400, "byte order"),
        (json.dumps({"model": "hourglass", "messages": MESSAGES}).encode("utf-16-be"), None, 400, "UTF-16 or UTF-32"),
        (json.dumps({"model": "hourglass", "messages": MESSAGES}).encode("utf-32-le"), None, 400, "UTF-16 or UTF-32"),
        (
            json.dumps({"model": "hourglass", "messages": MESSAGES}).encode(),
            "application/json; charset=utf-16",
            415,
            "charset",
        ),
        (
            json.dumps({"model": "hourglass", "messages": MESSAGES}).encode(),
            'application/json; charset="latin1"',
            415,
            "charset",
        ),
        (b'{"model": "hourglass", "model": "other", "messages": []}', None, 400, "twice"),
    ],
)
def test_json_bodies_are_utf8_and_read_one_way_only(
    gateway: str,
    keys: Keys,
    upstream: FakeUpstream,
    content: bytes,
    content_type: str | None,
    status: int,
    complaint: str,
) -> None:
    seen = len(upstream.requests)
    headers = {"content-type": content_type} if content_type else None
    answer = post(gateway, "/v1/chat/completions", keys.client, content=content, headers=headers)
    assert answer.status_code == status and complaint in error(answer)["message"], answer.text
    ok = post(gateway, "/v1/chat/completions", keys.client, content=content.removeprefix(b"\xef\xbb\xbf"))
    assert len(upstream.requests) == seen + (ok.status_code == 200)  # only a plain UTF-8 body got through
    assert content_type or ok.status_code in (200, 400)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_numbers_in_feedback_metadata_are_a_400_naming_the_field(
    gateway: str, keys: Keys, sink: FakeSink, literal: bytes
) -> None:
    """As in a chat request: NaN in feedback metadata was stored as null."""
    trace_id, token = _served(gateway, keys.client)
    stored = len(sink.feedback)
    body = b'{"trace_id": "%s", "thumbs": "up", "feedback_token": "%s", "metadata": {"score": %s}}' % (
        trace_id.encode(),
        token.encode(),
        literal,
    )
    answer = post(gateway, "/v1/feedback", keys.client, content=body)
    assert answer.status_code == 400, answer.text
    assert error(answer)["param"] == "metadata.score" and "finite" in error(answer)["message"]
    assert len(sink.feedback) == stored


def test_a_concurrency_refusal_spends_no_rate_token(keys: Keys, sink: FakeSink) -> None:
    """A 429 for concurrency spent a rate token: 200 requests refused while 4 were in flight left the key
    (rate 30/min) with nothing, so it was served 9 of a 200-request burst instead of up to its rate."""
    slow = FakeUpstream(slow_s=600)  # its slow streams outlast the test, however loaded the machine
    with serve(slow.app) as upstream_url:
        app = create_gateway_app(
            KafkaConfig(bootstrap_servers=["127.0.0.1:9"]),
            upstream_url,
            lambda name: ("base", None),
            sink=sink,  # type: ignore[arg-type]
            keys=keys.store,
        )
        with serve(app) as gateway:
            _burst(gateway, keys)


def _burst(gateway: str, keys: Keys) -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    key = keys.store.create("burst", rate_per_min=30, concurrency=4)[1]
    body = {"model": "hourglass", "messages": [{"role": "user", "content": "slow"}], "max_tokens": 4, "stream": True}
    held: list[tuple[httpx.Response, Any]] = []
    http = httpx.Client(timeout=30)
    try:
        for _ in range(4):  # 4 slow streams hold the key's 4 slots (and spend 4 of its 30 tokens)
            response = http.send(
                http.build_request(
                    "POST", f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
                ),
                stream=True,
            )
            assert response.status_code == 200
            chunks = response.iter_raw()
            next(chunks)  # streaming (the iterator is kept: dropping it would close the stream)
            held.append((response, chunks))
        started = time.monotonic()
        refused = [chat(gateway, key) for _ in range(200)]
        assert {r.status_code for r in refused} == {429}
        assert {error(r)["code"] for r in refused} == {"too_many_concurrent_requests"}
    finally:
        for response, _ in held:
            response.close()
        http.close()
    time.sleep(1.0)  # the hung-up streams give their slots back
    served = sum(chat(gateway, key).status_code == 200 for _ in range(30))
    refill = (time.monotonic() - started) * 30 / 60
    assert 26 <= served <= 26 + refill + 1, served  # 30 tokens, 4 spent by the held streams; none by the 429s

    fresh = keys.store.create("burst-2", rate_per_min=30, concurrency=4)[1]
    started = time.monotonic()
    lock = threading.Lock()
    codes: list[int] = []

    def one(_: int) -> None:
        code = chat(gateway, fresh).status_code
        with lock:
            codes.append(code)

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(one, range(200)))
    refill = (time.monotonic() - started) * 30 / 60
    assert len(codes) == 200 and set(codes) <= {200, 429}
    assert 25 <= codes.count(200) <= 30 + refill + 1, codes.count(200)  # up to the rate, not 9


@pytest.mark.parametrize("role", [[], ["user"], {"role": "user"}, "r" * 100_000])
def test_a_message_role_that_is_not_a_string_is_a_400_naming_messages(gateway: str, keys: Keys, role: Any) -> None:
    """Found by a red-team pass: a list or object role was a 500 (unhashable in the role set), and a long one
    came back whole in the 400."""
    response = post(
        gateway,
        "/v1/chat/completions",
        keys.client,
        {"model": "hourglass", "messages": [{"role": role, "content": "x"}]},
    )
    assert response.status_code == 400, response.text[:300]
    err = error(response)
    assert err["param"] == "messages" and "messages.0.role" in err["message"] and len(err["message"]) < 500


@pytest.mark.parametrize("kind", [[], {"type": "text"}])
def test_a_response_format_type_that_is_not_a_string_is_a_400(gateway: str, keys: Keys, kind: Any) -> None:
    """Found by a red-team pass: an unhashable response_format.type was a 500."""
    response = chat(gateway, keys.client, response_format={"type": kind})
    assert response.status_code == 400, response.text[:300]
    assert error(response)["param"] == "response_format"
