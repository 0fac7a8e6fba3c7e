"""The Arrow reward buffer: durable hourly segments of traces and feedback, read as consistent snapshots.

Write path (:meth:`RewardBuffer.append`): one Arrow IPC segment per hour
partition per batch, written durably (temp name, fsync, rename) before the
caller commits Kafka offsets: at-least-once. Read path
(:meth:`RewardBuffer.snapshot`): list the sealed segments once (a fixed set,
so the result is consistent while writers keep appending), de-duplicate traces
by ``trace_id`` (first ingested wins: redelivery after a crash shows once),
and join feedback to traces by ``trace_id`` within
``buffer.feedback_join_window_s``. Feedback is stored in its own segments, so
it may arrive before the trace, after it, or never.

Maintenance: :meth:`sweep_unmatched_feedback` sends feedback that found no
trace within its window to the dead-letter store; :meth:`apply_retention`
deletes hour partitions by age and total size. Storage is ``pyarrow.fs``.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from connectors.config import BufferConfig
from connectors.dead_letter import DeadLetter, DeadLetterStore
from connectors.reward import merge_signals, reward_from_signals
from connectors.schema import UNMATCHED_FEEDBACK, FeedbackEvent, TraceEvent
from connectors.segments import (
    FEEDBACK,
    FEEDBACK_SEGMENT_SCHEMA,
    SNAPSHOT_SCHEMA,
    TRACE_SEGMENT_SCHEMA,
    TRACES,
    Coordinates,
    SegmentInfo,
    decode,
    encode,
    feedback_table,
    hour_of,
    overlaps,
    partition_dir,
    segment_info,
    trace_rows_table,
    trace_table,
)  # fmt: skip
from connectors.storage import list_files, open_location, read_bytes, write_durable

MANIFEST = "manifest.json"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_FAR = datetime(9999, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class BufferStats:
    """What the buffer holds (rows counted before de-duplication)."""

    trace_rows: int
    feedback_rows: int
    segments: int
    partitions: int
    bytes: int
    oldest_hour: str | None
    newest_hour: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RewardBuffer:
    """Append-only Arrow reward buffer on a local path or object store (see module doc)."""

    def __init__(self, cfg: BufferConfig, writer_id: str | None = None) -> None:
        self.cfg = cfg
        self.loc = open_location(cfg.root)
        self.writer_id = writer_id or uuid.uuid4().hex[:8]
        self._seq = itertools.count()

    # --- write path -------------------------------------------------------------

    def append(
        self,
        traces: list[tuple[TraceEvent, Coordinates]],
        feedback: list[tuple[FeedbackEvent, Coordinates]],
        ingested_at: datetime | None = None,
    ) -> list[str]:
        """Write the batch durably; returns the segment paths. When it returns, offsets may be committed.

        Raises:
            BufferStorageError: a segment could not be written durably (commit nothing then).
        """
        now = ingested_at or datetime.now(timezone.utc)
        return self.write_tables(trace_table(traces, now), feedback_table(feedback, now), now)

    def write_tables(self, traces: pa.Table, feedback: pa.Table, ingested_at: datetime) -> list[str]:
        """Write prebuilt tables (in :data:`TRACE_SEGMENT_SCHEMA` / :data:`FEEDBACK_SEGMENT_SCHEMA`) durably,
        split by the UTC hour of ``ts`` and into chunks of ``segment_max_rows``; returns the segment paths.

        Row order within an hour is kept. When it returns, offsets may be committed.

        Raises:
            BufferStorageError: a segment could not be written durably (commit nothing then).
        """
        written: list[str] = []
        for kind, table in ((TRACES, traces), (FEEDBACK, feedback)):
            for hour, hour_rows in _split_by_hour(table):
                for start in range(0, hour_rows.num_rows, self.cfg.segment_max_rows):
                    chunk = hour_rows.slice(start, self.cfg.segment_max_rows)
                    written.append(self._write_segment(kind, hour, chunk, ingested_at))
        return written

    def warm_up(self) -> None:
        """Build, split and encode one synthetic trace row without writing anything, so that pyarrow's lazy
        imports (its pandas shim, loaded by the first ``pa.array``: about 0.5 s on an idle 2-core host, seconds
        on a loaded one; the temporal compute kernels) happen at start-up instead of inside the first batch."""
        now = datetime.now(timezone.utc)
        row = ("warm-up", now, "m", None, "[]", "", [0], [0.0], None, "{}", "warm-up", 0, 0)
        for _, table in _split_by_hour(trace_rows_table([row], now)):
            encode(table)

    def _write_segment(self, kind: str, hour: datetime, table: pa.Table, now: datetime) -> str:
        name = f"seg-{int(now.timestamp() * 1000):013d}-{self.writer_id}-{next(self._seq):06d}-n{table.num_rows}.arrow"
        path = self.loc.path(partition_dir(kind, hour), name)
        write_durable(self.loc, path, encode(table))
        return path

    # --- listing ------------------------------------------------------------------

    def segments(self, kind: str | None = None) -> list[SegmentInfo]:
        """Sealed segments (optionally of one kind), oldest ingest first within a partition."""
        out = []
        for info in list_files(self.loc, self.loc.base, ".arrow"):
            seg = segment_info(info.path, info.size or 0)
            if seg is not None and (kind is None or seg.kind == kind):
                out.append(seg)
        return out

    def _read(self, segs: list[SegmentInfo], schema: pa.Schema) -> pa.Table:
        if not segs:
            return schema.empty_table()
        # Sorted by file name = ingest time: "first ingested" is the first row of a trace_id.
        segs = sorted(segs, key=lambda s: s.path.rsplit("/", 1)[-1])
        return pa.concat_tables([decode(read_bytes(self.loc, s.path)) for s in segs])

    # --- read path ----------------------------------------------------------------

    def snapshot(self, start: datetime | None = None, end: datetime | None = None) -> pa.Table:
        """Traces with ``start <= ts < end`` from sealed segments, de-duplicated, feedback joined.

        Args:
            start, end: aware datetimes (UTC or any zone); None = unbounded.

        Returns:
            A table in :data:`~connectors.segments.SNAPSHOT_SCHEMA`, sorted by
            ``ts`` then ``trace_id``. ``reward`` / ``reward_source`` come from
            inline signals merged with feedback events whose ``ts`` is within
            ``feedback_join_window_s`` of the trace's ``ts`` (later feedback wins
            per signal), mapped by ``buffer.reward``; null when there is none.
        """
        start, end = start or _EPOCH, end or _FAR
        window = timedelta(seconds=self.cfg.feedback_join_window_s)
        listing = self.segments()  # the fixed list this snapshot reads
        traces = self._read([s for s in listing if s.kind == TRACES and overlaps(s, start, end)], TRACE_SEGMENT_SCHEMA)
        ts_ms = pc.cast(traces["ts"], pa.int64())
        keep = pc.and_(
            pc.greater_equal(ts_ms, int(start.timestamp() * 1000)), pc.less(ts_ms, int(end.timestamp() * 1000))
        )
        traces = traces.filter(keep)
        traces = _first_per_trace_id(traces)
        fb_segs = [s for s in listing if s.kind == FEEDBACK and overlaps(s, start - window, end + window)]
        feedback = self._read(fb_segs, FEEDBACK_SEGMENT_SCHEMA)
        feedback = feedback.filter(pc.is_in(feedback["trace_id"], value_set=traces["trace_id"]))
        by_trace: dict[str, list[tuple[datetime, dict[str, Any]]]] = defaultdict(list)
        for row in feedback.select(["trace_id", "ts", "signals"]).to_pylist():
            by_trace[row["trace_id"]].append((row["ts"], json.loads(row["signals"])))
        rewards: list[float | None] = []
        sources: list[str | None] = []
        for trace_id, ts, inline in zip(
            traces["trace_id"].to_pylist(), traces["ts"].to_pylist(), traces["signals"].to_pylist()
        ):
            joined = [(t, sig) for t, sig in by_trace.get(trace_id, ()) if abs(t - ts) <= window]
            reward, source = reward_from_signals(merge_signals(json.loads(inline) if inline else {}, joined), self.cfg.reward)
            rewards.append(reward)
            sources.append(source)
        out = traces.drop_columns(["signals"])
        out = out.append_column("reward", pa.array(rewards, pa.float64()))
        out = out.append_column("reward_source", pa.array(sources, pa.string()))
        out = out.select(SNAPSHOT_SCHEMA.names).cast(SNAPSHOT_SCHEMA)
        return out.sort_by([("ts", "ascending"), ("trace_id", "ascending")])

    def stats(self) -> BufferStats:
        """Counts from the segment listing (cheap: row counts are in the file names)."""
        segs = self.segments()
        hours = sorted({s.hour for s in segs})
        return BufferStats(
            trace_rows=sum(s.rows for s in segs if s.kind == TRACES),
            feedback_rows=sum(s.rows for s in segs if s.kind == FEEDBACK),
            segments=len(segs),
            partitions=len({s.partition for s in segs}),
            bytes=sum(s.size for s in segs),
            oldest_hour=hours[0].isoformat() if hours else None,
            newest_hour=hours[-1].isoformat() if hours else None,
        )

    # --- maintenance ------------------------------------------------------------

    def read_manifest(self) -> dict[str, Any]:
        """The manifest (``{}`` before the first maintenance pass)."""
        path = self.loc.path(MANIFEST)
        if self.loc.fs.get_file_info(path).type.name == "NotFound":
            return {}
        return json.loads(read_bytes(self.loc, path))

    def write_manifest(self, **state: Any) -> dict[str, Any]:
        """Rewrite the manifest: layout version, partition summary, maintenance state (merged with ``state``).

        The segment listing stays the source of truth for reads; the manifest
        is a summary plus the sweep watermark.
        """
        manifest = self.read_manifest()
        parts: dict[str, dict[str, int]] = defaultdict(lambda: {"segments": 0, "rows": 0, "bytes": 0})
        for seg in self.segments():
            part = parts[seg.partition]
            part["segments"] += 1
            part["rows"] += seg.rows
            part["bytes"] += seg.size
        manifest.update(state)
        manifest.update(
            format="hourglass.buffer/v1",
            updated_at=datetime.now(timezone.utc).isoformat(),
            partitions=dict(sorted(parts.items())),
        )
        write_durable(self.loc, self.loc.path(MANIFEST), json.dumps(manifest, indent=1).encode("utf-8"))
        return manifest

    def sweep_unmatched_feedback(self, dead_letters: DeadLetterStore, now: datetime | None = None) -> int:
        """Dead-letter feedback whose window has passed without a matching trace; returns how many.

        Sweeps feedback with ``ts`` in ``[watermark, now - window)`` and advances
        the manifest's ``feedback_swept_until_ms`` watermark. Dead letters are
        written before the watermark moves (a crash may repeat, never lose).
        """
        now = now or datetime.now(timezone.utc)
        window = timedelta(seconds=self.cfg.feedback_join_window_s)
        until = now - window
        mark = self.read_manifest().get("feedback_swept_until_ms")
        since = datetime.fromtimestamp(mark / 1000, tz=timezone.utc) if mark is not None else _EPOCH
        if until <= since:
            return 0
        listing = self.segments()
        feedback = self._read([s for s in listing if s.kind == FEEDBACK and overlaps(s, since, until)], FEEDBACK_SEGMENT_SCHEMA)
        rows = [r for r in feedback.to_pylist() if since <= r["ts"] < until]
        traces = self._read(
            [s for s in listing if s.kind == TRACES and overlaps(s, since - window, until + window)], TRACE_SEGMENT_SCHEMA
        ).select(["trace_id", "ts"])
        trace_ts: dict[str, list[datetime]] = defaultdict(list)
        for tid, ts in zip(traces["trace_id"].to_pylist(), traces["ts"].to_pylist()):
            trace_ts[tid].append(ts)
        letters = [
            DeadLetter(
                UNMATCHED_FEEDBACK,
                f"no trace {r['trace_id']!r} within feedback_join_window_s={self.cfg.feedback_join_window_s} of {r['ts'].isoformat()}",
                r["topic"], r["partition"], r["offset"],
                json.dumps({"trace_id": r["trace_id"], "ts": r["ts"].isoformat(), **json.loads(r["signals"]),
                            "metadata": json.loads(r["metadata"])}).encode("utf-8"),
            )  # fmt: skip
            for r in rows
            if not any(abs(t - r["ts"]) <= window for t in trace_ts.get(r["trace_id"], ()))
        ]
        dead_letters.write(letters, now)
        self.write_manifest(feedback_swept_until_ms=int(until.timestamp() * 1000))
        return len(letters)

    def apply_retention(self, now: datetime | None = None) -> list[str]:
        """Delete hour partitions older than ``retention_hours``, then the oldest until under
        ``retention_max_bytes``; returns the deleted partition folders (relative to the root)."""
        now = now or datetime.now(timezone.utc)
        cutoff = now - timedelta(hours=self.cfg.retention_hours)
        parts: dict[str, tuple[datetime, int]] = {}
        for seg in self.segments():
            hour, size = parts.get(seg.partition, (seg.hour, 0))
            parts[seg.partition] = (hour, size + seg.size)
        doomed = [p for p, (hour, _) in parts.items() if hour + timedelta(hours=1) <= cutoff]
        total = sum(size for p, (_, size) in parts.items() if p not in doomed)
        for part, (_, size) in sorted(parts.items(), key=lambda item: (item[1][0], item[0])):
            if total <= self.cfg.retention_max_bytes:
                break
            if part not in doomed:
                doomed.append(part)
                total -= size
        for part in doomed:
            self.loc.fs.delete_dir(self.loc.path(part))
        self._remove_stale_temp_files()
        return sorted(doomed)

    def _remove_stale_temp_files(self, age: timedelta = timedelta(hours=1)) -> None:
        """Delete ``.tmp-*`` files a crash left mid-write (never read; older than ``age`` by the wall clock)."""
        now = datetime.now(timezone.utc)
        selector = pafs.FileSelector(self.loc.base, recursive=True, allow_not_found=True)
        for info in self.loc.fs.get_file_info(selector):
            if info.base_name.startswith(".tmp-") and info.mtime is not None and info.mtime < now - age:
                self.loc.fs.delete_file(info.path)


def _split_by_hour(table: pa.Table) -> list[tuple[datetime, pa.Table]]:
    """(UTC hour, rows of that hour in their original order), hours ascending; column-wise."""
    if table.num_rows == 0:
        return []
    hours = pc.floor_temporal(table["ts"], unit="hour")
    distinct = sorted(pc.unique(hours).to_pylist())
    if len(distinct) == 1:  # the usual batch: all in one hour, no copy
        return [(hour_of(distinct[0]), table)]
    return [(hour_of(h), table.filter(pc.equal(hours, pa.scalar(h, hours.type)))) for h in distinct]


def _first_per_trace_id(table: pa.Table) -> pa.Table:
    """Keep the first row of each ``trace_id`` (rows are in ingest order)."""
    if table.num_rows == 0:
        return table
    indexed = table.append_column("_row", pa.array(range(table.num_rows), pa.int64()))
    first = indexed.group_by("trace_id", use_threads=False).aggregate([("_row", "min")])
    rows = first["_row_min"]
    return table.take(pc.take(rows, pc.sort_indices(rows)))
