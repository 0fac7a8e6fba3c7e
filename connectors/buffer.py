"""The Arrow reward buffer: durable hourly segments of traces and feedback, read as consistent snapshots.

Write path (:meth:`RewardBuffer.append`): one Arrow IPC segment per hour
partition per batch, written durably (temp name, fsync, rename) before the
caller commits Kafka offsets: at-least-once. Read path
(:meth:`RewardBuffer.snapshot`): list the sealed segments once (a fixed set,
so the result is consistent while writers keep appending), de-duplicate traces
by ``trace_id`` (first ingested wins: redelivery after a crash shows once),
join feedback to traces by ``trace_id`` within
``buffer.feedback_join_window_s``, and link conversation turns the gateway could
not link itself (``parent_trace_id`` from the hashes in ``metadata.conversation``). Feedback is stored in its own segments, so
it may arrive before the trace, after it, or never.

Maintenance: :meth:`sweep_unmatched_feedback` sends feedback that found no
trace within its window to the dead-letter store; :meth:`apply_retention`
deletes hour partitions by age and total size. Storage is ``pyarrow.fs``.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import re
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from prometheus_client import Counter

from connectors.config import BufferConfig
from connectors.dead_letter import DeadLetter, DeadLetterStore
from connectors.implicit import Turn, derive
from connectors.reward import merge_signals, reward_from_signals, with_implicit
from connectors.schema import UNMATCHED_FEEDBACK, FeedbackEvent, TraceEvent, shift
from connectors.segments import (
    FEEDBACK,
    FEEDBACK_SEGMENT_SCHEMA,
    SNAPSHOT_SCHEMA,
    TRACE_SEGMENT_SCHEMA,
    TRACES,
    Coordinates,
    SegmentInfo,
    conform,
    decode,
    encode,
    feedback_table,
    hour_of,
    overlaps,
    partition_dir,
    segment_info,
    trace_rows_table,
    trace_table,
)
from connectors.storage import list_files, open_location, read_bytes, write_durable

MANIFEST = "manifest.json"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_FAR = datetime.max.replace(tzinfo=timezone.utc)
_MIN = datetime.min.replace(tzinfo=timezone.utc)
_SEG_NAME = re.compile(r"seg-(\d+)-(.+)-(\d+)-n\d+\.arrow$")
ANONYMOUS = "anonymous"  # the voter of feedback without metadata.user_hash

log = logging.getLogger(__name__)
RETENTION_PARTITIONS = Counter(
    "hourglass_buffer_retention_partitions_deleted", "Hour partitions deleted by retention (age or size).", ["kind"]
)
RETENTION_ROWS = Counter("hourglass_buffer_retention_rows_deleted", "Rows deleted by retention, by kind.", ["kind"])


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
        row = ("warm-up", now, "m", None, "[]", "", [0], [0.0], *[None] * 8, None, "{}", "warm-up", 0, 0)
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
        # Segments written before a column existed read with that column null.
        return pa.concat_tables([conform(decode(read_bytes(self.loc, s.path)), schema) for s in segs])

    # --- read path ----------------------------------------------------------------

    def snapshot(
        self,
        start: datetime | None = None,
        end: datetime | None = None,
        *,
        now: datetime | None = None,
        as_of: datetime | None = None,
    ) -> pa.Table:
        """Traces with ``start <= ts < end`` from sealed segments, de-duplicated, feedback joined.

        Args:
            start, end: aware datetimes (UTC or any zone); None = unbounded.

        Returns:
            A table in :data:`~connectors.segments.SNAPSHOT_SCHEMA`, sorted by
            ``ts`` then ``trace_id``. ``reward`` / ``reward_source`` come from
            inline signals merged with feedback events whose ``ts`` is within
            ``feedback_join_window_s`` of the trace's ``ts`` (later feedback wins
            per signal), mapped by ``buffer.reward``; null when there is none.
            One vote per user: of the feedback events of one trace with the same
            ``metadata.user_hash`` (or none: one anonymous voter), only the latest
            (by ``ts``, then ingest order) counts, so a repeated vote replaces the
            earlier one. ``correction`` is the latest joined correction (or null).
            Implicit signals (``buffer.implicit``, :mod:`connectors.implicit`) are derived from the traces
            up to one window after ``end`` and judged at ``now`` (default: the wall clock); they add to the
            reward of a trace without explicit feedback, and the ``implicit`` column holds each derived
            signal with its provenance (JSON, null when none).
            as_of: the snapshot a round at that time could have taken (a replay of a past window): traces
                and feedback dated after it are left out, and implicit signals are judged then (``now``).
        """
        start, end = start or _EPOCH, end or _FAR
        if as_of is not None:
            if as_of.tzinfo is None:
                raise ValueError(f"as_of {as_of.isoformat()} has no time zone")
            now, end = as_of, min(end, as_of)
        window = timedelta(seconds=self.cfg.feedback_join_window_s)
        listing = self.segments()  # the fixed list this snapshot reads
        implicit = self.cfg.implicit
        # the evidence of implicit signals: traces up to one window after the snapshot's end
        reach = shift(end, implicit.window_s) if implicit.enabled else end
        if as_of is not None:  # no evidence from after it
            reach = min(reach, as_of)
        traces = self._read(
            [s for s in listing if s.kind == TRACES and overlaps(s, start, reach)], TRACE_SEGMENT_SCHEMA
        )
        traces = traces.filter(_in_range(traces, start, reach))
        traces = _link_turns(_first_per_trace_id(traces))
        derived = derive(_turns(traces), now or datetime.now(timezone.utc), implicit) if implicit.enabled else None
        inside = _in_range(traces, start, end)
        traces = traces.filter(inside)
        if derived is not None:
            derived = [d for d, keep in zip(derived, inside.to_pylist(), strict=True) if keep]
        window_s = window.total_seconds()
        fb_segs = [
            s for s in listing if s.kind == FEEDBACK and overlaps(s, shift(start, -window_s), shift(end, window_s))
        ]
        feedback = self._read(fb_segs, FEEDBACK_SEGMENT_SCHEMA)
        feedback = feedback.filter(pc.is_in(feedback["trace_id"], value_set=traces["trace_id"]))
        if as_of is not None:
            feedback = feedback.filter(pc.less_equal(pc.cast(feedback["ts"], pa.int64()), _ms(as_of)))
        by_trace: dict[str, list[tuple[datetime, str, dict[str, Any]]]] = defaultdict(list)
        for row in feedback.select(["trace_id", "ts", "signals", "metadata"]).to_pylist():
            by_trace[row["trace_id"]].append((row["ts"], _voter(row["metadata"]), json.loads(row["signals"])))
        rewards: list[float | None] = []
        sources: list[str | None] = []
        corrections: list[str | None] = []
        implicit_json: list[str | None] = []
        for i, (trace_id, ts, inline) in enumerate(
            zip(traces["trace_id"].to_pylist(), traces["ts"].to_pylist(), traces["signals"].to_pylist())
        ):
            joined = _one_vote_per_user(
                [(t, who, sig) for t, who, sig in by_trace.get(trace_id, ()) if abs(t - ts) <= window]
            )
            merged = merge_signals(json.loads(inline) if inline else {}, joined)
            correction = merged.pop("correction", None)
            reward, source = reward_from_signals(merged, self.cfg.reward)
            found = derived[i] if derived is not None else {}
            if found:
                reward, source = with_implicit(reward, source, merged, found, self.cfg.reward, implicit)
            implicit_json.append(json.dumps(found, sort_keys=True) if found else None)
            rewards.append(reward)
            sources.append(source)
            corrections.append(correction if isinstance(correction, str) else None)
        out = traces.drop_columns(["signals"])
        out = out.append_column("reward", pa.array(rewards, pa.float64()))
        out = out.append_column("reward_source", pa.array(sources, pa.string()))
        out = out.append_column("correction", pa.array(corrections, pa.string()))
        out = out.append_column("implicit", pa.array(implicit_json, pa.string()))
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
        the manifest's ``feedback_swept_until_ms`` watermark. Late feedback (its
        ``ts`` already below the watermark when it was stored: a late client,
        consumer lag) is swept too: the manifest remembers, per writer, the newest
        feedback segment seen (``feedback_seen``: writer -> [ingest ms, seq]), and
        rows below the watermark in segments sealed since are checked as well.
        Dead letters are written before the manifest moves (a crash may repeat,
        never lose).
        """
        now = now or datetime.now(timezone.utc)
        window = timedelta(seconds=self.cfg.feedback_join_window_s)
        window_s = self.cfg.feedback_join_window_s
        until = shift(now, -window_s)
        manifest = self.read_manifest()
        mark = manifest.get("feedback_swept_until_ms")
        since = datetime.fromtimestamp(mark / 1000, tz=timezone.utc) if mark is not None else _EPOCH
        seen: dict[str, list[int]] = manifest.get("feedback_seen") or {}
        listing = self.segments()
        fb_listing = [s for s in listing if s.kind == FEEDBACK]
        if mark is not None and "feedback_seen" not in manifest:  # a manifest from before late sweeps: all seen
            seen = _newest_per_writer(fb_listing, {})
        newest = _newest_per_writer(fb_listing, seen)
        if until <= since and newest == seen:
            return 0
        until = max(until, since)
        # Segments seen by an earlier sweep: only rows in [since, until). Segments sealed since: every row
        # below `until` (those below `since` are late feedback no earlier sweep could see).
        known = [s for s in fb_listing if not _is_new(s, seen) and overlaps(s, since, until)]
        new = [s for s in fb_listing if _is_new(s, seen) and overlaps(s, _MIN, until)]
        rows = [r for r in self._read(known, FEEDBACK_SEGMENT_SCHEMA).to_pylist() if since <= r["ts"] < until]
        rows += [r for r in self._read(new, FEEDBACK_SEGMENT_SCHEMA).to_pylist() if r["ts"] < until]
        if not rows:
            self.write_manifest(feedback_swept_until_ms=int(until.timestamp() * 1000), feedback_seen=newest)
            return 0
        low = min(r["ts"] for r in rows)
        traces = self._read(
            [s for s in listing if s.kind == TRACES and overlaps(s, shift(low, -window_s), shift(until, window_s))],
            TRACE_SEGMENT_SCHEMA,
        ).select(["trace_id", "ts"])
        trace_ts: dict[str, list[datetime]] = defaultdict(list)
        for tid, ts in zip(traces["trace_id"].to_pylist(), traces["ts"].to_pylist()):
            trace_ts[tid].append(ts)
        letters = [
            DeadLetter(
                UNMATCHED_FEEDBACK,
                f"no trace {r['trace_id']!r} within feedback_join_window_s={self.cfg.feedback_join_window_s} of {r['ts'].isoformat()}",
                r["topic"],
                r["partition"],
                r["offset"],
                json.dumps(
                    {
                        "trace_id": r["trace_id"],
                        "ts": r["ts"].isoformat(),
                        **json.loads(r["signals"]),
                        "metadata": json.loads(r["metadata"]),
                    }
                ).encode("utf-8"),
            )
            for r in rows
            if not any(abs(t - r["ts"]) <= window for t in trace_ts.get(r["trace_id"], ()))
        ]
        dead_letters.write(letters, now)
        self.write_manifest(feedback_swept_until_ms=int(until.timestamp() * 1000), feedback_seen=newest)
        return len(letters)

    def apply_retention(self, now: datetime | None = None) -> list[str]:
        """Delete hour partitions older than ``retention_hours``, then the oldest until under
        ``retention_max_bytes``; returns the deleted partition folders (relative to the root).

        Never raises: datetime arithmetic is clamped to the representable range, and a partition
        that cannot be deleted is logged (WARNING) and retried at the next pass. What is deleted is
        counted (``hourglass_buffer_retention_partitions_deleted_total`` / ``..._rows_deleted_total``
        by kind) and logged at INFO with the counts.
        """
        now = now or datetime.now(timezone.utc)
        cutoff = shift(now, -self.cfg.retention_hours * 3600.0)
        last_hour_kept = shift(cutoff, -3600.0)  # a partition [h, h+1h) is too old when h + 1h <= cutoff
        parts: dict[str, tuple[datetime, int, int, str]] = {}
        for seg in self.segments():
            hour, size, rows, _ = parts.get(seg.partition, (seg.hour, 0, 0, seg.kind))
            parts[seg.partition] = (hour, size + seg.size, rows + seg.rows, seg.kind)
        doomed = [p for p, (hour, *_) in parts.items() if hour <= last_hour_kept]
        total = sum(size for p, (_, size, *_) in parts.items() if p not in doomed)
        for part, (_, size, *_) in sorted(parts.items(), key=lambda item: (item[1][0], item[0])):
            if total <= self.cfg.retention_max_bytes:
                break
            if part not in doomed:
                doomed.append(part)
                total -= size
        deleted: list[str] = []
        rows_by_kind: dict[str, int] = defaultdict(int)
        for part in doomed:
            try:
                self.loc.fs.delete_dir(self.loc.path(part))
            except OSError as err:
                log.warning("retention could not delete %s (%s); retrying at the next pass", part, err)
                continue
            _, _, rows, kind = parts[part]
            deleted.append(part)
            rows_by_kind[kind] += rows
            RETENTION_PARTITIONS.labels(kind).inc()
            RETENTION_ROWS.labels(kind).inc(rows)
        if deleted:
            log.info(
                "retention deleted %d partition(s) holding %s rows (cutoff %s, max %d bytes): %s",
                len(deleted),
                dict(rows_by_kind),
                cutoff.isoformat(),
                self.cfg.retention_max_bytes,
                sorted(deleted),
            )
        self._remove_stale_temp_files()
        return sorted(deleted)

    def _remove_stale_temp_files(self, age: timedelta = timedelta(hours=1)) -> None:
        """Delete ``.tmp-*`` files a crash left mid-write (never read; older than ``age`` by the wall clock)."""
        now = datetime.now(timezone.utc)
        selector = pafs.FileSelector(self.loc.base, recursive=True, allow_not_found=True)
        try:
            infos = self.loc.fs.get_file_info(selector)
        except OSError as err:
            log.warning("could not list %s for stale temp files: %s", self.loc.base, err)
            return
        for info in infos:
            if info.base_name.startswith(".tmp-") and info.mtime is not None and info.mtime < now - age:
                try:
                    self.loc.fs.delete_file(info.path)
                except OSError as err:
                    log.warning("could not delete stale temp file %s: %s", info.path, err)


