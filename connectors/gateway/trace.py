"""Pure request/response rewriting of the gateway, and trace assembly.

The gateway asks vLLM for more than the client did (per-token log-probabilities
and completion token ids, so traces carry the behaviour policy exactly), then
removes what the client did not ask for, so the client sees a plain OpenAI
response. This module holds that logic with no I/O, so it is unit-testable.

vLLM request fields used (vLLM 0.32 OpenAI server, ``ChatCompletionRequest`` /
``CompletionRequest``): ``logprobs`` + ``top_logprobs`` (chat), ``logprobs``
(int, completions) and ``return_token_ids`` (adds ``choices[i].token_ids`` and
``prompt_token_ids``; in streams, ``token_ids`` of each chunk is the delta).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

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
    for choice in payload.get("choices") or []:
        if not asked.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        if not asked.token_ids:
            for key in _TOKEN_ID_KEYS:
                choice.pop(key, None)
    return payload


@dataclass
class Completion:
    """The first choice's output, assembled from a response or from stream chunks."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add_choice(self, endpoint: Endpoint, choice: dict[str, Any], *, delta: bool) -> None:
        """Fold one choice (a full one, or a stream chunk's when ``delta``) into this completion."""
        if endpoint == "chat":
            message = choice.get("delta" if delta else "message") or {}
            text = message.get("content")
            lp = choice.get("logprobs") or {}
            self.logprobs.extend(entry.get("logprob") for entry in lp.get("content") or [])
        else:
            text = choice.get("text")
            lp = choice.get("logprobs") or {}
            self.logprobs.extend(lp.get("token_logprobs") or [])
        if isinstance(text, str):
            self.text_parts.append(text)
        self.token_ids.extend(choice.get("token_ids") or [])
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def add_payload(self, endpoint: Endpoint, payload: dict[str, Any], *, delta: bool) -> None:
        """Fold the index-0 choice of a response / chunk, and its usage if present."""
        for choice in payload.get("choices") or []:
            if choice.get("index", 0) == 0:
                self.add_choice(endpoint, choice, delta=delta)
        if payload.get("usage"):
            self.usage = payload["usage"]

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
    key_hash: str | None = None,
) -> TraceEvent | None:
    """The trace event of one served request, or None when the prompt cannot be traced.

    ``metadata`` = ``body["metadata"]`` as the gateway prepared it (a trusted
    grader's label keys such as ``reference_answer`` at the top, other client
    keys under ``client``, see :func:`connectors.gateway.request.client_metadata`)
    plus the gateway's keys: ``endpoint``, ``served_name``, ``stream``,
    ``finish_reason``, ``latency_ms``, ``usage``, ``max_tokens`` (the generation bound vLLM was
    given: the client's, or ``gateway.max_tokens`` when it sent none), ``user_hash`` (the caller's
    identity hash, when given) and ``key_hash`` (the keyed hash of the caller's API key id, when given: the
    unit rounds and canaries cap per client). Raises pydantic.ValidationError when the event is invalid.
    """
    prompt = trace_prompt(endpoint, body)
    if prompt is None:
        return None
    client_meta = body.get("metadata")
    metadata: dict[str, Any] = dict(client_meta) if isinstance(client_meta, dict) else {}
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
    ids, lps = completion.token_fields()
    return TraceEvent(
        trace_id=trace_id,
        ts=datetime.now(UTC),
        model=public_name,
        adapter_version=adapter_version,
        prompt=prompt,  # type: ignore[arg-type]
        completion=completion.text,
        completion_token_ids=ids,
        completion_logprobs=lps,
        metadata=metadata,
    )
