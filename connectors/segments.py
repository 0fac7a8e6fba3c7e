"""Arrow schemas, naming and encoding of reward-buffer segments.

Layout under the buffer root::

    traces/dt=YYYY-MM-DD/hour=HH/seg-<ingested_ms>-<writer>-<seq>-n<rows>.arrow
    feedback/dt=YYYY-MM-DD/hour=HH/seg-...arrow
    manifest.json

Traces are partitioned by their event ``ts`` hour (UTC), feedback by its
``ts`` (or ingest time when absent). Each segment is one Arrow IPC file,
immutable once renamed into place ("sealed").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from connectors.schema import FeedbackEvent, TraceEvent, shift

TS = pa.timestamp("ms", tz="UTC")
TRACES = "traces"
FEEDBACK = "feedback"

_LINEAGE = [
    pa.field("topic", pa.string(), nullable=False),
    pa.field("partition", pa.int32(), nullable=False),
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("ingested_at", TS, nullable=False),
]

# The trace columns shared by the stored segments and the snapshot.
_TRACE_COLUMNS = [
    pa.field("trace_id", pa.string(), nullable=False),
    pa.field("ts", TS, nullable=False),
    pa.field("model", pa.string(), nullable=False),
    pa.field("adapter_version", pa.string()),
    pa.field("prompt", pa.string(), nullable=False),
    pa.field("completion", pa.string(), nullable=False),
    pa.field("completion_token_ids", pa.list_(pa.int32())),
    pa.field("completion_logprobs", pa.list_(pa.float32())),
    # hourglass.trace/v2 (null in rows of v1 events and in segments written before these columns existed)
    pa.field("tools", pa.string()),  # JSON array of the tool definitions offered
    pa.field("completion_tool_calls", pa.string()),  # JSON array of the answer's tool calls
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("conversation_id", pa.string()),
    pa.field("turn", pa.int32()),
    pa.field("parent_trace_id", pa.string()),
    pa.field("usage", pa.string()),  # JSON {"prompt_tokens", "completion_tokens"}
]

TRACE_SEGMENT_SCHEMA = pa.schema(
    [
        *_TRACE_COLUMNS,
        pa.field("signals", pa.string()),  # JSON of inline feedback signals, null when none
        pa.field("metadata", pa.string(), nullable=False),
        *_LINEAGE,
    ]
)

FEEDBACK_SEGMENT_SCHEMA = pa.schema(
    [
        pa.field("trace_id", pa.string(), nullable=False),
        pa.field("ts", TS, nullable=False),
        pa.field("signals", pa.string(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
        *_LINEAGE,
    ]
)

SNAPSHOT_SCHEMA = pa.schema(
    [
        *_TRACE_COLUMNS,
        pa.field("reward", pa.float64()),
        pa.field("reward_source", pa.string()),
        pa.field("correction", pa.string()),  # the latest feedback correction joined for the trace, null when none
        pa.field("implicit", pa.string()),  # JSON {signal: provenance} of implicit signals (connectors.implicit)
        pa.field("metadata", pa.string(), nullable=False),
        *_LINEAGE,
    ]
)
"""Columns a snapshot has (the trainer's contract)."""


@dataclass(frozen=True)
class Coordinates:
    """Where a record came from in Kafka."""

    topic: str
    partition: int
    offset: int


_PARTITION_RE = re.compile(r"(traces|feedback)/dt=(\d{4}-\d{2}-\d{2})/hour=(\d{2})/")
_ROWS_RE = re.compile(r"-n(\d+)\.arrow$")


def hour_of(ts: datetime) -> datetime:
    """The UTC hour that holds ``ts`` (aware datetime, minutes and below zeroed)."""
    return ts.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)


def partition_dir(kind: str, hour: datetime) -> str:
    """``traces/dt=2026-01-31/hour=07`` for a UTC hour (the year always 4 digits: ``dt=0001-01-01``)."""
    return f"{kind}/dt={hour.year:04d}-{hour.month:02d}-{hour.day:02d}/hour={hour.hour:02d}"


@dataclass(frozen=True)
class SegmentInfo:
    """A sealed segment file as seen in a listing."""

    path: str
    kind: str
    hour: datetime  # UTC start of its partition hour
    rows: int
    size: int

    @property
    def partition(self) -> str:
        return partition_dir(self.kind, self.hour)


def segment_info(path: str, size: int) -> SegmentInfo | None:
    """Parse a segment path; None when it is not a segment of this layout."""
    match = _PARTITION_RE.search(path)
    rows = _ROWS_RE.search(path)
    if match is None or rows is None:
        return None
    hour = datetime.strptime(f"{match.group(2)} {match.group(3)}", "%Y-%m-%d %H").replace(tzinfo=timezone.utc)
    return SegmentInfo(path, match.group(1), hour, int(rows.group(1)), size)


def overlaps(seg: SegmentInfo, start: datetime, end: datetime) -> bool:
    """Whether the segment's hour [h, h+1h) overlaps [start, end) (safe at the ends of the datetime range)."""
    return seg.hour < end and seg.hour > shift(start, -3600.0)


_ENCODER = json.JSONEncoder(
    ensure_ascii=False, separators=(",", ":")
)  # built once: json.dumps with options builds one per call


