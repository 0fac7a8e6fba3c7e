"""Kafka sink: publish trace and feedback events with delivery confirmation.

:class:`TraceSink` wraps a ``kafka-python`` producer with ``acks="all"``:
a record counts as sent only when every in-sync replica has it.

How the gateway uses it (non-blocking)::

    sink = TraceSink(cfg.kafka)
    sink.send_trace(event, on_done=lambda err: ...)  # returns at once; err is None on success
    sink.send_feedback(feedback)
    ...
    sink.flush()   # blocks until every record is acknowledged; raises DeliveryError if any failed
    sink.close()

Failures are never silent: a failed record calls ``on_done(err)``, is counted
in ``sink.failed``, and makes the next :meth:`TraceSink.flush` raise.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from kafka import KafkaProducer
from kafka.errors import KafkaError

from connectors.config import KafkaConfig
from connectors.errors import BrokerUnavailableError, DeliveryError, ReplayError
from connectors.schema import FeedbackEvent, TraceEvent

DoneCallback = Callable[[Exception | None], None]


class TraceSink:
    """Producer of trace/feedback events (key = ``trace_id``, value = UTF-8 JSON)."""

    def __init__(self, cfg: KafkaConfig, **producer_overrides: object) -> None:
        """Raises BrokerUnavailableError when no bootstrap server answers."""
        self.cfg = cfg
        self.sent = 0
        self.acked = 0
        self.failed = 0
        self._errors: list[Exception] = []
        self._lock = threading.Lock()
        try:
            self._producer = KafkaProducer(
                bootstrap_servers=cfg.bootstrap_servers,
                acks="all",
                retries=5,
                linger_ms=5,
                max_in_flight_requests_per_connection=1,  # keep per-partition order across retries
                request_timeout_ms=cfg.request_timeout_ms,
                max_request_size=max(cfg.max_record_bytes * 2, 1_048_576),
                **producer_overrides,
            )
        except KafkaError as err:  # kafka-python 3 raises KafkaTimeoutError when it cannot bootstrap
            raise BrokerUnavailableError(f"no Kafka broker reachable at {cfg.bootstrap_servers}: {err}") from err

    def send_raw(self, topic: str, value: bytes, key: bytes | None = None, on_done: DoneCallback | None = None) -> None:
        """Queue one record; returns at once. ``on_done(None)`` after the broker acks, ``on_done(err)`` on failure."""

        def ok(_metadata: object) -> None:
            with self._lock:
                self.acked += 1
            if on_done is not None:
                on_done(None)

        def failed(err: Exception) -> None:
            with self._lock:
                self.failed += 1
                self._errors.append(err)
            if on_done is not None:
                on_done(err)

        try:
            future = self._producer.send(topic, value=value, key=key)
        except KafkaError as err:
            failed(err)
            return
        self.sent += 1
        future.add_callback(ok)
        future.add_errback(failed)

    def send_trace(self, event: TraceEvent, on_done: DoneCallback | None = None) -> None:
        """Queue a trace event on ``cfg.traces_topic`` (non-blocking)."""
        self.send_raw(self.cfg.traces_topic, event.to_json_bytes(), event.trace_id.encode(), on_done)

    def send_feedback(self, event: FeedbackEvent, on_done: DoneCallback | None = None) -> None:
        """Queue a feedback event on ``cfg.feedback_topic`` (non-blocking)."""
        self.send_raw(self.cfg.feedback_topic, event.to_json_bytes(), event.trace_id.encode(), on_done)

    def flush(self, timeout_s: float | None = 60.0) -> int:
        """Block until all queued records are acknowledged; returns how many are acknowledged so far.

        Raises:
            DeliveryError: some record failed (message names the first error) or the flush timed out.
        """
        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaError as err:
            raise DeliveryError(f"flush did not finish within {timeout_s}s: {err}; is the broker up?") from err
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise DeliveryError(
                f"{len(errors)} record(s) were not acknowledged by the broker; first error: {errors[0]!r}"
            )
        return self.acked

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush what is queued (without raising) and close the producer."""
        self._producer.close(timeout=timeout_s)

    def __enter__(self) -> "TraceSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def produce_events(sink: TraceSink, events: Iterable[TraceEvent | FeedbackEvent], topic: str | None = None) -> int:
    """Send events (to their default topic, or ``topic``) and flush; returns how many were acknowledged."""
    start = sink.acked
    for event in events:
        key = event.trace_id.encode()
        default = sink.cfg.traces_topic if isinstance(event, TraceEvent) else sink.cfg.feedback_topic
        sink.send_raw(topic or default, event.to_json_bytes(), key)
    sink.flush()
    return sink.acked - start


def produce_jsonl(cfg: KafkaConfig, topic: str, path: str | Path) -> int:
    """Backfill: send every line of a JSON-lines file to ``topic`` as is (key = its ``trace_id`` when present).

    Lines are sent verbatim, so the consumer validates them and dead-letters
    bad ones with their coordinates (nothing is dropped here). Blank lines are skipped.

    Returns:
        The number of records the broker acknowledged.

    Raises:
        ReplayError: the file cannot be read. DeliveryError: a record was not acknowledged.
    """
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as err:
        raise ReplayError(f"cannot read {str(path)!r}: {err}") from err
    with TraceSink(cfg) as sink:
        for line in lines:
            if not line.strip():
                continue
            sink.send_raw(topic, line, _key_of(line))
        return sink.flush()


def _key_of(line: bytes) -> bytes | None:
    """The record key (its ``trace_id``), or None when the line has no usable one.

    A line that is not JSON, or whose ``trace_id`` cannot be encoded (a lone
    surrogate), is still sent, keyless: the consumer dead-letters it with the reason.
    """
    try:
        trace_id = json.loads(line).get("trace_id")
        return trace_id.encode() if isinstance(trace_id, str) else None
    except (ValueError, AttributeError, RecursionError):  # UnicodeEncodeError is a ValueError; RecursionError:
        return None  # nested deeper than the parser allows (the consumer dead-letters it as nesting_too_deep)
