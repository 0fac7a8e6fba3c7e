"""Pure request/response rewriting of the gateway, and trace assembly.

The gateway asks vLLM for more than the client did (per-token log-probabilities
and completion token ids, so traces carry the behaviour policy exactly), then
removes what the client did not ask for, so the client sees a plain OpenAI
response. This module holds that logic with no I/O, so it is unit-testable.

vLLM request fields used (vLLM 0.32 OpenAI server, ``ChatCompletionRequest`` /
``CompletionRequest``): ``logprobs`` + ``top_logprobs`` (chat), ``logprobs``
(int, completions) and ``return_token_ids`` (adds ``choices[i].token_ids`` and
``prompt_token_ids``; in streams, ``token_ids`` of each chunk is the delta and
``prompt_token_ids`` comes in the first chunk). Tool calls: ``message.tool_calls``
(``[{"id", "type", "function": {"name", "arguments"}}]``) in a response, and
``delta.tool_calls`` fragments keyed by ``index`` in a stream (the first fragment
of a call carries its ``id`` and name, later ones pieces of ``arguments``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from connectors.gateway.conversation import TurnLink
from connectors.schema import TraceEvent

Endpoint = Literal["chat", "completions"]
_TOKEN_ID_KEYS = ("token_ids", "prompt_token_ids")


@dataclass(frozen=True)
class ClientAsked:
    """What the client itself asked for (so the extras the gateway adds can be removed), and the public
    model name it asked for (the response names it, never the served ``<model>-v<version>``: that would
    tell a client which side of a canary answered, and name internal versions)."""

    logprobs: bool
    token_ids: bool
    model: str | None = None

    @classmethod
    def of(cls, endpoint: Endpoint, body: dict[str, Any]) -> ClientAsked:
        # chat: logprobs is a bool; completions: an int where 0 is a real request.
        asked = bool(body.get("logprobs")) if endpoint == "chat" else body.get("logprobs") is not None
        model = body.get("model")
        return cls(
            logprobs=asked,
            token_ids=bool(body.get("return_token_ids")),
            model=model if isinstance(model, str) else None,
        )


def upstream_body(endpoint: Endpoint, body: dict[str, Any], served_name: str) -> dict[str, Any]:
    """The request to send to vLLM: ``model`` rewritten, log-probs and token ids requested, ``metadata`` and the
    raw ``user`` (an end-user id, possibly an e-mail address) removed."""
    out = {k: v for k, v in body.items() if k not in ("metadata", "user")}
    out["model"] = served_name
    if endpoint == "chat":
        if not out.get("logprobs"):
            out["logprobs"] = True
            out["top_logprobs"] = 0
    elif out.get("logprobs") is None:
        out["logprobs"] = 1
    out["return_token_ids"] = True
    return out


def strip_extras(payload: dict[str, Any], asked: ClientAsked) -> dict[str, Any]:
    """Remove log-probs / token ids the client did not ask for, from a response or a stream chunk (in place),
    and put back the public model name the client asked for."""
    if asked.model is not None and "model" in payload:
        payload["model"] = asked.model
    if not asked.token_ids:
        payload.pop("prompt_token_ids", None)
    for choice in _choices(payload):
        if not asked.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        if not asked.token_ids:
            for key in _TOKEN_ID_KEYS:
                choice.pop(key, None)
    return payload


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _choices(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's or chunk's choices that are objects. The model server's answer is read defensively (a
    ``choices``, ``message``, ``logprobs`` or ``usage`` of another JSON type raised AttributeError: a 500, a
    stream cut midway, or a trace lost with a traceback); what is not of the expected type counts as absent."""
    return [c for c in _list(payload.get("choices")) if isinstance(c, dict)]


