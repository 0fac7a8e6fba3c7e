"""Implicit feedback: what a user did after an answer, read from the linked turns of a snapshot.

Most answers are never rated; nearly every one is followed by behaviour. A snapshot
(:meth:`connectors.buffer.RewardBuffer.snapshot`) derives these signals per trace from the
conversation links the gateway writes (``conversation_id``, ``turn``, ``parent_trace_id``: see
docs/architecture.md, "Conversations"), with no client change:

=============  =====================================================================================
signal         the trace T gets it when ...
=============  =====================================================================================
continued      a later turn C continues T's answer (``C.parent_trace_id == T``) within the window and
               C's new user message is not a rephrase of T's
rephrased      such a C's newest user message restates T's: the word-set Jaccard similarity of the
               two (lower-cased words of letters and digits) is at least ``rephrase_similarity``
regenerated    the same prompt (identical messages, same conversation, turn and parent) is sent again
               within the window: the user asked for another answer
tool_error     T's answer called tools and the tool result that a later turn sends back for one of
               them reports an error (``{"error": ...}`` JSON, or text starting with an error word)
abandoned      nothing followed T (no continuation, no regeneration) and the window has closed.
               A satisfied last turn looks the same: the weight defaults to 0 (recorded, not used)
=============  =====================================================================================

A turn whose answer called tools is not judged by the user directly: the app runs the calls and sends
the results back as the next turn C, and the user reacts to the answer that came after them. So such a
turn takes the user's verdict on C's answer: C's ``continued``, ``rephrased`` and ``abandoned`` (``via`` in
the provenance names the turn whose answer the user judged, ``after_s`` counts from T), through any chain
of tool turns (C's answer may call tools again), as an outcome reward credits every step of an episode.
``regenerated`` is not passed back (the user asked for another answer to the same tool results, which
says nothing about the calls), nor ``tool_error`` (an error of C's own calls).

A signal that cannot be decided yet (the window is still open at ``now``) is absent, never negative:
a trace younger than the window gets ``continued`` / ``rephrased`` / ``regenerated`` / ``tool_error``
as soon as the evidence is there, and ``abandoned`` only once the window has closed. Each derived signal
carries its provenance (the trace that showed it, seconds after T, the window) in the snapshot's
``implicit`` column.

Why at snapshot time, not in the gateway or at ingest: the evidence for T is a *later* trace, which may
have been answered by another gateway replica, arrive after a restart, or come from a producer other than
the gateway (Kafka, OpenTelemetry), so only a reader that sees all traces of the window can decide; the
snapshot is also where late feedback joins today, and it re-decides on every read, so nothing stored has
to be rewritten when the evidence arrives. The gateway's links are scoped to one caller's identity
(keyed hashes per API key and user), so one user's turns never count as another's behaviour.

Explicit feedback wins: :mod:`connectors.reward` uses the derived signals only for a trace that has no
explicit ``reward``, ``thumbs`` or ``rating``.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from connectors.config import ImplicitConfig
from connectors.schema import content_text

CONTINUED, REPHRASED, REGENERATED, TOOL_ERROR, ABANDONED = (
    "continued",
    "rephrased",
    "regenerated",
    "tool_error",
    "abandoned",
)
IMPLICIT_SIGNALS = (TOOL_ERROR, REPHRASED, REGENERATED, CONTINUED, ABANDONED)
PASSED_BACK = (REPHRASED, CONTINUED, ABANDONED)  # the user's verdict a tool-calling turn takes from its answer

_WORD = re.compile(r"[^\W_]+")
_ERROR_START = re.compile(r"^\s*(error|exception|traceback|failed|failure)\b", re.IGNORECASE)
_MAX_TEXT_CHARS = 4096  # the words of at most this much of a message are compared (bounded work per row)
_MAX_RESULT_CHARS = 65536  # a tool result longer than this is not parsed as JSON


@dataclass(frozen=True)
class Turn:
    """The columns of one snapshot trace this module reads."""

    trace_id: str
    ts: datetime
    prompt: str  # JSON array of chat messages (or a plain text prompt)
    conversation_id: str | None
    turn: int | None
    parent_trace_id: str | None
    completion_tool_calls: str | None  # JSON array of the answer's tool calls, or null
    user: str | None = None  # metadata.user_hash: evidence counts only from the same identity


def _messages(prompt: str) -> list[dict[str, Any]]:
    try:
        value = json.loads(prompt)
    except (ValueError, RecursionError):
        return [{"role": "user", "content": prompt}]
    if isinstance(value, list):
        return [m for m in value if isinstance(m, dict)]
    return [{"role": "user", "content": prompt}]


def _last_user_text(messages: Sequence[dict[str, Any]]) -> str | None:
    for m in reversed(messages):
        if m.get("role") == "user":
            return content_text(m.get("content"))
    return None


def words(text: str) -> frozenset[str]:
    """The lower-cased words (letters and digits) of ``text``'s first characters."""
    return frozenset(_WORD.findall(text[:_MAX_TEXT_CHARS].lower()))


