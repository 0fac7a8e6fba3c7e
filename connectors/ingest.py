"""The ingestion loop: Kafka consumer group -> parse -> durable buffer / dead-letter store -> offset commit.

Delivery guarantee: at-least-once. For each polled batch, in this order:

1. parse every record (bad ones become dead letters, nothing is dropped) with
   :func:`connectors.fast_parse.parse_batch`: msgspec for the usual record, pydantic for the rest;
2. write the dead letters durably (fsync) to the dead-letter store;
3. write traces and feedback durably as buffer segments;
4. only then commit the batch's offsets (``offset + 1`` per partition). The commit is sent
   asynchronously, in batch order, so the consumer keeps polling while the broker acknowledges;
   a graceful stop waits for every acknowledgement.

A crash before step 4 redelivers the batch; the buffer de-duplicates by
``trace_id`` at snapshot time, so training data sees each trace once.

Nothing stops the loop:

- a record that cannot be parsed, or whose ``ts`` is outside the accepted window, is a dead letter;
- a record batch kafka-python cannot decode (codec missing, corrupt batch) becomes one
  ``undecodable_record`` dead letter per offset, and the consumer seeks past it;
- a full or failing disk (:class:`~connectors.errors.BufferStorageError`) makes the worker retry the
  same batch with exponential backoff (nothing is committed meanwhile, so nothing is lost; fetching
  pauses), visible in :meth:`IngestWorker.health` and the ``hourglass_ingest_storage_ok`` gauge.

OpenTelemetry GenAI traces: with an ``[otel]`` section (:class:`~connectors.otel.OtelSourceConfig`) the
worker subscribes to ``otel.topic`` as well; each of its records (a Collector Kafka-exporter payload) is
expanded by :func:`connectors.otel_records.expand_otel_records` into native trace/feedback events before
step 1, so they take exactly the path above (same parser, hashing, de-duplication, commit); refused
payloads and spans are dead letters, spans that are not GenAI inference are counted.

Prometheus metrics: ``hourglass_ingest_rows_stored_total{kind="trace"|"feedback"}`` (stored rows),
``hourglass_dead_letters_total{reason}``, ``hourglass_ingest_storage_ok`` (1/0),
``hourglass_otel_spans_skipped_total{reason}`` (OTel spans that are not GenAI inference: ``not_genai``,
``not_inference``, ``failed_call``).

Broker restarts, timeouts and rebalances do not crash the worker: the
consumer is closed and re-created with exponential backoff (tenacity). Run
it in the foreground (``hourglass ingest``) or in a thread::

    worker = IngestWorker(cfg.kafka, cfg.buffer, otel=cfg.otel)
    stop = threading.Event()
    threading.Thread(target=worker.run, args=(stop,)).start()
    ...
    stop.set()   # finishes the current batch, commits, leaves the group
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import CommitFailedError, KafkaError, RebalanceInProgressError
from kafka.structs import OffsetAndMetadata
from prometheus_client import Counter, Gauge
from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential

from connectors.buffer import RewardBuffer
from connectors.config import BufferConfig, KafkaConfig
from connectors.dead_letter import DeadLetterStore
from connectors.errors import BrokerUnavailableError, BufferStorageError
from connectors.kafka_admin import ensure_topics
from connectors.fast_parse import ParsedBatch, UndecodableRecord, parse_batch
from connectors.otel import OtelSourceConfig
from connectors.otel_records import expand_otel_records
from connectors.schema import UNMATCHED_FEEDBACK, TsWindow, UserHasher

log = logging.getLogger(__name__)

RECORDS = Counter(
    "hourglass_ingest_rows_stored", "Rows stored in the reward buffer, by kind (trace, feedback).", ["kind"]
)
DEAD_LETTERS = Counter("hourglass_dead_letters", "Records sent to the dead-letter store, by reason code.", ["reason"])
STORAGE_OK = Gauge(
    "hourglass_ingest_storage_ok", "1 while the ingest worker can write the buffer, 0 while it retries a failed write."
)
STORAGE_OK.set(1)
OTEL_SPANS_SKIPPED = Counter(
    "hourglass_otel_spans_skipped",
    "OpenTelemetry spans read from otel.topic that are not a GenAI inference call, by reason "
    "(not_genai, not_inference, failed_call).",
    ["reason"],
)

_INFLIGHT_POLL_MS = 10  # longest poll wait while a batch is being stored or its commit is unanswered


@dataclass(frozen=True)
class IngestStats:
    """Counters of one worker since it started (records, not bytes)."""

    traces: int = 0
    feedback: int = 0
    dead_letters: int = 0
    fast_parsed: int = 0  # records the msgspec fast path accepted (the rest went through pydantic)
    batches: int = 0
    commits: int = 0  # offset commits the broker acknowledged
    commit_failures: int = 0
    reconnects: int = 0
    unmatched_feedback: int = 0
    otel_records: int = 0  # records of otel.topic read (each a Collector payload of any number of spans)
    otel_spans_skipped: int = 0  # OTel spans that are not GenAI inference (see OTEL_SPANS_SKIPPED)
    lag_records: int | None = None  # sum over assigned partitions of high watermark - position
    first_record_unix_s: float | None = None  # wall time the first batch arrived (throughput baselines)
    last_commit_unix_s: float | None = None

    def as_metrics(self) -> dict[str, float]:
        """Namespaced metric dict (``ingest/traces``, ``ingest/lag_records``, ...); None values left out."""
        return {f"ingest/{k}": float(v) for k, v in asdict(self).items() if v is not None}


class IngestWorker:
    """One member of the ingest consumer group (see module doc for the guarantee)."""

    def __init__(
        self,
        kafka: KafkaConfig,
        buffer: BufferConfig,
        *,
        writer_id: str | None = None,
        otel: OtelSourceConfig | None = None,
    ) -> None:
        """``otel``: also read OpenTelemetry GenAI spans from ``otel.topic`` (None: native topics only)."""
        self.kafka = kafka
        self.otel = otel
        self.writer_id = writer_id or uuid.uuid4().hex[:8]
        self.buffer = RewardBuffer(buffer, self.writer_id)
        self.buffer.warm_up()  # pyarrow's lazy imports now, not in the first batch's commit latency
        self.dead_letters = DeadLetterStore(buffer.dead_letter_root, self.writer_id)
        self.maintenance_interval_s = buffer.maintenance_interval_s
        self._hasher = UserHasher(buffer.user_hash_key.get_secret_value(), buffer.user_id_keys)
        self._stats = IngestStats()
        self._lock = threading.Lock()
        self._positions: dict[TopicPartition, int] = {}
        # Commit state of the current session (reset by _session; consumer thread only).
        self._sent: dict[TopicPartition, int] = {}  # newest offset sent for commit, per partition
        self._retry: dict[TopicPartition, OffsetAndMetadata] = {}  # commits that failed retriably
        self._commits_unacked = 0
        self._commit_error: Exception | None = None
        self._health: dict[str, Any] = {
            "storage_ok": True,
            "last_error": None,
            "last_error_unix_s": None,
            "storage_failures": 0,
        }

    def health(self) -> dict[str, Any]:
        """The worker's condition, for a readiness probe (thread-safe copy).

        Returns:
            ``{"storage_ok": bool, "last_error": str | None, "last_error_unix_s": float | None,
            "storage_failures": int, "last_commit_unix_s": float | None, "lag_records": int | None}``.
            ``storage_ok`` is False while a batch the buffer or dead-letter store could not write
            (full disk, permissions) is being retried; ``storage_failures`` counts the consecutive
            failed attempts (0 once a write succeeds). ``last_error`` is the latest storage or
            maintenance error (kept after recovery, for the operator).
        """
        with self._lock:
            return {
                **self._health,
                "last_commit_unix_s": self._stats.last_commit_unix_s,
                "lag_records": self._stats.lag_records,
            }

    def _set_health(self, **fields: Any) -> None:
        with self._lock:
            self._health.update(fields)
        if "storage_ok" in fields:
            STORAGE_OK.set(1 if fields["storage_ok"] else 0)

    def stats(self) -> IngestStats:
        """A copy of the counters (thread-safe)."""
        with self._lock:
            return self._stats

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._stats = replace(self._stats, **{k: getattr(self._stats, k) + v for k, v in deltas.items()})

    # --- lifecycle -----------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Consume until ``stop`` is set; reconnects with backoff on broker errors, retries storage errors
        with backoff (see :meth:`health`); returns when ``stop`` is set.

        Raises:
            KafkaError / BrokerUnavailableError: a non-retriable broker error (after the retries).
        """
        retrying = Retrying(
            retry=retry_if_exception_type((KafkaError, ConnectionError, TimeoutError)),  # not storage errors
            wait=wait_exponential(multiplier=0.5, max=30),
            stop=lambda _state: stop.is_set(),
            sleep=_sleeper(stop),
            before_sleep=self._on_retry,
            reraise=True,
        )
        try:
            retrying(self._session, stop)
        except (KafkaError, BrokerUnavailableError, BufferStorageError) as err:
            if not stop.is_set():
                raise
            log.info("stopping with an error pending (uncommitted records are redelivered): %s", err)
        finally:
            try:  # a summary only: its failure (full disk) must never hide the error that ends the run
                self.buffer.write_manifest()
            except (OSError, ValueError) as err:
                log.warning("could not update the buffer manifest at shutdown: %s", err)

    def _on_retry(self, state: RetryCallState) -> None:
        self._count(reconnects=1)
        error = state.outcome.exception() if state.outcome is not None else None
        log.warning("ingest session failed (%s); reconnecting in %.1fs", error, state.upcoming_sleep)

    def _session(self, stop: threading.Event) -> None:
        # The consumer thread (this one) polls, parses and commits; one store thread writes
        # batches durably, so storage (fsync) overlaps the next fetches. Commits are sent from here,
        # in batch order, only after the batch's store future has succeeded; their acknowledgements
        # come back as callbacks inside later polls.
        # Shutdown order: 1. stop polling, 2. hand over the records in hand, 3. wait for every
        # store to finish and commit it, 4. wait for the broker to acknowledge every commit,
        # 5. close the consumer without auto-commit (leaves the group).
        # On a broker error, batches not yet committed are redelivered later (the buffer de-duplicates).
        ensure_topics(self.kafka, self._topics())
        consumer = self._consumer()
        self._sent, self._retry, self._commits_unacked, self._commit_error = {}, {}, 0, None
        k = self.kafka
        inflight: deque[tuple[Future[None], dict[TopicPartition, OffsetAndMetadata]]] = deque()
        store = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-store")
        try:
            next_maintenance = time.monotonic() + self.maintenance_interval_s
            pending: dict[TopicPartition, list[Any]] = {}
            count, deadline = 0, 0.0
            while not stop.is_set():
                # Fill a batch over several polls, up to batch_max_records or batch_timeout_ms
                # after its first record: one fsync'd segment and one offset commit per batch.
                # Every poll asks for a full batch (small polls cost kafka-python more per record);
                # records past batch_max_records wait in `pending` for the next batch.
                wait_ms = max(1, int((deadline - time.monotonic()) * 1000)) if count else k.batch_timeout_ms
                if inflight or self._commits_unacked:  # commit / see its ack soon, not a silent batch_timeout_ms later
                    wait_ms = min(wait_ms, _INFLIGHT_POLL_MS)
                _backpressure(
                    consumer, paused=len(inflight) >= _MAX_INFLIGHT
                )  # the store is behind (slow or full disk)
                polled = self._poll(consumer, wait_ms, k.batch_max_records)
                for tp, records in polled.items():
                    if not count:
                        deadline = time.monotonic() + k.batch_timeout_ms / 1000
                        if self._stats.first_record_unix_s is None:
                            with self._lock:
                                self._stats = replace(self._stats, first_record_unix_s=time.time())
                    pending.setdefault(tp, []).extend(records)
                    count += len(records)
                    self._positions[tp] = records[-1].offset + 1
                if (
                    count
                    and len(inflight) < _MAX_INFLIGHT
                    and (count >= k.batch_max_records or time.monotonic() >= deadline)
                ):
                    batch, pending = _split_batch(pending, k.batch_max_records)
                    inflight.append((store.submit(self._store, self._parse(batch), stop), _next_offsets(batch)))
                    count = sum(len(records) for records in pending.values())
                    deadline = time.monotonic() + k.batch_timeout_ms / 1000  # for the records left over
                self._commit_done(consumer, inflight, block=len(inflight) >= _MAX_INFLIGHT)
                self._update_lag(consumer)
                if time.monotonic() >= next_maintenance:
                    self._maintain_safely()
                    next_maintenance = time.monotonic() + self.maintenance_interval_s
            if pending:
                inflight.append((store.submit(self._store, self._parse(pending), stop), _next_offsets(pending)))
            while inflight:
                self._commit_done(consumer, inflight, block=True)
            self._settle_commits(consumer)
        finally:
            store.shutdown(wait=True)
            consumer.close(autocommit=False)

    def _commit_done(self, consumer: KafkaConsumer, inflight: deque[Any], block: bool) -> None:
        """Commit the offsets of stored batches, oldest first; re-raises a store's storage error and a
        commit's non-retriable error; retries a retriable failed commit (synchronously)."""
        if self._commit_error is not None:
            err, self._commit_error = self._commit_error, None
            raise err
        if self._retry:
            # Only partitions that no newer commit has been sent for: sending an older offset after a
            # newer one would move the group's position back.
            retry = {tp: meta for tp, meta in self._retry.items() if self._sent.get(tp) == meta.offset}
            self._retry = {}
            if retry:
                self._commit_sync(consumer, retry)
        while inflight and (inflight[0][0].done() or block):
            future, offsets = inflight[0]
            if not wait_futures([future], timeout=_BLOCK_WAIT_S).done:
                return  # still storing (or retrying a full disk): poll again, keeping the group session alive
            inflight.popleft()
            future.result()  # a store that gave up (only when stopping) propagates: nothing of this batch is committed
            self._commit(consumer, offsets)
            block = False

    def _consumer(self) -> KafkaConsumer:
        k = self.kafka
        consumer = KafkaConsumer(
            bootstrap_servers=k.bootstrap_servers,
            group_id=k.group_id,
            client_id=f"hourglass-ingest-{self.writer_id}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=k.session_timeout_ms,
            heartbeat_interval_ms=k.heartbeat_interval_ms,
            request_timeout_ms=max(k.request_timeout_ms, k.session_timeout_ms + 5000),
            **fetch_settings(k),
        )
        consumer.subscribe(self._topics())
        return consumer

    def _topics(self) -> list[str]:
        """The topics this worker reads: traces, feedback, and ``otel.topic`` when configured."""
        topics = [self.kafka.traces_topic, self.kafka.feedback_topic]
        if self.otel is not None and self.otel.topic not in topics:
            topics.append(self.otel.topic)
        return topics

    # --- one batch -------------------------------------------------------------------

    def _poll(self, consumer: KafkaConsumer, wait_ms: int, max_records: int) -> dict[TopicPartition, list[Any]]:
        """``consumer.poll``; a record kafka-python cannot decode comes back as an :class:`UndecodableRecord`
        (and the consumer seeks past it), instead of an error that would end the session every time."""
        try:
            return consumer.poll(timeout_ms=wait_ms, max_records=max_records)
        except Exception as err:
            where = _undecodable_at(err)
            if where is None:
                raise
            tp, offset = where
            log.error(
                "record %s:%d at offset %d cannot be decoded (%s: %s); dead-lettering it and seeking past it",
                tp.topic,
                tp.partition,
                offset,
                type(err).__name__,
                err,
            )
            consumer.seek(tp, offset + 1)
            return {tp: [UndecodableRecord(tp.topic, tp.partition, offset, f"{type(err).__name__}: {str(err)[:300]}")]}

    def _parse(self, polled: dict[TopicPartition, list[Any]]) -> ParsedBatch:
        """Parse one batch (consumer thread: pure-Python CPU work gains nothing from another thread
        under the GIL, and a CPU-bound store thread would delay this thread's socket wake-ups)."""
        cfg = self.buffer.cfg
        records: list[Any] = list(itertools.chain.from_iterable(polled.values()))
        expansion = None
        if self.otel is not None:  # OTel payloads -> native event records (same parser below), letters, skips
            expansion = expand_otel_records(
                records, self.otel, self._hasher, passthrough=lambda record: isinstance(record, UndecodableRecord)
            )
            records = expansion.records
        batch = parse_batch(
            records,
            max_record_bytes=self.kafka.max_record_bytes,
            hasher=self._hasher,
            window=TsWindow.around(datetime.now(timezone.utc), cfg.event_age_limit_s, cfg.max_clock_skew_s),
            max_correction_chars=cfg.max_correction_chars,
        )
        if expansion is not None:
            batch.dead_letters.extend(expansion.dead_letters)
            batch.skipped.update(expansion.skipped)
            batch.otel_records += expansion.otel_records
        return batch

    def _store(self, batch: ParsedBatch, stop: threading.Event) -> None:
        """Write one parsed batch durably: dead letters, then buffer segments (store thread; fsync releases the GIL).

        A :class:`BufferStorageError` (full disk...) is retried with exponential backoff up to
        ``buffer.storage_retry_max_s`` between attempts, until it succeeds or ``stop`` is set (then it is
        raised and nothing of the batch is committed).
        """
        now = datetime.now(timezone.utc)
        traces, feedback = batch.tables(now)  # may add dead letters (rows Arrow refuses)
        letters_written = False

        def write() -> None:
            nonlocal letters_written
            if not letters_written:
                self.dead_letters.write(batch.dead_letters, now)  # durable before the commit
                letters_written = True
            self.buffer.write_tables(traces, feedback, now)  # durable before the commit

        retrying = Retrying(
            retry=retry_if_exception_type(BufferStorageError),
            wait=wait_exponential(multiplier=0.5, max=self.buffer.cfg.storage_retry_max_s),
            stop=lambda _state: stop.is_set(),
            sleep=_sleeper(stop),
            before_sleep=self._on_storage_retry,
            reraise=True,
        )
        retrying(write)
        if not self._health["storage_ok"] or self._health["storage_failures"]:
            log.info("storage recovered: the batch is stored")
            self._set_health(storage_ok=True, storage_failures=0)
        self._count(
            traces=traces.num_rows,
            feedback=feedback.num_rows,
            dead_letters=len(batch.dead_letters),
            batches=1,
            fast_parsed=batch.fast,
            otel_records=batch.otel_records,
            otel_spans_skipped=sum(batch.skipped.values()),
        )
        RECORDS.labels("trace").inc(traces.num_rows)
        RECORDS.labels("feedback").inc(feedback.num_rows)
        for reason, n in Tally(letter.reason for letter in batch.dead_letters).items():
            DEAD_LETTERS.labels(reason).inc(n)
        for reason, n in batch.skipped.items():
            OTEL_SPANS_SKIPPED.labels(reason).inc(n)

    def _on_storage_retry(self, state: RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome is not None else None
        self._set_health(
            storage_ok=False,
            last_error=f"{type(err).__name__}: {err}",
            last_error_unix_s=time.time(),
            storage_failures=state.attempt_number,
        )
        log.warning(
            "could not store a batch (attempt %d: %s); nothing is committed, retrying in %.1fs",
            state.attempt_number,
            err,
            state.upcoming_sleep,
        )

    def _commit(self, consumer: KafkaConsumer, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        """Send the commit of a stored batch's offsets; the broker's answer comes to :meth:`_on_commit`."""
        consumer.commit_async(offsets, callback=self._on_commit)  # the callback runs in a later poll, never in here
        self._sent.update((tp, meta.offset) for tp, meta in offsets.items())
        self._commits_unacked += 1

    def _on_commit(self, offsets: dict[TopicPartition, OffsetAndMetadata], response: Any) -> None:
        """kafka-python's commit callback: runs on the consumer thread, inside a later poll or commit."""
        self._commits_unacked -= 1
        if not isinstance(response, Exception):
            self._committed()
        elif isinstance(response, (CommitFailedError, RebalanceInProgressError)):
            self._lost_to_rebalance(response)
        elif getattr(response, "retriable", False):  # coordinator moved, timeout: try again (synchronously)
            log.info("offset commit failed (%s); retrying", response)
            self._retry.update(offsets)
        else:
            self._commit_error = response  # raised on the consumer thread: the session restarts

    def _commit_sync(self, consumer: KafkaConsumer, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        """Commit and wait for the broker (kafka-python retries retriable errors until its request timeout)."""
        try:
            consumer.commit(offsets)
        except (CommitFailedError, RebalanceInProgressError) as err:
            self._lost_to_rebalance(err)
            return
        self._committed()

    def _settle_commits(self, consumer: KafkaConsumer) -> None:
        """Wait until every commit sent is acknowledged: commit the newest sent offsets of the assigned
        partitions once more, synchronously (same values; the coordinator answers requests in order)."""
        if self._commit_error is not None:
            err, self._commit_error = self._commit_error, None
            raise err
        if self._commits_unacked or self._retry:
            self._retry = {}
            assigned = consumer.assignment()
            newest = {tp: OffsetAndMetadata(offset, "", -1) for tp, offset in self._sent.items() if tp in assigned}
            if newest:
                self._commit_sync(consumer, newest)

    def _committed(self) -> None:
        self._count(commits=1)
        with self._lock:
            self._stats = replace(self._stats, last_commit_unix_s=time.time())

    def _lost_to_rebalance(self, err: Exception) -> None:
        # The partitions moved to another member: it re-reads these records, the buffer de-duplicates.
        self._count(commit_failures=1)
        log.warning("offset commit lost to a rebalance (records are durable, will be redelivered): %s", err)

    def _update_lag(self, consumer: KafkaConsumer) -> None:
        lag = 0
        known = False
        for tp in consumer.assignment():
            high = consumer.highwater(tp)  # from the last fetch response; no extra request
            if high is None:
                continue
            known = True
            lag += max(0, high - self._positions.get(tp, high))
        with self._lock:
            self._stats = replace(self._stats, lag_records=lag if known else self._stats.lag_records)

    def maintain(self, now: datetime | None = None) -> None:
        """Dead-letter unmatched feedback past its window, then apply retention.

        Raises:
            BufferStorageError: the dead letters or the manifest could not be written.
        """
        now = now or datetime.now(timezone.utc)
        unmatched = self.buffer.sweep_unmatched_feedback(self.dead_letters, now)
        self._count(unmatched_feedback=unmatched, dead_letters=unmatched)
        if unmatched:
            DEAD_LETTERS.labels(UNMATCHED_FEEDBACK).inc(unmatched)
        self.buffer.apply_retention(now)  # logs and counts what it deletes; never raises

    def _maintain_safely(self) -> None:
        """:meth:`maintain` from the consume loop: a failure is logged and kept in :meth:`health`, then the
        next pass tries again (the sweep repeats, never loses); it never ends the session."""
        try:
            self.maintain()
        except Exception as err:  # noqa: BLE001 - maintenance must never stop ingestion
            log.warning("maintenance pass failed (%s: %s); retrying at the next interval", type(err).__name__, err)
            self._set_health(last_error=f"maintenance: {type(err).__name__}: {err}", last_error_unix_s=time.time())


_MAX_INFLIGHT = 2  # batches being stored at once; more waits (fetching paused)
_BLOCK_WAIT_S = 1.0  # longest wait for a store before polling again (keeps the consumer's group session alive)


def _backpressure(consumer: KafkaConsumer, paused: bool) -> None:
    """Pause fetching every assigned partition while the store is behind; resume when it catches up."""
    if paused:
        assigned = consumer.assignment()
        if assigned and consumer.paused() != assigned:
            consumer.pause(*assigned)
    elif consumer.paused():
        consumer.resume(*consumer.paused())


def _undecodable_at(err: BaseException) -> tuple[TopicPartition, int] | None:
    """(partition, offset) of the record kafka-python failed to decode, when ``err`` was raised while it
    unpacked fetched records (``Fetcher.PartitionRecords._unpack_records``: a codec whose library is
    missing, a corrupt batch, a decompressor error); None for any other error."""
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "_unpack_records" and "kafka" in frame.f_code.co_filename:
            part = frame.f_locals.get("self")
            tp, offset = getattr(part, "topic_partition", None), getattr(part, "next_fetch_offset", None)
            if isinstance(tp, TopicPartition) and isinstance(offset, int):
                return tp, offset
        tb = tb.tb_next
    return None


def fetch_settings(k: KafkaConfig) -> dict[str, int]:
    """Throughput settings of the ingest consumer (kafka-python ``KafkaConsumer`` keyword arguments).

    Exposed so a baseline consumer (``bench/ingest.py``) can fetch exactly the same way.
    """
    return {
        "max_poll_records": k.batch_max_records,
        "max_partition_fetch_bytes": max(1_048_576, 2 * k.max_record_bytes),  # a max-size record always fits
        "fetch_max_bytes": max(52_428_800, 4 * k.max_record_bytes),
    }


def _split_batch(
    pending: dict[TopicPartition, list[Any]], max_records: int
) -> tuple[dict[TopicPartition, list[Any]], dict[TopicPartition, list[Any]]]:
    """(the first ``max_records`` records, the rest), in arrival order per partition.

    The rest of a partition always has later offsets than its part in the batch, so committing
    batches in order never moves a partition's committed offset past a record not yet stored.
    """
    batch: dict[TopicPartition, list[Any]] = {}
    rest: dict[TopicPartition, list[Any]] = {}
    room = max_records
    for tp, records in pending.items():
        take = records[:room]
        if take:
            batch[tp] = take
        if len(take) < len(records):
            rest[tp] = records[len(take) :]
        room -= len(take)
    return batch, rest


def _next_offsets(polled: dict[TopicPartition, list[Any]]) -> dict[TopicPartition, OffsetAndMetadata]:
    """The offsets to commit once a batch is stored: last offset + 1 per partition."""
    return {tp: OffsetAndMetadata(records[-1].offset + 1, "", -1) for tp, records in polled.items()}


def _sleeper(stop: threading.Event) -> Callable[[float], None]:
    """tenacity's ``sleep``: waits on ``stop``, so a stop request cuts a back-off short."""

    def sleep(seconds: float) -> None:
        stop.wait(seconds)

    return sleep
