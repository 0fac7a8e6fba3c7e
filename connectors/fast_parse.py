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

Token ids and logprobs (the bulk of a trace: tens to thousands of numbers, the
prompt's ids too in ``hourglass.trace/v2``) are not turned into Python numbers: msgspec checks their JSON syntax and keeps the
text, and the whole batch's lists become two Arrow columns in one split and one
cast (C++, correctly rounded like Python's ``float()``). If any list is not
plain numbers that fit the column (``1.0`` for an int, an int32 overflow,
``1e999``, nested lists), the batch is decoded again with the lists typed per
record, so that record gets the reference parser's verdict.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Annotated, Any, Literal, Protocol

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from connectors.dead_letter import DeadLetter
from connectors.schema import (
    FEEDBACK_SCHEMA,
    FLOAT32_MAX,
    INT32_MAX,
    INT32_MIN,
    MAX_ID_CHARS,
    MAX_TOOL_NAME_CHARS,
    MAX_TRACE_TOOLS,
    PARSE_ERROR,
    TRACE_SCHEMA,
    TRACE_SCHEMA_V1,
    UNDECODABLE_RECORD,
    Rejected,
    TraceEvent,
    TsWindow,
    UserHasher,
    correction_refused,
    finite_or_null,
    parse_record,
)
from connectors.segments import (
    FEEDBACK_SEGMENT_SCHEMA,
    PROMPT_IDS,
    TRACE_SEGMENT_SCHEMA,
    FeedbackRow,
    TraceRow,
    feedback_row,
    feedback_rows_table,
    to_json,
    trace_row,
    trace_rows_table,
)

TRACES_KIND, FEEDBACK_KIND = "trace", "feedback"
_NULL = msgspec.Raw(b"null")
_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
_TokenId = Annotated[int, msgspec.Meta(ge=INT32_MIN, le=INT32_MAX)]
_Rating = Annotated[int, msgspec.Meta(ge=1, le=5)]
_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]


# gc=False: decoded JSON is a tree (no reference cycles), so these structs need no GC tracking; fewer
# tracked objects per record means fewer and shorter collections in the ingest process.
# Each struct encodes to the bytes of the reference model's dump: same field order; omit_defaults where the
# reference dumps with exclude_none (messages, function definitions, usage), never where it keeps defaults.
class _FunctionCall(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    name: Annotated[str, msgspec.Meta(max_length=MAX_TOOL_NAME_CHARS)]
    arguments: str


class _ToolCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] = ""
    type: Literal["function"] = "function"
    function: _FunctionCall


class _Message(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # schema.CHAT_ROLES (a test holds them equal)
    content: str | None = None  # content parts and extra keys go to the reference parser
    name: str | None = None
    tool_calls: Annotated[list[_ToolCall], msgspec.Meta(max_length=MAX_TRACE_TOOLS)] | None = None
    tool_call_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] | None = None


class _FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TOOL_NAME_CHARS)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    type: Literal["function"] = "function"
    function: _FunctionDefinition


class _Usage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    completion_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None


class _Signals(msgspec.Struct, kw_only=True, gc=False):
    """Fields every event may carry: inline feedback signals and metadata."""

    reward: float | None = None
    thumbs: Literal["up", "down"] | None = None
    rating: _Rating | None = None
    edited: bool | None = None
    regenerated: bool | None = None
    metadata: msgspec.Raw = msgspec.Raw(b"{}")  # decoded below; its bytes tell whether floats are inside


class _Trace(_Signals, kw_only=True, tag_field="schema", tag=TRACE_SCHEMA_V1, forbid_unknown_fields=True, gc=False):
    trace_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    ts: str | int
    model: _NonEmpty
    prompt: str | list[_Message]
    completion: str
    adapter_version: str | None = None
    # The JSON text (syntax checked by msgspec): the whole batch's lists become Arrow columns in one go
    # (_number_lists), with no Python number objects; a batch where that fails is decoded with _TypedTrace.
    completion_token_ids: msgspec.Raw = _NULL
    completion_logprobs: msgspec.Raw = _NULL