def _segment_mark(seg: SegmentInfo) -> tuple[str, list[int]] | None:
    """(writer id, [ingest ms, sequence]) from a segment's file name; None for a name of another form."""
    match = _SEG_NAME.search(seg.path.rsplit("/", 1)[-1])
    return None if match is None else (match.group(2), [int(match.group(1)), int(match.group(3))])


def _is_new(seg: SegmentInfo, seen: dict[str, list[int]]) -> bool:
    """Whether the segment was sealed after the newest one of its writer that the last sweep saw."""
    mark = _segment_mark(seg)
    return mark is not None and mark[1] > seen.get(mark[0], [-1, -1])


def _newest_per_writer(segs: list[SegmentInfo], seen: dict[str, list[int]]) -> dict[str, list[int]]:
    """Writer -> newest [ingest ms, sequence] among ``segs`` (writers with no segment left are dropped)."""
    newest: dict[str, list[int]] = {}
    for seg in segs:
        mark = _segment_mark(seg)
        if mark is not None and mark[1] > newest.get(mark[0], [-1, -1]):
            newest[mark[0]] = mark[1]
    return {writer: max(mark, seen.get(writer, mark)) for writer, mark in sorted(newest.items())}


def _voter(metadata: str | None) -> str:
    """Who gave a feedback event: its ``metadata.user_hash`` (set by the gateway), else :data:`ANONYMOUS`."""
    try:
        user = json.loads(metadata).get("user_hash") if metadata else None
    except (ValueError, AttributeError, RecursionError):
        user = None
    return user if isinstance(user, str) and user else ANONYMOUS


