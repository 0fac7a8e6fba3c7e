"""Batch parsing of raw Kafka records into buffer rows, with a fast path for the usual valid record.

:func:`parse_batch` decodes each record with ``msgspec`` into strict typed
structs (UTF-8, JSON syntax, field names, types and ranges are checked in C)
and builds the stored row directly. A record the fast path cannot *prove*
valid (any decode error, an unusual but maybe legal form such as ``"3"`` for
an int, a timestamp in a form other than plain RFC 3339, extra message keys)
falls back to :func:`connectors.schema.parse_record`, the pydantic reference
parser, which accepts it or gives the dead-letter reason. The fast path is
strictly narrower than the reference: everything it accepts the reference
accepts too, and it produces the same row (``tests/connectors/test_fast_parse.py``
checks both on mixed batches).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Annotated, Any, Literal, Protocol

import msgspec
import pyarrow as pa

from connectors.dead_letter import DeadLetter
from connectors.schema import (
    FEEDBACK_SCHEMA,
    INT32_MAX,
    INT32_MIN,
    TRACE_SCHEMA,
    Rejected,
    TraceEvent,
    UserHasher,
    parse_record,
)  # fmt: skip
from connectors.segments import (
    FeedbackRow,
    TraceRow,
    feedback_row,
    feedback_rows_table,
    to_json,
    trace_row,
    trace_rows_table,
)  # fmt: skip

_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
_TokenId = Annotated[int, msgspec.Meta(ge=INT32_MIN, le=INT32_MAX)]
_Rating = Annotated[int, msgspec.Meta(ge=1, le=5)]


class _Message(msgspec.Struct, forbid_unknown_fields=True):
    role: _NonEmpty
    content: str  # None, content parts and extra keys go to the reference parser


class _Signals(msgspec.Struct, kw_only=True):
    """Fields every event may carry: inline feedback signals and metadata."""

    reward: float | None = None
    thumbs: Literal["up", "down"] | None = None
    rating: _Rating | None = None
    edited: bool | None = None
    regenerated: bool | None = None
    metadata: msgspec.Raw = msgspec.Raw(b"{}")  # decoded below; its bytes tell whether floats are inside


class _Trace(_Signals, kw_only=True, tag_field="schema", tag=TRACE_SCHEMA, forbid_unknown_fields=True):
    trace_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    ts: str | int
    model: _NonEmpty
    prompt: str | list[_Message]
    completion: str
    adapter_version: str | None = None
    completion_token_ids: list[_TokenId] | None = None
    completion_logprobs: list[float] | None = None  # JSON has no NaN/inf; out-of-range numbers are decode errors


class _Feedback(_Signals, kw_only=True, tag_field="schema", tag=FEEDBACK_SCHEMA, forbid_unknown_fields=True):
    trace_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    ts: str | int | None = None


_DECODER = msgspec.json.Decoder(_Trace | _Feedback)
_METADATA = msgspec.json.Decoder(dict[str, Any])
_ENCODER = msgspec.json.Encoder()
# Every JSON number that decodes to a float has a digit right before '.', 'e' or 'E'. Without such a pair
# (strings may add false alarms, never misses) msgspec's output is byte-identical to segments.to_json
# (same string escapes, separators and ints; only float formatting differs).
_MAYBE_FLOAT = re.compile(rb"[0-9][.eE]")
# Plain RFC 3339 with 'T', seconds, at most microseconds and an explicit offset: read the same by
# datetime.fromisoformat and by pydantic. Anything else (spaces, naive, numeric strings) -> reference parser.
_RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?(?:Z|[+-]\d\d:\d\d)")


class KafkaRecord(Protocol):
    """What :func:`parse_batch` reads of a ``kafka.consumer.fetcher.ConsumerRecord``."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass
class ParsedBatch:
    """One batch, parsed: rows for the buffer and the dead letters, each in record order."""

    traces: list[TraceRow] = field(default_factory=list)
    feedback: list[FeedbackRow] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    fast: int = 0  # records accepted by the fast path
    fallback: int = 0  # records handed to the reference parser

    def trace_table(self, ingested_at: datetime) -> pa.Table:
        """Traces in :data:`~connectors.segments.TRACE_SEGMENT_SCHEMA`."""
        return trace_rows_table(self.traces, ingested_at)

    def feedback_table(self, ingested_at: datetime) -> pa.Table:
        """Feedback in :data:`~connectors.segments.FEEDBACK_SEGMENT_SCHEMA`."""
        return feedback_rows_table(self.feedback, ingested_at)