class _TraceV2(_Trace, kw_only=True, tag_field="schema", tag=TRACE_SCHEMA, forbid_unknown_fields=True, gc=False):
    """``hourglass.trace/v2``: v1 plus the conversation fields (v1 keeps refusing them: forbid_unknown_fields)."""

    tools: Annotated[list[_Tool], msgspec.Meta(max_length=MAX_TRACE_TOOLS)] | None = None
    completion_tool_calls: Annotated[list[_ToolCall], msgspec.Meta(max_length=MAX_TRACE_TOOLS)] | None = None
    finish_reason: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    prompt_token_ids: msgspec.Raw = _NULL  # JSON text, as completion_token_ids
    usage: _Usage | None = None
    conversation_id: _Id | None = None
    turn: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None
    parent_trace_id: _Id | None = None


class _TypedTrace(_Trace, kw_only=True, tag_field="schema", tag=TRACE_SCHEMA_V1, forbid_unknown_fields=True, gc=False):
    completion_token_ids: list[_TokenId] | None = None  # type: ignore[assignment]
    completion_logprobs: list[float] | None = None  # type: ignore[assignment]  # JSON has no NaN/inf; 1e999 fails


class _TypedTraceV2(_TraceV2, kw_only=True, tag_field="schema", tag=TRACE_SCHEMA, forbid_unknown_fields=True, gc=False):
    completion_token_ids: list[_TokenId] | None = None  # type: ignore[assignment]
    completion_logprobs: list[float] | None = None  # type: ignore[assignment]
    prompt_token_ids: list[_TokenId] | None = None  # type: ignore[assignment]


class _Feedback(_Signals, kw_only=True, tag_field="schema", tag=FEEDBACK_SCHEMA, forbid_unknown_fields=True, gc=False):
    trace_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    ts: str | int | None = None
    correction: str | None = None


_DECODER = msgspec.json.Decoder(_Trace | _TraceV2 | _Feedback)
_TYPED_DECODER = msgspec.json.Decoder(_TypedTrace | _TypedTraceV2 | _Feedback)
# The list columns built from JSON text for a whole batch, and their Arrow value types as first read.
_LIST_COLUMNS = ("completion_token_ids", "completion_logprobs", "prompt_token_ids")
_METADATA = msgspec.json.Decoder(dict[str, Any])
_ENCODER = msgspec.json.Encoder()
# Every JSON number that decodes to a float has a digit right before '.', 'e' or 'E'. Without such a pair
# (strings may add false alarms, never misses) msgspec's output is byte-identical to segments.to_json
# (same string escapes, separators and ints; only float formatting differs).
_MAYBE_FLOAT = re.compile(rb"[0-9][.eE]")
# Plain RFC 3339 with 'T', seconds, at most microseconds and an explicit offset: read the same by
# datetime.fromisoformat and by pydantic. Anything else (spaces, naive, numeric strings) -> reference parser.
_RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?(?:Z|[+-]\d\d:\d\d)")


@dataclass(frozen=True)
class UndecodableRecord:
    """Stands in for a Kafka record the consumer could not decode (unknown codec, corrupt batch): it goes
    through the batch like any record, so it becomes an ``undecodable_record`` dead letter with its
    coordinates and its offset is committed only after that dead letter is durable."""

    topic: str
    partition: int
    offset: int
    error: str
    key: bytes | None = None
    value: bytes | None = None