def _one_vote_per_user(
    events: list[tuple[datetime, str, dict[str, Any]]],
) -> list[tuple[datetime, dict[str, Any]]]:
    """(ts, signals) of the latest event per voter (by ts; at equal ts the later in the list, i.e. ingest order)."""
    latest: dict[str, tuple[datetime, dict[str, Any]]] = {}
    for ts, voter, signals in sorted(events, key=lambda item: item[0]):  # stable: ingest order among equal ts
        latest[voter] = (ts, signals)
    return list(latest.values())


def _split_by_hour(table: pa.Table) -> list[tuple[datetime, pa.Table]]:
    """(UTC hour, rows of that hour in their original order), hours ascending; column-wise."""
    if table.num_rows == 0:
        return []
    hours = pc.floor_temporal(table["ts"], unit="hour")
    distinct = sorted(pc.unique(hours).to_pylist())
    if len(distinct) == 1:  # the usual batch: all in one hour, no copy
        return [(hour_of(distinct[0]), table)]
    return [(hour_of(h), table.filter(pc.equal(hours, pa.scalar(h, hours.type)))) for h in distinct]


def _link_turns(traces: pa.Table) -> pa.Table:
    """``parent_trace_id`` filled where the gateway left it null but the trace says which answer it continues
    (``metadata.conversation.continues``) and a trace of the table gave that answer
    (``metadata.conversation.answer``): the latest such trace not after it. The gateway links at request time
    from its own memory; this links what another replica (or a restarted one) answered."""
    parents = traces["parent_trace_id"].to_pylist()
    if traces.num_rows == 0 or all(p is not None for p in parents):
        return traces
    hashes: list[dict[str, Any]] = []
    for text in traces["metadata"].to_pylist():
        found: Any = None
        if text and '"conversation"' in text:
            try:
                found = json.loads(text).get("conversation")
            except (ValueError, AttributeError, RecursionError):
                found = None
        hashes.append(found if isinstance(found, dict) else {})
    ids, times = traces["trace_id"].to_pylist(), traces["ts"].to_pylist()
    answered: dict[str, list[tuple[datetime, str]]] = defaultdict(list)
    for trace_id, ts, known in zip(ids, times, hashes):
        if isinstance(known.get("answer"), str):
            answered[known["answer"]].append((ts, trace_id))
    for answers in answered.values():
        answers.sort()
    changed = False
    for i, known in enumerate(hashes):
        continues = known.get("continues")
        if parents[i] is not None or not isinstance(continues, str) or continues not in answered:
            continue
        answers = answered[continues]  # the latest answer not after this turn (binary search: O(n log n))
        j = bisect.bisect_right(answers, times[i], key=lambda answer: answer[0]) - 1
        if j >= 0 and answers[j][1] == ids[i]:
            j -= 1
        if j >= 0:
            parents[i] = answers[j][1]
            changed = True
    if not changed:
        return traces
    index = traces.schema.get_field_index("parent_trace_id")
    return traces.set_column(index, traces.schema.field(index), pa.array(parents, pa.string()))


