"""Off-request-path publishing of gateway events to Kafka.

:class:`EventPublisher` owns one background thread and a bounded queue. The
request path only calls :meth:`EventPublisher.publish_trace` (a
``queue.put_nowait``), so a slow or unreachable broker never slows or fails a
client request: the thread (re)creates the :class:`~connectors.sink.TraceSink`
when needed and hands events to it; every failure is logged and counted in
``hourglass_gateway_trace_errors_total``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from prometheus_client import Counter

from connectors.config import KafkaConfig
from connectors.errors import ConnectorError
from connectors.schema import FeedbackEvent, TraceEvent
from connectors.sink import DoneCallback, TraceSink

log = logging.getLogger(__name__)

TRACE_ERRORS = Counter(
    "hourglass_gateway_trace_errors",
    "Trace/feedback events the gateway could not publish (queue full, broker unreachable, not acknowledged).",
)
TRACES_PUBLISHED = Counter("hourglass_gateway_traces_acked", "Trace events acknowledged by the broker.")

_Item = tuple[TraceEvent | FeedbackEvent, DoneCallback | None]


class EventPublisher:
    """Background publisher of trace and feedback events (one thread, bounded queue).

    Args:
        kafka: where to publish (topics ``kafka.traces_topic`` / ``kafka.feedback_topic``).
        sink: an existing sink to use (the caller keeps ownership); None = create one in the thread.
        max_queue: events waiting at most; more are dropped and counted as errors.
        reconnect_s: after a failed sink creation, wait this long (seconds) before trying again;
            events arriving meanwhile fail at once (counted), so the queue does not back up.
        connect_timeout_s: how long creating the sink may wait for a broker (kafka-python
            ``bootstrap_timeout_ms``), seconds.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        sink: TraceSink | None = None,
        *,
        max_queue: int = 10_000,
        reconnect_s: float = 5.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.kafka = kafka
        self._sink = sink
        self._owns_sink = sink is None
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=max_queue)
        self._reconnect_s = reconnect_s
        self._connect_timeout_ms = int(connect_timeout_s * 1000)
        self._next_connect = 0.0
        self._thread = threading.Thread(target=self._run, name="gateway-publisher", daemon=True)
        self._thread.start()

    # --- request path (non-blocking) ---------------------------------------------------

    def publish_trace(self, event: TraceEvent) -> None:
        """Queue a trace event; returns at once. Failures are logged and counted, never raised."""
        self._put((event, None))

    def publish_feedback(self, event: FeedbackEvent, on_done: DoneCallback) -> None:
        """Queue a feedback event; ``on_done(err)`` is called from another thread once the broker answers."""
        self._put((event, on_done))

    def _put(self, item: _Item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            err = ConnectorError(f"gateway publish queue is full ({self._queue.maxsize} events); event dropped")
            self._failed(item[0], err, item[1])

    # --- publisher thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # the stop marker
                return
            event, on_done = item
            sink = self._ensure_sink()
            if sink is None:
                self._failed(
                    event, ConnectorError(f"no Kafka broker reachable at {self.kafka.bootstrap_servers}"), on_done
                )
                continue
            done = self._done_callback(event, on_done)
            try:
                if isinstance(event, TraceEvent):
                    sink.send_trace(event, on_done=done)
                else:
                    sink.send_feedback(event, on_done=done)
            except Exception as err:  # noqa: BLE001 - a sink bug must not kill the thread
                done(err)

    def _ensure_sink(self) -> TraceSink | None:
        if self._sink is not None:
            return self._sink
        if time.monotonic() < self._next_connect:
            return None
        try:
            self._sink = TraceSink(self.kafka, bootstrap_timeout_ms=self._connect_timeout_ms)
        except Exception as err:  # noqa: BLE001 - BrokerUnavailableError, or anything kafka-python raises
            log.warning("gateway: cannot create the Kafka sink (%s); retrying in %.0f s", err, self._reconnect_s)
            self._next_connect = time.monotonic() + self._reconnect_s
            return None
        return self._sink

    def _done_callback(self, event: TraceEvent | FeedbackEvent, on_done: DoneCallback | None) -> DoneCallback:
        def done(err: Exception | None) -> None:
            if err is not None:
                self._failed(event, err, on_done)
                return
            if isinstance(event, TraceEvent):
                TRACES_PUBLISHED.inc()
            if on_done is not None:
                on_done(None)

        return done

    @staticmethod
    def _failed(
        event: TraceEvent | FeedbackEvent, err: Exception, on_done: Callable[[Exception | None], None] | None
    ) -> None:
        TRACE_ERRORS.inc()
        log.error("gateway: %s %s not published: %s", type(event).__name__, event.trace_id, err)
        if on_done is not None:
            on_done(err)

    # --- shutdown ----------------------------------------------------------------------

    def close(self, timeout_s: float = 30.0) -> None:
        """Shutdown order: 1. stop taking events (the stop marker queues behind those waiting),
        2. the thread hands every waiting event to the sink, 3. an owned sink is flushed and closed."""
        self._queue.put(None)  # the stop marker
        self._thread.join(timeout=timeout_s)
        if self._owns_sink and self._sink is not None:
            self._sink.close(timeout_s=timeout_s)