class KafkaRecord(Protocol):
    """What :func:`parse_batch` reads of a ``kafka.consumer.fetcher.ConsumerRecord``."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass
class ParsedBatch:
    """One batch, parsed: rows for the buffer and the dead letters, each in record order.

    When ``token_ids`` / ``logprobs`` / ``prompt_ids`` are set they are the ``completion_token_ids`` /
    ``completion_logprobs`` / ``prompt_token_ids`` columns of ``traces`` (one entry per row, in row
    order), and the rows hold None in those places.
    """

    traces: list[TraceRow] = field(default_factory=list)
    feedback: list[FeedbackRow] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    fast: int = 0  # records accepted by the fast path
    fallback: int = 0  # records handed to the reference parser
    # Set by the ingest worker for its OTel topic (connectors.otel_records): spans that were not events, by
    # reason, and how many OTel records the batch's rows and letters came from.
    skipped: Counter[str] = field(default_factory=Counter)
    otel_records: int = 0
    token_ids: pa.Array | None = None  # list<int32>, [len(traces)]
    logprobs: pa.Array | None = None  # list<float32>, [len(traces)]
    prompt_ids: pa.Array | None = None  # list<int32>, [len(traces)]
    # While parsing with _DECODER: each trace row's lists (_LIST_COLUMNS order) as JSON text (None = null),
    # and their element counts.
    _texts: tuple[list[bytes | None], ...] = field(default_factory=lambda: ([], [], []), repr=False)
    _lengths: tuple[list[int], ...] = field(default_factory=lambda: ([], [], []), repr=False)

    def _add_lists(self, texts: tuple[bytes | None, ...], lengths: tuple[int, ...]) -> None:
        for text_store, text in zip(self._texts, texts, strict=True):
            text_store.append(text)
        for length_store, n in zip(self._lengths, lengths, strict=True):
            length_store.append(n)

    def _truncate_lists(self, n: int) -> None:
        for text_store in self._texts:
            del text_store[n:]
        for length_store in self._lengths:
            del length_store[n:]

    def _columns(self, rows: slice | None = None) -> dict[str, pa.Array] | None:
        arrays = (self.token_ids, self.logprobs, self.prompt_ids)
        if any(a is None for a in arrays):
            return None
        picked = [a if rows is None else a[rows] for a in arrays]  # type: ignore[index]
        return dict(zip(_LIST_COLUMNS, picked))

    def trace_table(self, ingested_at: datetime) -> pa.Table:
        """Traces in :data:`~connectors.segments.TRACE_SEGMENT_SCHEMA`."""
        return trace_rows_table(self.traces, ingested_at, columns=self._columns())

    def feedback_table(self, ingested_at: datetime) -> pa.Table:
        """Feedback in :data:`~connectors.segments.FEEDBACK_SEGMENT_SCHEMA`."""
        return feedback_rows_table(self.feedback, ingested_at)

    def tables(self, ingested_at: datetime) -> tuple[pa.Table, pa.Table]:
        """(:meth:`trace_table`, :meth:`feedback_table`); never raises on a bad row.

        Last resort: when a table cannot be built (a value Arrow refuses that the parser let through),
        each row is built alone and the rows that fail become ``parse_error`` dead letters (with their
        coordinates; the payload is not kept at this stage) in :attr:`dead_letters`.
        """
        try:
            traces = self.trace_table(ingested_at)
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            traces = self._isolate(ingested_at, TRACES_KIND)
        try:
            feedback = self.feedback_table(ingested_at)
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            feedback = self._isolate(ingested_at, FEEDBACK_KIND)
        return traces, feedback

    def _isolate(self, ingested_at: datetime, kind: str) -> pa.Table:
        rows = self.traces if kind == TRACES_KIND else self.feedback
        good: list[pa.Table] = []
        for index, row in enumerate(rows):
            try:
                if kind == FEEDBACK_KIND:
                    good.append(feedback_rows_table([row], ingested_at))
                else:
                    columns = self._columns(slice(index, index + 1))
                    good.append(trace_rows_table([row], ingested_at, columns=columns))
            except (pa.ArrowException, ValueError, TypeError, OverflowError) as err:
                topic, partition, offset = row[-3:]
                self.dead_letters.append(
                    DeadLetter(
                        PARSE_ERROR,
                        f"the {kind} row could not be stored ({type(err).__name__}: {str(err)[:300]}); please report it",
                        topic,
                        partition,
                        offset,
                        None,
                        None,
                    )
                )
        schema = TRACE_SEGMENT_SCHEMA if kind == TRACES_KIND else FEEDBACK_SEGMENT_SCHEMA
        return pa.concat_tables(good) if good else schema.empty_table()


def _scrubbed(value: bytes | None, hasher: UserHasher | None) -> bytes | None:
    """A rejected payload as it may be stored: user identifiers hashed like in the buffer.

    Payloads that are not a JSON object are kept as they came (nothing to find
    identifiers in reliably); a JSON object with no identifier keeps its bytes.
    """
    if value is None or hasher is None:
        return value
    try:
        obj = json.loads(value)
    except RecursionError:  # nested too deep to look for identifiers: keep nothing rather than raw ids
        return None
    except ValueError:  # not JSON, not UTF-8 (UnicodeDecodeError)
        return value
    if not isinstance(obj, (dict, list)):
        return value
    try:
        hashed = hasher(obj)
    except Exception:  # noqa: BLE001 - never let a rejected payload stop the batch: keep nothing rather than raw ids
        return None
    if hashed == obj:
        return value
    text = json.dumps(hashed, ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates elsewhere in the payload: keep them as \uXXXX escapes
        return json.dumps(hashed).encode("ascii")


@dataclass(frozen=True)
class _Limits:
    max_record_bytes: int
    hasher: UserHasher
    window: TsWindow | None
    max_correction_chars: int | None

    def in_window(self, ts: datetime) -> bool:
        return self.window is None or self.window.earliest <= ts <= self.window.latest


def parse_batch(
    records: Iterable[KafkaRecord],
    *,
    max_record_bytes: int,
    hasher: UserHasher,
    fast: bool = True,
    window: TsWindow | None = None,
    max_correction_chars: int | None = None,
) -> ParsedBatch:
    """Parse raw records into trace rows, feedback rows and dead letters; never raises on bad input.

    Args:
        records: Kafka records (``topic``, ``partition``, ``offset``, ``key``, ``value``), in order; an
            :class:`UndecodableRecord` becomes an ``undecodable_record`` dead letter.
        max_record_bytes: larger values are dead-lettered as ``oversize``.
        hasher: user identifiers in ``metadata`` are replaced by its keyed hash before storage.
        fast: False sends every record through the reference parser (for comparison).
        window: accepted event times; events outside are dead-lettered as ``ts_out_of_range``.
        max_correction_chars: longer feedback corrections are dead-lettered as ``oversize_correction`` (and ones
            holding invisible characters as ``hidden_characters``).

    Returns:
        A :class:`ParsedBatch`. Rows equal :func:`~connectors.segments.trace_row` /
        :func:`~connectors.segments.feedback_row` of the reference parser's events (with the token
        ids, logprobs and prompt ids moved to the batch's columns when those are set, see :class:`ParsedBatch`);
        its tables equal the reference parser's; dead letters carry the reference parser's reason
        and detail.
    """
    records = records if isinstance(records, list) else list(records)
    limits = _Limits(max_record_bytes, hasher, window, max_correction_chars)
    if not fast:
        return _parse(records, limits, None)
    out = _parse(records, limits, _DECODER)
    if _lists_to_columns(out):
        return out
    # Some list is not plain JSON numbers in range (1.0 for an int, 1e999, nested lists...): decode the
    # lists record by record, so that each such record gets the reference parser's verdict.
    return _parse(records, limits, _TYPED_DECODER)


def _parse(records: list[KafkaRecord], limits: _Limits, decoder: msgspec.json.Decoder | None) -> ParsedBatch:
    """One pass over the records; ``decoder`` None sends every record to the reference parser."""
    out = ParsedBatch()
    for record in records:
        if isinstance(record, UndecodableRecord):
            out.dead_letters.append(
                DeadLetter(
                    UNDECODABLE_RECORD,
                    f"the consumer could not decode this record: {record.error}; the producer's "
                    "codec or the stored batch is unusable (the record is skipped, its payload is not available)",
                    record.topic,
                    record.partition,
                    record.offset,
                    None,
                    None,
                )
            )
            continue
        marks = (len(out.traces), len(out.feedback), len(out.dead_letters), len(out._texts[0]), out.fast, out.fallback)
        try:
            _parse_one(out, record, limits, decoder)
        except Exception as err:  # noqa: BLE001 - last resort: one record the parser cannot handle never stops the batch
            n_traces, n_feedback, n_letters, n_lists, out.fast, out.fallback = marks
            del out.traces[n_traces:], out.feedback[n_feedback:], out.dead_letters[n_letters:]
            out._truncate_lists(n_lists)
            out.dead_letters.append(
                DeadLetter(
                    PARSE_ERROR,
                    f"the parser failed on this record ({type(err).__name__}: {str(err)[:300]}); the record is kept "
                    "here, please report it",
                    record.topic,
                    record.partition,
                    record.offset,
                    _raw_only(record.value),
                    _raw_only(record.key),
                )
            )
    return out


def _raw_only(data: object) -> bytes | None:
    return data if isinstance(data, bytes) else None


def _parse_one(out: ParsedBatch, record: KafkaRecord, limits: _Limits, decoder: msgspec.json.Decoder | None) -> None:
    """Parse one record into ``out`` (a row or a dead letter)."""
    value, hasher = record.value, limits.hasher
    if decoder is not None and value and len(value) <= limits.max_record_bytes:
        try:
            event = decoder.decode(value)
        except (msgspec.MsgspecError, RecursionError):
            event = None  # the reference parser says why
        if isinstance(event, _Trace):
            if _add_trace(out, event, record, limits):
                out.fast += 1
                return
        elif isinstance(event, _Feedback):
            row = _feedback_row(event, record, limits)
            if row is not None:
                out.feedback.append(row)
                out.fast += 1
                return
    out.fallback += 1
    result = parse_record(
        value,
        max_record_bytes=limits.max_record_bytes,
        hasher=hasher,
        window=limits.window,
        max_correction_chars=limits.max_correction_chars,
    )
    if isinstance(result, Rejected):
        out.dead_letters.append(
            DeadLetter(
                result.reason,
                result.detail,
                record.topic,
                record.partition,
                record.offset,
                _scrubbed(value, hasher),
                record.key,
            )
        )
    elif isinstance(result, TraceEvent):
        row = trace_row(result, record.topic, record.partition, record.offset)
        if decoder is _DECODER:  # this batch carries its lists as columns: JSON text like the fast rows
            lists = (row[6], row[7], row[PROMPT_IDS])
            out._add_lists(
                tuple(_ENCODER.encode(v) if v is not None else None for v in lists),
                tuple(len(v or ()) for v in lists),
            )
            row = (*row[:6], None, None, *row[8:PROMPT_IDS], None, *row[PROMPT_IDS + 1 :])
        out.traces.append(row)
    else:
        out.feedback.append(feedback_row(result, record.topic, record.partition, record.offset))


def _add_trace(out: ParsedBatch, event: _Trace, record: KafkaRecord, limits: _Limits) -> bool:
    """Append the stored row (as :func:`~connectors.segments.trace_row`) to ``out``; False when the
    reference parser must decide."""
    ts = _utc(event.ts)
    signals = _signals(event)
    if ts is None or signals is None or not limits.in_window(ts):
        return False
    hasher = limits.hasher
    v2 = event if isinstance(event, _TraceV2) else None
    # JSON text (msgspec.Raw) from _DECODER, or lists from the decoder whose struct overrides these fields.
    ids: Any = event.completion_token_ids
    lps: Any = event.completion_logprobs
    prompt_ids: Any = v2.prompt_token_ids if v2 is not None else _NULL
    texts: tuple[bytes | None, ...] = ()
    lengths: tuple[int, ...] = ()
    if isinstance(ids, msgspec.Raw):  # _DECODER: JSON text, made into columns for the whole batch
        texts = tuple(None if raw == _NULL else bytes(raw) for raw in (ids, lps, prompt_ids))
        if any(text is not None and text[0] != _OPEN for text in texts):
            return False  # not a list at all
        lengths = tuple(_array_len(text) for text in texts)
        if texts[0] is not None and texts[1] is not None and lengths[0] != lengths[1]:
            return False
        ids = lps = prompt_ids = None
    elif ids is not None and lps is not None and len(ids) != len(lps):
        return False
    elif lps is not None and not all(abs(v) <= FLOAT32_MAX for v in lps):
        return False  # would be infinite as float32: the reference parser refuses it
    if prompt_ids is _NULL:
        prompt_ids = None
    conversation = _conversation_columns(v2)
    if conversation is None:
        return False
    # A _Message encodes as the reference's dump (exclude_none): the same bytes.
    messages = [_Message("user", event.prompt)] if isinstance(event.prompt, str) else event.prompt
    metadata = _metadata_json(event.metadata, hasher)
    if metadata is None:
        return False
    tools, calls, finish, conversation_id, turn, parent, usage = conversation
    out.traces.append(
        (
            event.trace_id,
            ts,
            event.model,
            event.adapter_version,
            _ENCODER.encode(messages).decode(),
            event.completion,
            ids,
            lps,
            tools,
            calls,
            finish,
            prompt_ids,
            conversation_id,
            turn,
            parent,
            usage,
            _signals_json(signals) if signals else None,
            metadata,
            record.topic,
            record.partition,
            record.offset,
        )
    )
    if texts:
        out._add_lists(texts, lengths)
    return True


def _conversation_columns(event: _TraceV2 | None) -> tuple[Any, ...] | None:
    """The stored v2 columns except prompt ids (tools JSON, tool calls JSON, finish_reason, conversation_id,
    turn, parent_trace_id, usage JSON), all None for a v1 event; None when the reference parser must decide."""
    if event is None:
        return (None,) * 7
    tools = None
    if event.tools is not None:
        builtins = msgspec.to_builtins(event.tools)
        if finite_or_null(builtins) is not builtins:
            return None  # a number beyond float range (the reference parser refuses it)
        tools = to_json(builtins)  # parameters may hold floats: the reference encoder formats them
    calls = None if event.completion_tool_calls is None else _ENCODER.encode(event.completion_tool_calls).decode()
    usage = None if event.usage is None else _ENCODER.encode(event.usage).decode()
    return (tools, calls, event.finish_reason, event.conversation_id, event.turn, event.parent_trace_id, usage)


_OPEN = ord("[")


def _array_len(text: bytes | None) -> int:
    """Elements of a JSON array of numbers (``[1,2]`` -> 2, null -> 0; a miscount for other content is
    caught when the batch's columns are built: the element total must match)."""
    return 0 if text is None or text == b"[]" else text.count(b",") + 1


_JSON_SPACE = b" \t\n\r"


def _number_lists(texts: list[bytes | None], lengths: list[int], value_type: pa.DataType) -> pa.Array | None:
    """JSON arrays of numbers (syntax already checked by msgspec), one per row (None for a null list),
    with their element counts from :func:`_array_len` -> one ``list<value_type>`` array. The numbers are
    parsed by Arrow's C++ casts: correctly rounded, the same values as Python's float() and int(). None
    when any element is not a plain number that fits ``value_type`` (an int written 1.0 or 1e2, an int32
    overflow, a double overflow like 1e999, nested lists, strings): then the caller decodes record by
    record."""
    # "[1,2]" "[3]" -> "1,2,3": one string, split once; JSON whitespace between numbers is dropped.
    body = b"".join(text for text, n in zip(texts, lengths) if n and text is not None)
    body = body.translate(None, _JSON_SPACE).replace(b"][", b",")
    try:
        joined = pa.array([body[1:-1].decode("ascii")], pa.large_string())
        values = pc.cast(pc.split_pattern(joined, ",").values, value_type) if body else pa.array([], value_type)
    except (UnicodeDecodeError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if len(values) != sum(lengths):
        return None
    if pa.types.is_floating(value_type) and len(values) and not pc.all(pc.is_finite(values)).as_py():
        return None  # 1e999 parses as inf here; msgspec and the reference parser reject it
    offsets = pa.array([0, *itertools.accumulate(lengths)], pa.int32())
    return pa.ListArray.from_arrays(offsets, values, mask=pa.array([text is None for text in texts], pa.bool_()))


def _lists_to_columns(out: ParsedBatch) -> bool:
    """Set ``out.token_ids`` / ``out.logprobs`` / ``out.prompt_ids`` from the JSON text gathered while
    parsing; False when some list needs record-by-record decoding."""
    (ids_text, lps_text, prompt_text), (ids_len, lps_len, prompt_len) = out._texts, out._lengths
    ids_type = TRACE_SEGMENT_SCHEMA.field("completion_token_ids").type
    lps_type = TRACE_SEGMENT_SCHEMA.field("completion_logprobs").type
    ids = _number_lists(ids_text, ids_len, ids_type.value_type)
    prompt = _number_lists(prompt_text, prompt_len, ids_type.value_type)
    lps = _number_lists(lps_text, lps_len, pa.float64())  # read as msgspec/pydantic do, float32 as pa.array
    if ids is None or lps is None or prompt is None:
        return False
    lps = lps.cast(lps_type)
    if len(lps.values) and not pc.all(pc.is_finite(lps.values)).as_py():
        return False  # beyond float32 (e.g. -1e300): the reference parser refuses it
    out.token_ids, out.logprobs, out.prompt_ids = ids, lps, prompt
    out._texts, out._lengths = ([], [], []), ([], [], [])
    return True


def _feedback_row(event: _Feedback, record: KafkaRecord, limits: _Limits) -> FeedbackRow | None:
    """The stored row (as :func:`~connectors.segments.feedback_row`), or None when the reference parser must decide."""
    ts = None if event.ts is None else _utc(event.ts)  # a missing ts stays missing (ingest time later)
    signals = _signals(event)
    if (ts is None and event.ts is not None) or signals is None or (ts is not None and not limits.in_window(ts)):
        return None
    if event.correction is not None:
        if correction_refused(event.correction, limits.max_correction_chars) is not None:
            return None  # the reference parser dead-letters it
        signals["correction"] = event.correction
    metadata = _metadata_json(event.metadata, limits.hasher)
    if metadata is None:
        return None
    return (event.trace_id, ts, _signals_json(signals), metadata, record.topic, record.partition, record.offset)


# More '[' / '{' than this in metadata: its nesting may exceed the reference parser's recursion limit
# (about 200 levels for the whole record), so the reference parser decides.
_FAST_MAX_BRACKETS = 128


def _metadata_json(raw: msgspec.Raw, hasher: UserHasher) -> str | None:
    """Stored ``metadata`` JSON (user ids hashed), or None when it is not a JSON object (or may nest
    deeper than the reference parser accepts)."""
    if len(raw) > 2 * _FAST_MAX_BRACKETS:  # each bracket needs its closer: shorter text cannot have more
        text = bytes(raw)
        if text.count(b"[") + text.count(b"{") > _FAST_MAX_BRACKETS:
            return None
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
        parsed = datetime.fromisoformat(ts)
        return parsed if parsed.tzinfo is timezone.utc else parsed.astimezone(timezone.utc)  # "Z" is already UTC
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
