"""What the gateway accepts from a client (body size, content type, JSON shape, allowed fields and caps),
and how it answers a refusal (an OpenAI-style error) or streams (closing upstream whatever happens).

Everything here raises :class:`RequestRefused` (an HTTP status plus an
OpenAI-style error) and has no other I/O than reading the request body, so
each rule is unit-testable and the gateway turns a refusal into one 4xx.

Allowed request fields (OpenAI Chat Completions / Completions, plus a few
vLLM sampling extras that are bounded by ``max_tokens``; anything else,
e.g. ``prompt_embeds``, ``chat_template``, ``chat_template_kwargs``,
``guided_*``, ``logit_bias``, ``best_of``, gets a 400 naming it):
see :data:`ALLOWED`. Function tools (``tools``, ``tool_choice``,
``parallel_tool_calls``, assistant ``tool_calls``, ``tool`` messages) are
checked by :mod:`connectors.gateway.tools`.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, NamedTuple

import anyio
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from connectors import json_body
from connectors.config import GatewayConfig
from connectors.errors import ConnectorError
from connectors.gateway.tools import (
    NULL_ONLY_KEYS,
    ToolHistory,
    ToolRefused,
    check_message_tools,
    check_schema,
    check_tool_choice,
    check_tools,
    forwarded_message,
    ref_cycle,
)
from connectors.gateway.trace import Endpoint
from connectors.schema import CHAT_ROLES

_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "stream",
        "stream_options",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "user",
        "metadata",
        # vLLM sampling extras: bounded by max_tokens, no server-side side effects
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "min_tokens",
        "return_token_ids",
    }
)
ALLOWED: dict[str, frozenset[str]] = {
    "chat": _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
    "completions": _COMMON | {"prompt", "echo"},
}
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"}) | NULL_ONLY_KEYS
# the keys each response_format type takes (OpenAI's, as vLLM 0.32 reads them); anything else is a 400
_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_RESPONSE_FORMATS = frozenset(_FORMAT_KEYS)
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})
_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
# Flags the gateway reads itself (stream: SSE relay and trace; logprobs / return_token_ids: what to strip):
# JSON booleans only, so the gateway and vLLM (which reads "false" or "no" as false) agree on them.
_FLAGS: dict[str, tuple[str, ...]] = {
    "chat": ("stream", "logprobs", "return_token_ids", "ignore_eos", "parallel_tool_calls"),
    "completions": ("stream", "echo", "return_token_ids", "ignore_eos"),
}
MAX_USER_CHARS = 256


class RequestRefused(ConnectorError, ValueError):
    """A client request the gateway refuses: ``status`` and an OpenAI-style error (type, param, code)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type_, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def openai_error(
    status: int,
    message: str,
    *,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error response in the OpenAI format."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def refused(err: RequestRefused) -> JSONResponse:
    return openai_error(err.status, err.message, type_=err.type_, param=err.param, code=err.code, headers=err.headers)


def _dotted(loc: Sequence[Any]) -> str:
    return ".".join(map(json_body.short, loc))  # a field name the client made up may be 1 MiB long


_MAX_ERRORS = 5


def describe_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """``field.path: message; ...`` of pydantic validation errors (``loc`` relative to the body): the first
    five, long field names cut (a body of 50 000 unknown keys is not a 2 MB error)."""
    shown = "; ".join(f"{_dotted(e['loc']) or 'body'}: {e['msg']}" for e in errors[:_MAX_ERRORS])
    return shown + (f" (+{len(errors) - _MAX_ERRORS} more)" if len(errors) > _MAX_ERRORS else "")


def error_param(errors: Sequence[Mapping[str, Any]]) -> str | None:
    """The OpenAI error ``param`` of a body pydantic refused: the dotted ``loc`` of the first error that names
    a field (``rating``, ``metadata.user``); None when none does (a rule across fields)."""
    return next((_dotted(e["loc"]) for e in errors if e["loc"]), None)


class SingleHeaders:
    """ASGI middleware: a request with more than one ``Host`` header (RFC 9112 section 3.2), ``Authorization``,
    ``Content-Type`` or ``x-hourglass-feedback-token`` header is a 400, before any route runs. Starlette reads the first, a proxy or
    cache in front may read the last (and judge the body by another type): never guess. The error names how
    many, never their values (a key)."""

    _SINGLE = (
        (b"host", "Host", "duplicate_host_header"),
        (b"authorization", "Authorization", "duplicate_authorization_header"),
        (b"content-type", "Content-Type", "duplicate_content_type_header"),
        (b"x-hourglass-feedback-token", "x-hourglass-feedback-token", "duplicate_feedback_token_header"),
    )

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, shown, code in self._SINGLE:
                seen = sum(1 for key, _ in scope["headers"] if key == name)  # ASGI header names are lowercase
                if seen > 1:
                    response = openai_error(
                        400, f"{seen} {shown} headers: send exactly one", type_="invalid_request_error", code=code
                    )
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class ClosingStream(StreamingResponse):
    """A streaming response that always runs ``on_close`` (close upstream, free the concurrency slot),
    also when the client hangs up before or while the body streams."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Any], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._on_close()


def check_content_type(request: Request) -> None:
    """Only ``application/json`` bodies, UTF-8 (a ``text/plain`` POST is what a cross-site form can send;
    a ``charset=utf-16`` body is read another way by another parser).

    Raises:
        RequestRefused: 415.
    """
    try:
        json_body.check_media_type(request.headers.get("content-type"))
    except json_body.JsonBodyError as err:
        raise RequestRefused(415, err.message, code="unsupported_media_type") from None


async def read_body(request: Request, max_bytes: int, timeout_s: float | None = None) -> bytes:
    """The request body, read in chunks and refused as soon as it passes ``max_bytes``, or when it has not
    fully arrived within ``timeout_s`` seconds.

    Raises:
        RequestRefused: 413 (``Content-Length`` or the bytes received exceed the cap), 408 (too slow),
            499 (the client hung up mid-body: logged and counted, nobody reads the answer).
    """
    declared = request.headers.get("content-length")
    too_big = RequestRefused(
        413, f"request body is larger than gateway.max_body_bytes={max_bytes} bytes", code="request_too_large"
    )
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > max_bytes:  # not ²
        raise too_big
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise too_big
                chunks.append(chunk)
    except TimeoutError:
        raise RequestRefused(
            408,
            f"request body not received within gateway.body_timeout_s={timeout_s:g} s ({size} bytes arrived)",
            code="request_timeout",
        ) from None
    except ClientDisconnect:
        raise RequestRefused(499, "the client hung up before sending the whole body", code="client_gone") from None
    return b"".join(chunks)


def parse_json(raw: bytes, max_depth: int) -> Any:
    """Parse a JSON body read one way only (:mod:`connectors.json_body`: UTF-8 without a BOM, each key once,
    valid Unicode, at most ``max_depth`` deep).

    Raises:
        RequestRefused: 400 naming what is wrong (and the field, where there is one).
    """
    try:
        return json_body.parse(raw, max_depth)
    except json_body.JsonBodyError as err:
        message = err.message.replace(f"{max_depth} levels", f"gateway.max_json_depth={max_depth}")
        raise RequestRefused(err.status, message, param=err.param) from None


_INT64 = 1 << 63


def check_finite(value: Any, where: str) -> None:
    """Refuse NaN / Infinity (``json.loads`` accepts those literals; they are not JSON and cannot be forwarded)
    and integers beyond 64 bits (no field needs one; vLLM answered ``top_k: 1e30`` written as an integer with a 500).
    The path of a value is spelled out only for its error (:func:`connectors.json_body.entries`: memory by depth,
    not size; :func:`connectors.json_body.dotted`: long keys cut)."""
    _check_number(value, None, where)
    for link, key, child, _ in json_body.entries(value):
        _check_number(child, (link, key), where)


def _check_number(item: Any, link: json_body.Link, where: str) -> None:
    if isinstance(item, float) and not math.isfinite(item):
        at = json_body.dotted(json_body.path_of(link), where)
        raise RequestRefused(400, f"{at} is {item!r}: numbers must be finite", param=at.removeprefix("body."))
    if isinstance(item, int) and not isinstance(item, bool) and not -_INT64 <= item < _INT64:
        at = json_body.dotted(json_body.path_of(link), where)
        raise RequestRefused(
            400, f"{at} is {str(item)[:40]}...: integers must fit in 64 bits", param=at.removeprefix("body.")
        )


def _int_cap(body: dict[str, Any], name: str, cap: int, config_name: str, low: int = 1) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise RequestRefused(400, f"field {name!r} must be {what}, got {value!r}", param=name)
    if value > cap:
        raise RequestRefused(
            400, f"field {name!r} is {value}, above this gateway's limit {config_name}={cap}", param=name
        )


def _check_stop(stop: Any, cfg: GatewayConfig) -> None:
    """``stop``: a string or a list of at most ``gateway.max_stop`` strings, each 1 to ``gateway.max_stop_chars``
    characters. vLLM searches every stop string at every generated token, so their number and size are work
    the client would set without bound; vLLM's own 400 for an empty one names no field."""
    if stop is None:
        return
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise RequestRefused(400, "field 'stop' must be a string or a list of strings", param="stop")
    if len(items) > cfg.max_stop:
        raise RequestRefused(
            400, f"field 'stop' has {len(items)} strings, above gateway.max_stop={cfg.max_stop}", param="stop"
        )
    for i, item in enumerate(items):
        where = "stop" if isinstance(stop, str) else f"stop.{i}"
        if not isinstance(item, str) or not item:
            raise RequestRefused(400, f"{where} must be a non-empty string", param=where)
        if len(item) > cfg.max_stop_chars:
            raise RequestRefused(
                400,
                f"{where} has {len(item)} characters, above gateway.max_stop_chars={cfg.max_stop_chars}",
                param=where,
            )


class _Range(NamedTuple):
    integer: bool  # integers only (else any finite number)
    low: float
    high: float
    open_low: bool = False  # ``low`` itself is out of range


# Sampling numbers, vLLM 0.32's own ranges (SamplingParams._verify_args), checked here so a refusal names its
# field (vLLM's 400 has no param) and so a JSON true, which vLLM's lax parsing reads as 1, is refused rather
# than sampled with.
_NUMBERS: dict[str, _Range] = {
    "temperature": _Range(False, 0.0, 2.0),
    "top_p": _Range(False, 0.0, 1.0, open_low=True),
    "presence_penalty": _Range(False, -2.0, 2.0),
    "frequency_penalty": _Range(False, -2.0, 2.0),
    "repetition_penalty": _Range(False, 0.0, math.inf, open_low=True),
    "min_p": _Range(False, 0.0, 1.0),
    "top_k": _Range(True, -1, _INT64),
    "seed": _Range(True, -_INT64, _INT64),
    "top_logprobs": _Range(True, 0, 20),
}


_COMPLETION_LOGPROBS = _Range(True, 0, 20)  # on completions, logprobs is a count (on chat, a flag)


def _check_numbers(endpoint: Endpoint, body: dict[str, Any]) -> None:
    ranges = _NUMBERS | ({"logprobs": _COMPLETION_LOGPROBS} if endpoint == "completions" else {})
    for name, (integer, low, high, open_low) in ranges.items():
        value = body.get(name)
        if value is None:
            continue
        kind = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise RequestRefused(400, f"field {name!r} must be {kind}, got {str(value)[:50]!r}", param=name)
        if value < low or (open_low and value == low) or value > high:
            bounds = f"{'(' if open_low else '['}{low:g}, {high:g}]"
            raise RequestRefused(400, f"field {name!r} is {value!r}, outside {bounds}", param=name)
    # vLLM reads max_completion_tokens first when both are given
    low_tokens, high_tokens = body.get("min_tokens"), body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(low_tokens, int) and isinstance(high_tokens, int) and low_tokens > high_tokens:
        raise RequestRefused(
            400, f"field 'min_tokens' is {low_tokens}, above max_tokens={high_tokens}", param="min_tokens"
        )


def check_request(endpoint: Endpoint, body: dict[str, Any], cfg: GatewayConfig) -> None:
    """Allowed fields and caps of one chat / completions request (types of the rest are vLLM's to check).

    Raises:
        RequestRefused: 400 naming the field.
    """
    extra = sorted(set(body) - ALLOWED[endpoint])
    if extra:
        raise RequestRefused(
            400,
            f"field {json_body.short(extra[0])!r} is not accepted by this gateway; allowed fields: "
            f"{', '.join(sorted(ALLOWED[endpoint]))}",
            param=json_body.short(extra[0]),
        )
    check_finite(body, "body")
    for name in _FLAGS[endpoint]:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise RequestRefused(
                400, f"field {name!r} must be true or false (a JSON boolean), got {str(value)[:50]!r}", param=name
            )
    _int_cap(body, "n", cfg.max_n, "gateway.max_n")
    _int_cap(body, "max_tokens", cfg.max_tokens, "gateway.max_tokens")
    _int_cap(body, "max_completion_tokens", cfg.max_tokens, "gateway.max_tokens")
    _int_cap(body, "min_tokens", cfg.max_tokens, "gateway.max_tokens", low=0)  # 0: vLLM's default, no minimum
    _check_numbers(endpoint, body)
    check_stream_options(body)
    _check_stop(body.get("stop"), cfg)
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise RequestRefused(400, f"field 'user' must be a string of at most {MAX_USER_CHARS} characters", param="user")
    meta = body.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise RequestRefused(
                400, f"field 'metadata' must be an object, got {type(meta).__name__}", param="metadata"
            )
        size = len(json.dumps(meta, separators=(",", ":")))
        if size > cfg.max_metadata_bytes:
            raise RequestRefused(
                400,
                f"field 'metadata' is {size} bytes, above gateway.max_metadata_bytes={cfg.max_metadata_bytes}",
                param="metadata",
            )
        hint = meta.get("conversation_id")
        if hint is not None and (not isinstance(hint, str) or not 1 <= len(hint) <= MAX_USER_CHARS):
            raise RequestRefused(
                400,
                f"metadata.conversation_id must be a string of 1-{MAX_USER_CHARS} characters (your conversation id)",
                param="metadata.conversation_id",
            )
    if endpoint == "chat":
        try:
            names, tool_chars = check_tools(body["tools"], cfg) if body.get("tools") is not None else (None, 0)
            check_tool_choice(body.get("tool_choice"), names)
        except ToolRefused as err:
            raise RequestRefused(400, err.message, param=err.param) from None
        _check_messages(body.get("messages"), cfg, tool_chars)
        _check_response_format(body.get("response_format"), cfg)
    else:
        _check_prompt(body.get("prompt"), cfg)


_GENERATION_BOUNDS = {"chat": ("max_completion_tokens", "max_tokens"), "completions": ("max_tokens",)}


def bound_generation(body: dict[str, Any], default_max_tokens: int) -> tuple[dict[str, Any], int]:
    """Every generation bounded: ``(body to forward, max_tokens bound vLLM applies)``. A body with no
    ``max_tokens`` / ``max_completion_tokens`` (absent or null) gets ``max_tokens = default_max_tokens``
    (``gateway.max_tokens``); without it vLLM generates to the end of the context (``ignore_eos`` too).
    Explicit nulls are dropped. Call after :func:`check_request` (the values are checked positive ints).

    Raises:
        RequestRefused: ``min_tokens`` above the default bound of a body that sets none (400 naming it; a bound
            the client set was checked against by :func:`check_request`).
    """
    out = {k: v for k, v in body.items() if not (k in ("max_tokens", "max_completion_tokens") and v is None)}
    given = out.get("max_completion_tokens") or out.get("max_tokens")  # vLLM's order for chat
    if given is not None:
        return out, int(given)
    low = out.get("min_tokens")
    if isinstance(low, int) and low > default_max_tokens:
        raise RequestRefused(
            400,
            f"field 'min_tokens' is {low}, above max_tokens={default_max_tokens} (the gateway's default bound: the "
            "request sets no max_tokens)",
            param="min_tokens",
        )
    out["max_tokens"] = default_max_tokens
    return out, default_max_tokens


def forwarded_messages(body: dict[str, Any]) -> dict[str, Any]:
    """A checked chat body with each message as it goes upstream and into the trace
    (:func:`~connectors.gateway.tools.forwarded_message`: the null keys an SDK echoes back dropped)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    out = [forwarded_message(m) for m in messages]
    return body if all(a is b for a, b in zip(out, messages)) else {**body, "messages": out}


def _check_messages(messages: Any, cfg: GatewayConfig, tool_chars: int = 0) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestRefused(
            400, "field 'messages' must be a non-empty list of {role, content} objects", param="messages"
        )
    if len(messages) > cfg.max_messages:
        raise RequestRefused(
            400, f"{len(messages)} messages, above gateway.max_messages={cfg.max_messages}", param="messages"
        )
    if tool_chars > cfg.max_prompt_chars:  # the tool definitions alone do not fit: name them, not the messages
        raise RequestRefused(
            400,
            f"tool definitions hold {tool_chars} characters, above gateway.max_prompt_chars={cfg.max_prompt_chars}",
            param="tools",
        )
    chars = tool_chars  # tool definitions are rendered into the prompt too
    history = ToolHistory()
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise RequestRefused(400, f"{where} must be an object with role and content", param="messages")
        extra = sorted(set(message) - _MESSAGE_KEYS)
        if extra:
            raise RequestRefused(
                400,
                f"{where}.{json_body.short(extra[0])} is not accepted; a message has only {sorted(_MESSAGE_KEYS)}",
                param="messages",
            )
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:  # a list or object role is unhashable
            shown = repr(role[:64]) if isinstance(role, str) else f"a {type(role).__name__}"
            raise RequestRefused(400, f"{where}.role {shown} is not one of {sorted(CHAT_ROLES)}", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):  # text parts only: an image_url part would make vLLM fetch a URL
            for j, part in enumerate(content):
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                    and set(part) <= {"type", "text"}
                ):
                    raise RequestRefused(
                        400, f"{where}.content.{j} must be a text part {{type: 'text', text}}", param="messages"
                    )
                chars += len(part["text"])
        elif content is not None:
            raise RequestRefused(400, f"{where}.content must be a string or a list of text parts", param="messages")
        name = message.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > MAX_USER_CHARS):
            raise RequestRefused(
                400, f"{where}.name must be a string of at most {MAX_USER_CHARS} characters", param="messages"
            )
        try:
            check_message_tools(message, where, history, cfg)
        except ToolRefused as err:
            raise RequestRefused(400, err.message, param=err.param) from None
    chars += history.chars
    if chars > cfg.max_prompt_chars:
        raise RequestRefused(
            400,
            f"messages (and tool definitions) hold {chars} characters, above gateway.max_prompt_chars="
            f"{cfg.max_prompt_chars}",
            param="messages",
        )


def _check_prompt(prompt: Any, cfg: GatewayConfig) -> None:
    # vLLM refuses an empty prompt with a 400 naming no field ("The decoder prompt cannot be empty"): name it here
    if isinstance(prompt, str):
        if not prompt:
            raise RequestRefused(400, "field 'prompt' must not be empty", param="prompt")
        size = len(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise RequestRefused(400, "field 'prompt' must not be an empty list", param="prompt")
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        if len(prompt) > cfg.max_n:
            raise RequestRefused(
                400, f"a batch of {len(prompt)} prompts, above gateway.max_n={cfg.max_n}", param="prompt"
            )
        empty = next((i for i, p in enumerate(prompt) if not p), None)
        if empty is not None:
            raise RequestRefused(400, f"prompt.{empty} must not be empty", param=f"prompt.{empty}")
        size = sum(len(p) for p in prompt)
    elif isinstance(prompt, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        negative = next((i for i, p in enumerate(prompt) if p < 0), None)  # a token id indexes the vocabulary
        if negative is not None:
            raise RequestRefused(400, f"prompt.{negative} is a negative token id", param=f"prompt.{negative}")
        size = len(prompt)  # one prompt as token ids
    else:
        raise RequestRefused(
            400, "field 'prompt' must be a string, a list of strings, or a list of token ids", param="prompt"
        )
    if size > cfg.max_prompt_chars:
        raise RequestRefused(
            400, f"prompt has {size} characters, above gateway.max_prompt_chars={cfg.max_prompt_chars}", param="prompt"
        )


def _check_response_format(fmt: Any, cfg: GatewayConfig) -> None:
    if fmt is None:
        return
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str) or fmt["type"] not in _RESPONSE_FORMATS:
        raise RequestRefused(
            400,
            f"field 'response_format' must be an object with type in {sorted(_RESPONSE_FORMATS)}",
            param="response_format",
        )
    size = len(json.dumps(fmt, separators=(",", ":")))
    if size > cfg.max_schema_bytes:
        raise RequestRefused(
            400,
            f"field 'response_format' is {size} bytes, above gateway.max_schema_bytes={cfg.max_schema_bytes}",
            param="response_format",
        )
    extra = sorted(set(fmt) - _FORMAT_KEYS[fmt["type"]])
    if extra:
        raise RequestRefused(
            400,
            f"response_format of type {fmt['type']!r} takes no {extra[0][:40]!r}",
            param=f"response_format.{extra[0][:40]}",
        )
    spec = fmt.get("json_schema")
    if fmt["type"] == "json_schema":
        _check_json_schema_format(spec)
    schema = spec.get("schema") if isinstance(spec, dict) else None
    cycle = ref_cycle(schema) if isinstance(schema, dict) else None
    if cycle is not None:
        raise RequestRefused(
            400,
            f"response_format's schema refers to itself through {cycle[:100]!r} with nothing in between: "
            "no output can match it",
            param="response_format",
        )


def _check_json_schema_format(spec: Any) -> None:
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise RequestRefused(400, f"{where} must be an object with a name and a schema", param=where)
    extra = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if extra:
        raise RequestRefused(400, f"{where} takes no {extra[0][:40]!r}", param=f"{where}.{extra[0][:40]}")
    name = spec.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise RequestRefused(400, f"{where}.name must be a string of 1-64 characters", param=f"{where}.name")
    for key, kind in (("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise RequestRefused(400, f"{where}.{key} must be a {kind.__name__}", param=f"{where}.{key}")
    # required: vLLM 0.32 reads a json_schema format without one as no constraint at all and refuses it with a 400
    # that names its internals ("You must use one kind of structured outputs constraint but none are specified")
    try:
        check_schema(spec.get("schema"), f"{where}.schema")
    except ToolRefused as err:
        raise RequestRefused(400, err.message, param=err.param) from None


def check_stream_options(body: dict[str, Any]) -> None:
    """``stream_options``: an object of known boolean options, only with ``stream: true`` (vLLM's refusal
    named no field, and it took unknown keys and a string ``include_usage`` silently)."""
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise RequestRefused(400, "field 'stream_options' must be an object", param="stream_options")
    if body.get("stream") is not True:
        raise RequestRefused(400, "field 'stream_options' needs 'stream': true", param="stream_options")
    for key, value in options.items():
        if key not in _STREAM_OPTIONS:
            raise RequestRefused(
                400,
                f"stream_options takes {sorted(_STREAM_OPTIONS)}, not {str(key)[:40]!r}",
                param=f"stream_options.{str(key)[:40]}",
            )
        if value is not None and not isinstance(value, bool):
            raise RequestRefused(400, f"stream_options.{key} must be true or false", param=f"stream_options.{key}")


def client_metadata(meta: dict[str, Any] | None, *, trusted: bool, trusted_keys: list[str]) -> dict[str, Any]:
    """Request metadata as the trace stores it: a trusted grader's ``trusted_keys`` at the top (labels),
    everything else under ``client``; a client's ``user_hash`` and ``key_hash`` are dropped (the gateway sets them)."""
    meta = {k: v for k, v in (meta or {}).items() if k not in ("user_hash", "key_hash")}
    top = {k: meta.pop(k) for k in list(meta) if trusted and k in trusted_keys}
    if meta:
        top["client"] = meta
    return top
