"""Hostile inputs from a review of the gateway: each test is one request that used to crash, stall or slip
past a check, and asserts what a client must see instead (status and the field named in the error).

In process: the real app, an in-memory model server, a recording sink (``test_gateway_logic``'s helpers).
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from connectors.config import GatewayConfig
from connectors.gateway import tools
from tests.connectors.gateway.gateway_fakes import FakeSink
from tests.connectors.gateway.test_gateway_logic import MESSAGES, Gateway, Keys, error, keys, make_gateway  # noqa: F401


@pytest.fixture
def gw(keys: Keys) -> Iterator[Gateway]:  # noqa: F811
    sink = FakeSink()
    http, upstream = make_gateway(keys, sink)
    with http:
        yield Gateway(http, upstream, sink, keys)


def _peak(work: Any) -> tuple[Any, int]:
    """What ``work()`` returns and the most memory it held at once (tracemalloc, bytes)."""
    tracemalloc.start()
    try:
        result = work()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _raw(gw: Gateway, body: bytes, path: str = "/v1/chat/completions") -> Any:
    headers = {"authorization": f"Bearer {gw.keys.client}", "content-type": "application/json"}
    return gw.http.post(path, content=body, headers=headers)


def test_a_long_key_over_a_long_list_costs_no_more_memory_than_its_body(gw: Gateway) -> None:
    """Every value's dotted path was built (and, in the parser, kept on a stack) as a string: a 20 kB key over
    a list of 40 000 zeros (a 100 kB body) took 800 MiB and seconds; a 1 MiB body took over 100 GB (the
    gateway killed for memory). The path is only spelled out for an error."""
    key = "k" * 20_000
    body = json.dumps(
        {"model": "hourglass", "messages": MESSAGES, "metadata": {key: [0] * 40_000}}, separators=(",", ":")
    ).encode()
    response, peak = _peak(lambda: _raw(gw, body))
    assert response.status_code == 400, response.text
    assert error(response)["param"] == "metadata"  # over gateway.max_metadata_bytes
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.0f} MiB for a {len(body)} byte body"
    assert gw.upstream.requests == []


def test_a_megabyte_of_zeros_nested_deep_costs_little_more_than_parsing_it() -> None:
    """The parser's walk kept a path tuple per value on its stack: a list of 490 000 zeros nested 29 deep (a
    1 MiB body) took 178 MB and 3 s beside the parsed body's own 5 MB. Only containers are walked now, each
    with a link to its parent; the walk must stay small, and its errors still name the path."""
    from connectors.json_body import JsonBodyError, parse

    body = b'{"a":' + b"[" * 28 + b"[" + b",".join([b"0"] * 490_000) + b"]" + b"]" * 28 + b"}"
    assert len(body) > 900_000
    value, peak = _peak(lambda: parse(body, max_depth=64))
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.0f} MiB for a {len(body)} byte body"  # json.loads' own: 5 MB
    leaf = value["a"]
    for _ in range(28):
        leaf = leaf[0]
    assert len(leaf) == 490_000
    with pytest.raises(JsonBodyError) as err:
        parse(body, max_depth=20)
    assert err.value.where == "body.a" + ".0" * 19  # the first list deeper than 20: body 1, a 2, a.0 3, ...
    with pytest.raises(JsonBodyError) as err:
        parse(b'{"a":[[{"b":["x","\\ud800"]}]]}', max_depth=64)
    assert err.value.where == "body.a.0.0.b.1"


def test_a_bad_value_under_a_long_key_names_the_field_without_echoing_the_key(gw: Gateway) -> None:
    key = "k" * 100_000
    nan = b'{"model":"hourglass","messages":[{"role":"user","content":"x"}],"metadata":{"' + key.encode() + b'":NaN}}'
    surrogate = b'{"model":"hourglass","messages":[],"' + key.encode() + b'":"\\ud800"}'
    for body in (nan, surrogate):
        response = _raw(gw, body)
        assert response.status_code == 400, response.text
        err = error(response)
        assert err["param"].startswith("metadata.kkkk" if body is nan else "kkkk")
        assert len(response.content) < 2000, f"{len(response.content)} bytes of error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "hourglass", "messages": MESSAGES, "x" * 300_000: 1}, "xxxx"),
        ({"model": "hourglass", "messages": [{"role": "user", "content": "hi", "x" * 300_000: 1}]}, "messages"),
        (
            {
                "model": "hourglass",
                "messages": MESSAGES,
                "tools": [{"type": "function", "function": {"name": "f", "x" * 300_000: 1}}],
            },
            "tools.0",
        ),
    ],
)
def test_an_unknown_field_with_a_huge_name_is_named_not_echoed_whole(
    gw: Gateway, body: dict[str, Any], param: str
) -> None:
    response = gw.post("/v1/chat/completions", body, gw.keys.client)
    assert response.status_code == 400, response.text
    assert error(response)["param"].startswith(param)
    assert len(response.content) < 2000, f"{len(response.content)} bytes of error"


def test_feedback_with_an_unknown_field_of_a_huge_name_is_a_short_422(gw: Gateway) -> None:
    response = gw.post("/v1/feedback", {"trace_id": "t", "thumbs": "up", "y" * 300_000: 1}, gw.keys.client)
    assert response.status_code == 422, response.text
    assert error(response)["param"].startswith("yyyy")
    assert len(response.content) < 2000, f"{len(response.content)} bytes of error"


def test_a_json_schema_format_without_a_schema_is_a_400_naming_it(gw: Gateway) -> None:
    """vLLM 0.32 turns ``json_schema`` without ``schema`` into StructuredOutputsParams(json=None) and refuses
    it with "You must use one kind of structured outputs constraint but none are specified: {...}" (its
    internals, no field)."""
    for spec in ({"name": "answer"}, {"name": "answer", "schema": None}):
        response = gw.chat(response_format={"type": "json_schema", "json_schema": spec})
        assert response.status_code == 400, response.text
        assert error(response)["param"] == "response_format.json_schema.schema"
    assert gw.upstream.requests == []


def test_tool_definitions_over_the_prompt_size_are_refused_before_their_schemas_are_compiled(
    keys: Keys,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Schema validation costs ~3 s of CPU per MiB of tool definitions (on the event loop); definitions that
    cannot fit in gateway.max_prompt_chars were all validated before that size was checked."""
    checked: list[str] = []
    real = tools.check_schema
    monkeypatch.setattr(tools, "check_schema", lambda schema, where: (checked.append(where), real(schema, where)))
    http, upstream = make_gateway(keys, FakeSink(), gateway=GatewayConfig(max_prompt_chars=1000))
    params = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20)}}  # ~500 bytes
    offered = [{"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(10)]
    with http:
        response = http.post(
            "/v1/chat/completions",
            json={"model": "hourglass", "messages": MESSAGES, "tools": offered},
            headers={"authorization": f"Bearer {keys.client}"},
        )
    assert response.status_code == 400, response.text
    assert error(response)["param"] == "tools"
    assert "gateway.max_prompt_chars" in error(response)["message"]
    assert len(checked) <= 2, f"{len(checked)} schemas validated for a request refused for its size"
    assert upstream.requests == []


def test_two_authorization_headers_are_a_400_naming_neither_key(gw: Gateway) -> None:
    """The first ``Authorization`` header silently won; a proxy in front may read the last. Refused before
    anything runs, like two ``Host`` headers, and the error echoes neither value (one may be a valid key)."""
    body = {"model": "hourglass", "messages": MESSAGES}
    for second in (f"Bearer {gw.keys.client}", "Bearer other-secret-value"):
        headers = [("authorization", f"Bearer {gw.keys.client}"), ("authorization", second)]
        response = gw.http.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 400, response.text
        err = error(response)
        assert err["code"] == "duplicate_authorization_header" and err["param"] is None
        assert "2 Authorization headers" in err["message"]
        assert gw.keys.client not in response.text and "other-secret-value" not in response.text
    assert gw.upstream.requests == []
    assert gw.chat().status_code == 200  # one Authorization header: served


def test_two_content_type_headers_are_a_400(gw: Gateway) -> None:
    """Starlette reads the first ``Content-Type``, a proxy in front may judge the body by the last: refused."""
    body = json.dumps({"model": "hourglass", "messages": MESSAGES}).encode()
    for second in ("application/json", "text/plain"):
        headers = [
            ("authorization", f"Bearer {gw.keys.client}"),
            ("content-type", "application/json"),
            ("content-type", second),
        ]
        response = gw.http.post("/v1/chat/completions", content=body, headers=headers)
        assert response.status_code == 400, response.text
        err = error(response)
        assert err["code"] == "duplicate_content_type_header" and "2 Content-Type headers" in err["message"]
    assert gw.upstream.requests == []


def test_two_feedback_tokens_are_a_400_and_a_huge_content_type_is_not_echoed(gw: Gateway) -> None:
    """Two feedback tokens: the gateway would judge the first, a proxy the last; refused. A 200 kB
    Content-Type is refused with a 415 that names it cut short (helper-29's findings)."""
    body = json.dumps({"model": "hourglass", "messages": MESSAGES}).encode()
    auth = ("authorization", f"Bearer {gw.keys.client}")
    tokens = [("x-hourglass-feedback-token", "a.b"), ("x-hourglass-feedback-token", "c.d")]
    response = gw.http.post(
        "/v1/chat/completions", content=body, headers=[auth, ("content-type", "application/json"), *tokens]
    )
    assert response.status_code == 400 and error(response)["code"] == "duplicate_feedback_token_header"
    huge = "a" * 200_000
    for content_type in (huge, f"application/json; charset={huge}"):
        response = gw.http.post("/v1/chat/completions", content=body, headers=[auth, ("content-type", content_type)])
        assert response.status_code == 415, response.text
        assert len(response.content) < 1_000 and "a" * 41 not in response.text
    assert gw.upstream.requests == []


@pytest.mark.parametrize(
    ("prompt", "param"),
    [("", "prompt"), (["fine", ""], "prompt.1"), ([""], "prompt.0"), ([], "prompt"), ([5, -1], "prompt.1")],
)
def test_an_empty_completions_prompt_is_a_400_naming_it(gw: Gateway, prompt: Any, param: str) -> None:
    """vLLM answers an empty prompt with a 400 naming no field ("The decoder prompt cannot be empty"); a negative
    token id (an index into the vocabulary) is refused here too."""
    response = gw.post("/v1/completions", {"model": "hourglass", "prompt": prompt, "max_tokens": 4}, gw.keys.client)
    assert response.status_code == 400, response.text
    assert error(response)["param"] == param
    assert gw.upstream.requests == []


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("GET", "/v1/nope", 404, None),
        ("POST", "/v1/nope", 404, None),
        ("GET", "/" + "x" * 5000, 404, None),
        ("DELETE", "/v1/chat/completions", 405, "POST"),
        ("GET", "/v1/completions", 405, "POST"),
        ("POST", "/v1/models", 405, "GET"),
    ],
)
def test_unknown_paths_and_wrong_methods_answer_the_openai_error_body(
    gw: Gateway, method: str, path: str, status: int, allow: str | None
) -> None:
    """They answered FastAPI's ``{"detail": ...}``: an OpenAI client expects ``{"error": {...}}``."""
    headers = {"authorization": f"Bearer {gw.keys.client}", "content-type": "application/json"}
    response = gw.http.request(method, path, headers=headers, content=b"{}")
    assert response.status_code == status, response.text
    err = error(response)
    assert err["type"] == "invalid_request_error" and err["param"] is None
    assert err["code"] == ("unknown_url" if status == 404 else "method_not_allowed")
    assert len(response.content) < 500, f"{len(response.content)} bytes of error"
    if allow is not None:
        assert allow in response.headers["allow"]
    assert gw.upstream.requests == []