def similarity(a: str, b: str) -> float:
    """Word-set Jaccard similarity of two texts in [0, 1] (1.0 for two texts without words)."""
    wa, wb = words(a), words(b)
    if not wa and not wb:
        return 1.0
    return len(wa & wb) / len(wa | wb)


def reports_error(content: Any) -> bool:
    """Whether a tool result reports an error: a JSON object with a non-null ``error`` (or ``is_error``
    true), or text that starts with an error word (``Error: ...``, ``Traceback ...``)."""
    text = content_text(content)
    if len(text) > _MAX_RESULT_CHARS:  # a giant result is read by its start only
        return bool(_ERROR_START.match(text[:_MAX_TEXT_CHARS]))
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit: read as text
        return bool(_ERROR_START.match(text))
    if isinstance(value, dict):
        return value.get("error") not in (None, "", False) or value.get("is_error") is True
    return False


def _call_ids(tool_calls: str | None) -> set[str]:
    if not tool_calls:
        return set()
    try:
        calls = json.loads(tool_calls)
    except (ValueError, RecursionError):
        return set()
    return (
        {c["id"] for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str)}
        if isinstance(calls, list)
        else set()
    )


def _results(child_messages: Sequence[dict[str, Any]], call_ids: set[str]) -> list[Any]:
    """The contents of the tool messages a follower sends after the last assistant message (T's answer) that
    answer the calls ``call_ids``: a result earlier in the history belongs to an earlier turn, even when a
    server reuses call ids."""
    last = max((i for i, m in enumerate(child_messages) if m.get("role") == "assistant"), default=-1)
    return [
        m.get("content")
        for m in child_messages[last + 1 :]
        if m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str) and m["tool_call_id"] in call_ids
    ]


def _prompt_key(t: Turn) -> tuple[Any, ...]:
    """The same prompt sent again by the same identity: same user, conversation, turn, parent and messages."""
    return (t.user, t.conversation_id, t.turn, t.parent_trace_id, t.prompt)


def _next_after(group: Sequence[Turn], t: Turn) -> Turn | None:
    """The first turn of ``group`` (sorted by ``ts``) strictly later than ``t`` (a binary search: a flood of
    resends costs O(n log n), not O(n^2))."""
    i = bisect.bisect_right(group, t.ts, key=lambda r: r.ts)
    return group[i] if i < len(group) else None