def to_json(value: Any) -> str:
    """Compact JSON text of a stored JSON column (``prompt``, ``signals``, ``metadata``); same bytes as
    ``json.dumps(value, ensure_ascii=False, separators=(",", ":"))``."""
    return _ENCODER.encode(value)


TraceRow = tuple[Any, ...]
"""One trace row in :data:`TRACE_SEGMENT_SCHEMA` column order, without ``ingested_at``:
(trace_id, ts, model, adapter_version, prompt JSON, completion, token ids, logprobs, tools JSON, tool calls
JSON, finish_reason, prompt token ids, conversation_id, turn, parent_trace_id, usage JSON, signals JSON or
None, metadata JSON, topic, partition, offset)."""
PROMPT_IDS = 11  # index of prompt_token_ids in a TraceRow

FeedbackRow = tuple[Any, ...]
"""One feedback row in :data:`FEEDBACK_SEGMENT_SCHEMA` order without ``ingested_at``; ``ts`` may be None
(filled with ``ingested_at`` when the table is built)."""


def trace_row(event: TraceEvent, topic: str, partition: int, offset: int) -> TraceRow:
    """The stored row of a validated trace event (the reference every faster path must match)."""
    signals = event.signals()
    return (
        event.trace_id,
        event.ts,
        event.model,
        event.adapter_version,
        to_json(event.messages()),
        event.completion,
        event.completion_token_ids,
        event.completion_logprobs,
        to_json([t.model_dump(exclude_none=True) for t in event.tools]) if event.tools is not None else None,
        to_json([c.model_dump() for c in event.completion_tool_calls])
        if event.completion_tool_calls is not None
        else None,
        event.finish_reason,
        event.prompt_token_ids,
        event.conversation_id,
        event.turn,
        event.parent_trace_id,
        to_json(event.usage.model_dump(exclude_none=True)) if event.usage is not None else None,
        to_json(signals) if signals else None,
        to_json(event.metadata),
        topic,
        partition,
        offset,
    )


def feedback_row(event: FeedbackEvent, topic: str, partition: int, offset: int) -> FeedbackRow:
    """The stored row of a validated feedback event (a ``correction`` is kept in the signals JSON, after the signals)."""
    signals = event.signals()
    if event.correction is not None:
        signals["correction"] = event.correction
    return (event.trace_id, event.ts, to_json(signals), to_json(event.metadata), topic, partition, offset)


def trace_rows_table(
    rows: list[TraceRow], ingested_at: datetime, columns: Mapping[str, pa.Array] | None = None
) -> pa.Table:
    """Rows from :func:`trace_row` (or an equivalent fast path) as a table in :data:`TRACE_SEGMENT_SCHEMA`,
    built column-wise (one ``pa.array`` per column). ``columns`` (by field name, one entry per row, of the
    field's type) are taken as they are instead of the rows' values there."""
    return _table(rows, TRACE_SEGMENT_SCHEMA, ingested_at, columns or {})


def feedback_rows_table(rows: list[FeedbackRow], ingested_at: datetime) -> pa.Table:
    """Rows from :func:`feedback_row` as a table in :data:`FEEDBACK_SEGMENT_SCHEMA` (missing ``ts`` = ``ingested_at``)."""
    rows = [row if row[1] is not None else (row[0], ingested_at, *row[2:]) for row in rows]
    return _table(rows, FEEDBACK_SEGMENT_SCHEMA, ingested_at, {})


def _table(
    rows: list[tuple[Any, ...]], schema: pa.Schema, ingested_at: datetime, given: Mapping[str, pa.Array]
) -> pa.Table:
    if not rows:
        return schema.empty_table()
    columns = list(zip(*rows))  # row tuples -> one tuple per column
    *row_fields, ingested_field = schema  # rows hold every column but the last, ingested_at
    arrays = [
        given[f.name] if f.name in given else pa.array(values, type=f.type)
        for values, f in zip(columns, row_fields, strict=True)
    ]
    arrays.append(pa.repeat(pa.scalar(ingested_at, type=ingested_field.type), len(rows)))
    return pa.Table.from_arrays(arrays, schema=schema)


def trace_table(rows: list[tuple[TraceEvent, Coordinates]], ingested_at: datetime) -> pa.Table:
    """Trace events + their Kafka coordinates as a table in :data:`TRACE_SEGMENT_SCHEMA`."""
    return trace_rows_table([trace_row(e, w.topic, w.partition, w.offset) for e, w in rows], ingested_at)


def feedback_table(rows: list[tuple[FeedbackEvent, Coordinates]], ingested_at: datetime) -> pa.Table:
    """Feedback events as a table in :data:`FEEDBACK_SEGMENT_SCHEMA` (missing ``ts`` = ``ingested_at``)."""
    return feedback_rows_table([feedback_row(e, w.topic, w.partition, w.offset) for e, w in rows], ingested_at)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A stored table in ``schema``: columns it lacks (a segment written before they existed) added as nulls,
    in the schema's order. Raises ``pyarrow.ArrowInvalid`` for a column whose type cannot be cast."""
    if table.schema.equals(schema):
        return table
    columns = [table[f.name] if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def encode(table: pa.Table) -> bytes:
    """One Arrow IPC file (random-access format) in memory."""
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode(data: bytes) -> pa.Table:
    """Inverse of :func:`encode`."""
    return ipc.open_file(pa.BufferReader(data)).read_all()