def test_a_key_given_twice_is_a_400_naming_the_object_it_is_in(gw: Gateway) -> None:
    """The parser's hook sees no path: a duplicate key was a 400 naming no field."""
    body = b'{"model":"hourglass","messages":[{"role":"user","content":"a","content":"b"}]}'
    response = _raw(gw, body)
    assert response.status_code == 400, response.text
    err = error(response)
    assert err["param"] == "messages.0" and "'content' twice in one object (at body.messages.0)" in err["message"]
    long_key = "k" * 100_000
    body = json.dumps({"model": "hourglass", "messages": MESSAGES}).encode()[:-1]
    body += f',"metadata":{{"{long_key}":1,"{long_key}":2}}}}'.encode()
    response = _raw(gw, body)
    assert response.status_code == 400 and error(response)["param"] == "metadata"
    assert len(response.content) < 2000  # the key is named cut, not echoed
    assert gw.upstream.requests == []


def test_the_finite_number_check_costs_memory_by_depth_not_size(gw: Gateway) -> None:
    """``check_finite`` kept a path tuple per value (as the parser's walk did): 480,000 zeros 29 deep in
    ``metadata`` (a 960 kB body, refused for its size after) took 178 MiB in the request's check (helper-30)."""
    body = json.dumps({"model": "hourglass", "messages": MESSAGES}).encode()[:-1]
    body += b',"metadata":{"a":' + b"[" * 28 + b",".join([b"0"] * 480_000) + b"]" * 28 + b"}}"
    response, peak = _peak(lambda: _raw(gw, body))
    assert response.status_code == 400 and error(response)["param"] == "metadata", response.text
    assert peak < 48 * 2**20, f"peak {peak / 2**20:.0f} MiB for a {len(body)} byte body"  # parsing itself: ~5 MB
    deep_nan = b'{"model":"hourglass","messages":[{"role":"user","content":"x"}],"temperature":' + b"[" * 5
    response = _raw(gw, deep_nan + b"1,[NaN]" + b"]" * 5 + b"}")
    assert response.status_code == 400 and error(response)["param"] == "temperature.0.0.0.0.1.0"


def test_a_megabyte_of_empty_objects_costs_memory_by_depth_not_count() -> None:
    """One stack entry per container: 350,000 ``{}`` (a 1 MiB body) took 77 MiB beside json.loads' 25."""
    from connectors.json_body import parse

    body = b"[" + b",".join([b"{}"] * 350_000) + b"]"
    value, peak = _peak(lambda: parse(body, max_depth=4))
    assert len(value) == 350_000
    assert peak < 40 * 2**20, f"peak {peak / 2**20:.0f} MiB"