def _ms(when: datetime, up: bool = False) -> int:
    """``when`` in whole milliseconds since 1970 (the buffer's ``ts``), rounded down (``up``: up), exactly: a
    float's ``timestamp() * 1000`` can land 1 ms low."""
    whole, rest = divmod(when - _EPOCH, timedelta(milliseconds=1))
    return int(whole) + (1 if up and rest else 0)


def _in_range(traces: pa.Table, start: datetime, end: datetime) -> pa.ChunkedArray:
    """The mask of rows with ``start <= ts < end`` (``ts`` in whole ms: the bounds rounded up)."""
    ts_ms = pc.cast(traces["ts"], pa.int64())
    return pc.and_(pc.greater_equal(ts_ms, _ms(start, up=True)), pc.less(ts_ms, _ms(end, up=True)))


def _turns(traces: pa.Table) -> list[Turn]:
    """The columns :func:`connectors.implicit.derive` reads, one :class:`Turn` per row."""
    cols = ["trace_id", "ts", "prompt", "conversation_id", "turn", "parent_trace_id", "completion_tool_calls"]
    users = [_voter(m) for m in traces["metadata"].to_pylist()]
    return [Turn(**row, user=user) for row, user in zip(traces.select(cols).to_pylist(), users, strict=True)]


def _first_per_trace_id(table: pa.Table) -> pa.Table:
    """Keep the first row of each ``trace_id`` (rows are in ingest order)."""
    if table.num_rows == 0:
        return table
    indexed = table.append_column("_row", pa.array(range(table.num_rows), pa.int64()))
    first = indexed.group_by("trace_id", use_threads=False).aggregate([("_row", "min")])
    rows = first["_row_min"]
    return table.take(pc.take(rows, pc.sort_indices(rows)))