def derive(turns: Sequence[Turn], now: datetime, cfg: ImplicitConfig) -> list[dict[str, dict[str, Any]]]:
    """The implicit signals of each turn (same order), each ``{signal: provenance}`` (see the module doc).

    Args:
        turns: the snapshot's traces, and the traces up to one window after them (the evidence).
        now: the time the windows are judged at (an aware datetime).
        cfg: windows and thresholds (``buffer.implicit``).
    """
    window = cfg.window_s
    children: dict[str, list[Turn]] = defaultdict(list)
    same_prompt: dict[tuple[Any, ...], list[Turn]] = defaultdict(list)
    for t in turns:
        if t.parent_trace_id and t.parent_trace_id != t.trace_id:  # a self-link is no evidence
            children[t.parent_trace_id].append(t)
        if t.conversation_id is not None:
            same_prompt[_prompt_key(t)].append(t)
    for group in same_prompt.values():
        group.sort(key=lambda r: r.ts)
    out: list[dict[str, dict[str, Any]]] = []
    answered_by: dict[int, Turn] = {}  # index of a tool-calling turn -> the earliest turn sending its results
    for i, t in enumerate(turns):
        found: dict[str, dict[str, Any]] = {}

        def seen(signal: str, by: Turn) -> None:
            after = (by.ts - t.ts).total_seconds()
            if signal not in found or after < found[signal]["after_s"]:
                found[signal] = {"by": by.trace_id, "after_s": round(after, 3), "window_s": window}

        followers = [
            c for c in children.get(t.trace_id, ()) if c.user == t.user and 0 <= (c.ts - t.ts).total_seconds() <= window
        ]
        call_ids = _call_ids(t.completion_tool_calls)
        asked = _last_user_text(_messages(t.prompt)) if followers else None
        for c in followers:
            messages = _messages(c.prompt)
            if call_ids:  # the app answering the model's tool calls is not a user's move
                results = _results(messages, call_ids)
                if any(reports_error(r) for r in results):
                    seen(TOOL_ERROR, c)
                if results and (i not in answered_by or c.ts < answered_by[i].ts):
                    answered_by[i] = c
                continue
            again = _last_user_text(messages)
            if asked is not None and again is not None and similarity(asked, again) >= cfg.rephrase_similarity:
                seen(REPHRASED, c)
            else:
                seen(CONTINUED, c)
        if t.conversation_id is not None:
            resend = _next_after(same_prompt[_prompt_key(t)], t)  # the earliest resend: the evidence
            if resend is not None and (resend.ts - t.ts).total_seconds() <= window:
                seen(REGENERATED, resend)
        if not followers and REGENERATED not in found and (now - t.ts).total_seconds() >= window:
            found[ABANDONED] = {"by": None, "after_s": None, "window_s": window}
        out.append(found)
    _pass_back(turns, out, answered_by)
    return [{k: found[k] for k in IMPLICIT_SIGNALS if k in found} for found in out]


def _pass_back(turns: Sequence[Turn], out: list[dict[str, dict[str, Any]]], answered_by: dict[int, Turn]) -> None:
    """A tool-calling turn takes the user's verdict on the answer its tool results led to (module doc), in place.

    Each chain of tool turns is followed to its end first, then the verdict travels back along it, so the order
    of timestamps (equal ones included) does not matter; a forged loop of links stops where it closes, and a turn
    never takes a verdict whose evidence is itself. Every turn is visited once: linear."""
    index = {t.trace_id: i for i, t in enumerate(turns)}
    done: set[int] = set()
    for start in answered_by:
        path: list[int] = []
        on_path: set[int] = set()
        i: int | None = start
        while i is not None and i in answered_by and i not in done and i not in on_path:
            path.append(i)
            on_path.add(i)
            i = index.get(answered_by[i].trace_id)
        for i in reversed(path):
            c, me = answered_by[i], turns[i].trace_id
            shift = (c.ts - turns[i].ts).total_seconds()
            for signal, seen in out[index[c.trace_id]].items() if c.trace_id in index else ():
                if signal in PASSED_BACK and signal not in out[i] and seen["by"] != me:
                    after = None if seen["after_s"] is None else round(seen["after_s"] + shift, 3)
                    out[i][signal] = {**seen, "after_s": after, "via": seen.get("via", c.trace_id)}
            done.add(i)