@dataclass
class Completion:
    """The first choice's output, assembled from a response or from stream chunks."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    # Tool calls by their index in the choice: {"id", "type", "function": {"name", "arguments"}} (streams
    # send pieces: the first with id and name, the rest arguments text to append).
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        """The answer's tool calls in order (None when it called none)."""
        if not self.calls:
            return None
        return [self.calls[i] for i in sorted(self.calls)]

    def answer_message(self) -> dict[str, Any]:
        """The answer as the assistant message a client sends back to continue the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = self.tool_calls
        return message

    def _add_tool_calls(self, calls: Any, *, delta: bool) -> None:
        if not isinstance(calls, list):
            return
        for position, call in enumerate(calls):
            if not isinstance(call, dict):
                continue
            index = call.get("index", position) if delta else position
            if not isinstance(index, int):
                continue
            given = call.get("function")
            fn: dict[str, Any] = given if isinstance(given, dict) else {}
            slot = self.calls.setdefault(
                index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            target: dict[str, str] = slot["function"]
            if isinstance(call.get("id"), str) and call["id"]:
                slot["id"] = call["id"]
            for key in ("name", "arguments"):  # a stream sends pieces to append; a response the whole value
                piece = fn.get(key)
                if isinstance(piece, str):
                    target[key] = target[key] + piece if delta else piece

    def add_choice(self, endpoint: Endpoint, choice: dict[str, Any], *, delta: bool) -> None:
        """Fold one choice (a full one, or a stream chunk's when ``delta``) into this completion."""
        lp = _dict(choice.get("logprobs"))
        if endpoint == "chat":
            message = _dict(choice.get("delta" if delta else "message"))
            text = message.get("content")
            self._add_tool_calls(message.get("tool_calls"), delta=delta)
            self.logprobs.extend(_dict(entry).get("logprob") for entry in _list(lp.get("content")))
        else:
            text = choice.get("text")
            self.logprobs.extend(_list(lp.get("token_logprobs")))
        if isinstance(text, str):
            self.text_parts.append(text)
        self.token_ids.extend(_list(choice.get("token_ids")))
        if isinstance(choice.get("finish_reason"), str) and choice["finish_reason"]:
            self.finish_reason = choice["finish_reason"]

    def add_payload(self, endpoint: Endpoint, payload: dict[str, Any], *, delta: bool) -> None:
        """Fold the index-0 choice of a response / chunk, and its usage if present."""
        for choice in _choices(payload):
            if choice.get("index", 0) == 0:
                self.add_choice(endpoint, choice, delta=delta)
        if payload.get("usage") and isinstance(payload["usage"], dict):
            self.usage = payload["usage"]
        prompt_ids = payload.get("prompt_token_ids")
        if isinstance(prompt_ids, list) and prompt_ids and self.prompt_token_ids is None:
            self.prompt_token_ids = prompt_ids  # a stream sends them in its first chunk only

    def usage_counts(self) -> dict[str, int] | None:
        """``{"prompt_tokens", "completion_tokens"}`` from vLLM's usage, else counted from the token ids (a
        stream reports usage only when the client asked for it)."""
        usage = self.usage or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if not isinstance(prompt, int) and self.prompt_token_ids is not None:
            prompt = len(self.prompt_token_ids)
        if not isinstance(completion, int) and self.token_ids:
            completion = len(self.token_ids)
        out = {k: v for k, v in (("prompt_tokens", prompt), ("completion_tokens", completion)) if isinstance(v, int)}
        return out or None

    def token_fields(self) -> tuple[list[int] | None, list[float] | None]:
        """``(completion_token_ids, completion_logprobs)`` for the trace; log-probs are dropped when not one
        finite value per token id (the trace contract requires them aligned and finite)."""
        ids = self.token_ids or None
        lps = self.logprobs
        if not lps or ids is None or len(lps) != len(ids):
            return ids, None
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in lps):
            return ids, None
        return ids, [float(v) for v in lps]  # type: ignore[arg-type]


