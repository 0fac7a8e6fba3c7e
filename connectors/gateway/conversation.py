"""Conversation linking in the gateway: each chat trace's ``conversation_id``, ``turn`` and ``parent_trace_id``,
derived from the request's messages with keyed hashes, so apps need no change.

Contract (docs/architecture.md, "Conversations"):

- The namespace of every hash is the caller's identity (``metadata.user_hash``: the API key id, plus the
  request's ``user`` when it sends one), so keys never link into each other's conversations.
- ``conversation_id`` = ``conv-`` + keyed hash of the namespace and the messages up to and including the
  first user message (every turn of one chat repeats that prefix), or of the namespace and the client's
  ``metadata.conversation_id`` when it sends one (a hint inside its namespace only).
- ``turn`` = the assistant messages already in the prompt (0-based index of the answered turn).
- The request *continues* trace T when its messages are T's prompt, then T's answer as an assistant message
  (text and tool calls), then new messages. Each answered trace is remembered under the keyed hash of
  (namespace, prompt + answer) in a bounded TTL store (``gateway.conversation_cache_entries``,
  ``gateway.conversation_ttl_s``); a request looks up the hash of its messages up to each assistant message,
  the last first. The trace stores both hashes (``metadata.conversation``: ``continues``, ``answer``) so that a
  snapshot links what a gateway replica could not (another replica answered the parent, a restart).

Messages are compared in a canonical form (role, content as text, name, tool calls as (id, name,
arguments), tool_call_id), so an app that appends the SDK's message object (with null ``refusal``...) and one
that appends a plain dict continue the same trace.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cachetools import TTLCache

from connectors.schema import content_text

CONVERSATION_PREFIX = "conv-"
_HEX_CHARS = 32  # 128-bit hashes


@dataclass(frozen=True)
class TurnLink:
    """Where one chat request sits in its conversation (see the module doc)."""

    conversation_id: str
    turn: int
    parent_trace_id: str | None
    continues: str | None  # hash of the messages up to the assistant answer this request continues; None: no answer


def canonical_message(message: dict[str, Any]) -> bytes:
    """One message in the form conversation hashes compare (compact JSON, sorted keys; never a raw newline)."""
    out: dict[str, Any] = {"role": message.get("role"), "content": content_text(message.get("content"))}
    if message.get("name") is not None:
        out["name"] = message["name"]
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            [c.get("id") or "", (c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments")]
            for c in calls
            if isinstance(c, dict)
        ]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    return json.dumps(out, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


class PromptHash:
    """The keyed hash of (namespace, prompt messages), ready to be extended by the answer."""

    def __init__(self, mac: hmac.HMAC) -> None:
        self._mac = mac

    def with_answer(self, answer: dict[str, Any]) -> str:
        """The hash a request continuing this prompt + ``answer`` (an assistant message) looks up."""
        mac = self._mac.copy()
        mac.update(canonical_message(answer) + b"\n")
        return mac.hexdigest()[:_HEX_CHARS]


class ConversationLinker:
    """Derives :class:`TurnLink` values and remembers answered traces (thread-safe; bounded).

    Args:
        key: the HMAC key (the gateway's ``UserHasher.derive("conversation")``: shared by every replica that
            shares ``buffer.user_hash_key``, so conversation ids agree across replicas).
        entries: answers remembered at most (0: none; the oldest go first).
        ttl_s: how long an answer stays linkable, seconds.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, key: bytes, *, entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._key = key
        self._answers: TTLCache[str, str] | None = (
            TTLCache(maxsize=entries, ttl=ttl_s, timer=clock) if entries > 0 else None
        )
        self._lock = threading.Lock()

    def _mac(self, label: bytes, namespace: str) -> hmac.HMAC:
        return hmac.new(
            self._key, label + b"\x00" + namespace.encode("utf-8", "surrogatepass") + b"\x00", hashlib.sha256
        )

    def link(self, namespace: str, messages: Sequence[dict[str, Any]], hint: str | None) -> tuple[TurnLink, PromptHash]:
        """The request's place in its conversation, and its prompt hash (for :meth:`remember`)."""
        mac = self._mac(b"turn", namespace)
        first_user: bytes | None = None
        at_assistant: list[str] = []  # hash of the messages up to each assistant message, in order
        for message in messages:
            mac.update(canonical_message(message) + b"\n")
            role = message.get("role")
            if role == "user" and first_user is None:
                first_user = mac.copy().digest()
            elif role == "assistant":
                at_assistant.append(mac.copy().hexdigest()[:_HEX_CHARS])
        if hint is not None:
            opening = self._mac(b"hint", namespace)
            opening.update(hint.encode("utf-8", "surrogatepass"))
        else:
            opening = hmac.new(self._key, b"conversation\x00" + (first_user or mac.copy().digest()), hashlib.sha256)
        conversation_id = CONVERSATION_PREFIX + opening.hexdigest()[:_HEX_CHARS]
        parent, continues = None, (at_assistant[-1] if at_assistant else None)
        if self._answers is not None:
            with self._lock:
                for candidate in reversed(at_assistant):
                    parent = self._answers.get(candidate)
                    if parent is not None:
                        continues = candidate
                        break
        return TurnLink(conversation_id, len(at_assistant), parent, continues), PromptHash(mac)

    def remember(self, answer_hash: str, trace_id: str) -> None:
        """Remember that ``trace_id`` answered the prompt whose continuation hash is ``answer_hash``."""
        if self._answers is not None:
            with self._lock:
                self._answers[answer_hash] = trace_id