def parse_batch(
    records: Iterable[KafkaRecord], *, max_record_bytes: int, hasher: UserHasher, fast: bool = True
) -> ParsedBatch:
    """Parse raw records into trace rows, feedback rows and dead letters; never raises on bad input.

    Args:
        records: Kafka records (``topic``, ``partition``, ``offset``, ``key``, ``value``), in order.
        max_record_bytes: larger values are dead-lettered as ``oversize``.
        hasher: user identifiers in ``metadata`` are replaced by its keyed hash before storage.
        fast: False sends every record through the reference parser (for comparison).

    Returns:
        A :class:`ParsedBatch`. Rows equal :func:`~connectors.segments.trace_row` /
        :func:`~connectors.segments.feedback_row` of the reference parser's events;
        dead letters carry the reference parser's reason and detail.
    """
    out = ParsedBatch()
    for record in records:
        value = record.value
        if fast and value and len(value) <= max_record_bytes:
            try:
                event = _DECODER.decode(value)
            except msgspec.MsgspecError:
                event = None  # the reference parser says why
            if isinstance(event, _Trace):
                row = _trace_row(event, record, hasher)
                if row is not None:
                    out.traces.append(row)
                    out.fast += 1
                    continue
            elif isinstance(event, _Feedback):
                row = _feedback_row(event, record, hasher)
                if row is not None:
                    out.feedback.append(row)
                    out.fast += 1
                    continue
        out.fallback += 1
        result = parse_record(value, max_record_bytes=max_record_bytes, hasher=hasher)
        if isinstance(result, Rejected):
            out.dead_letters.append(
                DeadLetter(result.reason, result.detail, record.topic, record.partition, record.offset, value, record.key)
            )
        elif isinstance(result, TraceEvent):
            out.traces.append(trace_row(result, record.topic, record.partition, record.offset))
        else:
            out.feedback.append(feedback_row(result, record.topic, record.partition, record.offset))
    return out


def _trace_row(event: _Trace, record: KafkaRecord, hasher: UserHasher) -> TraceRow | None:
    """The stored row (as :func:`~connectors.segments.trace_row`), or None when the reference parser must decide."""
    ts = _utc(event.ts)
    signals = _signals(event)
    ids, lps = event.completion_token_ids, event.completion_logprobs
    if ts is None or signals is None or (ids is not None and lps is not None and len(ids) != len(lps)):
        return None
    if isinstance(event.prompt, str):
        messages = [{"role": "user", "content": event.prompt}]
    else:
        messages = [{"role": m.role, "content": m.content} for m in event.prompt]
    metadata = _metadata_json(event.metadata, hasher)
    if metadata is None:
        return None
    return (
        event.trace_id, ts, event.model, event.adapter_version, _ENCODER.encode(messages).decode(), event.completion,
        ids, lps, _signals_json(signals) if signals else None, metadata, record.topic, record.partition, record.offset,
    )  # fmt: skip


def _feedback_row(event: _Feedback, record: KafkaRecord, hasher: UserHasher) -> FeedbackRow | None:
    """The stored row (as :func:`~connectors.segments.feedback_row`), or None when the reference parser must decide."""
    ts = None if event.ts is None else _utc(event.ts)  # a missing ts stays missing (ingest time later)
    signals = _signals(event)
    if (ts is None and event.ts is not None) or signals is None:
        return None
    metadata = _metadata_json(event.metadata, hasher)
    if metadata is None:
        return None
    return (event.trace_id, ts, _signals_json(signals), metadata, record.topic, record.partition, record.offset)


def _metadata_json(raw: msgspec.Raw, hasher: UserHasher) -> str | None:
    """Stored ``metadata`` JSON (user ids hashed), or None when it is not a JSON object."""
    try:
        metadata = _METADATA.decode(raw)
    except msgspec.MsgspecError:
        return None
    if metadata:
        metadata = hasher(metadata)
    return to_json(metadata) if _MAYBE_FLOAT.search(raw) else _ENCODER.encode(metadata).decode()


def _signals_json(signals: dict[str, Any]) -> str:
    # Only ``reward`` is a float: leave its formatting to the reference encoder.
    return to_json(signals) if "reward" in signals else _ENCODER.encode(signals).decode()


def _utc(ts: str | int) -> datetime | None:
    """Aware UTC datetime as the reference parser makes it, or None when this form is left to it."""
    if isinstance(ts, int):
        try:
            return datetime.fromtimestamp(ts / 1000.0, tz=timezone.utc)
        except (OverflowError, ValueError, OSError):
            return None
    if _RFC3339.fullmatch(ts) is None:
        return None
    try:
        return datetime.fromisoformat(ts).astimezone(timezone.utc)
    except (OverflowError, ValueError):
        return None


def _signals(event: _Trace | _Feedback) -> dict[str, Any] | None:
    """Present signals in :data:`~connectors.schema.SIGNAL_FIELDS` order (as ``_Signals.signals()``);
    None for a non-finite reward (unreachable from strict JSON; the reference parser names it)."""
    out: dict[str, Any] = {}
    if event.reward is not None:
        if not math.isfinite(event.reward):
            return None
        out["reward"] = event.reward
    if event.thumbs is not None:
        out["thumbs"] = event.thumbs
    if event.rating is not None:
        out["rating"] = event.rating
    if event.edited is not None:
        out["edited"] = event.edited
    if event.regenerated is not None:
        out["regenerated"] = event.regenerated
    return out