def trace_prompt(endpoint: Endpoint, body: dict[str, Any]) -> list[dict[str, Any]] | str | None:
    """The prompt as the trace stores it: chat messages or one text; None when not traceable
    (a batch of prompts, or token-id prompts)."""
    if endpoint == "chat":
        messages = body.get("messages")
        return messages if isinstance(messages, list) and messages else None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def build_trace(
    *,
    trace_id: str,
    endpoint: Endpoint,
    body: dict[str, Any],
    public_name: str,
    served_name: str,
    adapter_version: str | None,
    completion: Completion,
    stream: bool,
    latency_ms: float,
    user_hash: str | None,
    max_tokens: int | None = None,
    link: TurnLink | None = None,
    answer_hash: str | None = None,
    key_hash: str | None = None,
) -> TraceEvent | None:
    """The trace event (``hourglass.trace/v2``) of one served request, or None when the prompt cannot be traced.

    Conversation fields: ``tools`` (as offered), ``completion_tool_calls``, ``finish_reason``,
    ``prompt_token_ids`` / ``completion_token_ids`` / ``completion_logprobs`` (what vLLM used), ``usage``, and
    from ``link`` (chat only) ``conversation_id``, ``turn``, ``parent_trace_id``.

    ``metadata`` = ``body["metadata"]`` as the gateway prepared it (a trusted
    grader's label keys such as ``reference_answer`` at the top, other client
    keys under ``client``, see :func:`connectors.gateway.request.client_metadata`)
    plus the gateway's keys: ``endpoint``, ``served_name``, ``stream``,
    ``finish_reason``, ``latency_ms``, ``usage``, ``max_tokens`` (the generation bound vLLM was
    given: the client's, or ``gateway.max_tokens`` when it sent none), ``user_hash`` (the caller's
    identity hash, when given), ``key_hash`` (the keyed hash of the caller's API key id, when given: the
    unit rounds and canaries cap per client), ``tool_choice`` / ``parallel_tool_calls`` (when the request set
    them) and ``conversation`` (``continues``: ``link.continues``, ``answer``: ``answer_hash``; the hashes a
    snapshot links turns by, see :mod:`connectors.gateway.conversation`). Raises pydantic.ValidationError when
    the event is invalid.
    """
    prompt = trace_prompt(endpoint, body)
    if prompt is None:
        return None
    client_meta = body.get("metadata")
    metadata: dict[str, Any] = dict(client_meta) if isinstance(client_meta, dict) else {}
    usage = completion.usage_counts()
    metadata.update(
        endpoint=endpoint,
        served_name=served_name,
        stream=stream,
        finish_reason=completion.finish_reason,
        latency_ms=round(latency_ms, 3),
    )
    if completion.usage:
        metadata["usage"] = completion.usage
    if max_tokens is not None:
        metadata["max_tokens"] = max_tokens
    if user_hash is not None:
        metadata["user_hash"] = user_hash
    metadata.pop("key_hash", None)  # only the gateway sets it
    if key_hash is not None:
        metadata["key_hash"] = key_hash
    for key in ("tool_choice", "parallel_tool_calls"):
        if body.get(key) is not None:
            metadata[key] = body[key]
    hashes = {
        k: v for k, v in (("continues", link.continues if link else None), ("answer", answer_hash)) if v is not None
    }
    if hashes:
        metadata["conversation"] = hashes
    ids, lps = completion.token_fields()
    tools = body.get("tools") if endpoint == "chat" else None
    return TraceEvent(
        trace_id=trace_id,
        ts=datetime.now(UTC),
        model=public_name,
        adapter_version=adapter_version,
        prompt=prompt,  # type: ignore[arg-type]
        completion=completion.text,
        completion_token_ids=ids,
        completion_logprobs=lps,
        tools=tools or None,
        completion_tool_calls=completion.tool_calls,  # type: ignore[arg-type]  # validated into ToolCall
        finish_reason=completion.finish_reason,
        prompt_token_ids=completion.prompt_token_ids,
        usage=usage,  # type: ignore[arg-type]  # validated into Usage
        conversation_id=link.conversation_id if link else None,
        turn=link.turn if link else None,
        parent_trace_id=link.parent_trace_id if link else None,
        metadata=metadata,
    )
