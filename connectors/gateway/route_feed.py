"""Routes over Kafka: the serving controller publishes, every gateway follows.

Topic ``kafka.routes_topic`` (default ``hourglass.routes``; created by
:func:`connectors.kafka_admin.ensure_routes_topic`: one partition,
``cleanup.policy=compact``). One record per route change: key = the public
model name (UTF-8), value = the route as a JSON object (the fields of
``Route`` in the routes contract: ``served_name``, ``version``,
``updated_at``, ``challenger_served_name``, ``challenger_version``,
``fraction``); a null value (tombstone) removes the model's route.

A gateway's :class:`RouteFollower` reads the topic from the beginning (no
consumer group: every gateway reads everything) and keeps the last value per
key, which is what compaction keeps, so a gateway that starts late still
learns the current routes; it then follows new records as they come
(``poll`` every ``poll_ms``, well under a second). A record whose value is not
a valid route for its key (:func:`connectors.gateway.routes.route_from_dict`:
field types, ``fraction`` in [0, 1], served names ``<model>-v<version>``) is
skipped, logged with the reason and counted
(``hourglass_gateway_route_records_refused_total``); the model keeps its last
good route. A broker outage keeps the last known routes and reconnects.

Authentication: with ``kafka.routes_signing_key`` set, the publisher adds the
header ``hourglass-route-sig`` to every record, the HMAC-SHA256 (RFC 2104; URL-safe base64, under the
key derived for route records: :mod:`connectors.signing`) of :func:`route_signing_payload` (topic, key,
value; a tombstone signs as
such), and every follower skips, logs (reason ``unsigned`` or ``bad
signature``) and counts a record or tombstone without a valid one: the model
keeps its route. Unset, records are neither signed nor checked.

Tansu (the embedded broker) accepts ``cleanup.policy=compact`` at creation but
reports no topic configs back, so it presumably keeps every record: the topic
then grows by one record per route change, and reading it from the beginning
still ends at the newest route per model.

This module works on plain dicts; the routes contract turns them into
``Route`` objects.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from kafka.producer.future import FutureRecordMetadata
from prometheus_client import Counter

from connectors.signing import ROUTE_RECORD, BadSignature, Signer
from connectors.config import KafkaConfig
from connectors.errors import BrokerUnavailableError
from connectors.gateway.routes import RouteRecordError, route_from_dict

log = logging.getLogger(__name__)

REFUSED = Counter(
    "hourglass_gateway_route_records_refused",
    "Route records skipped: not a valid route for their key, or unsigned / badly signed while a routes key is set.",
)

SIGNATURE_HEADER = "hourglass-route-sig"
_PAYLOAD_TAG = b"hourglass-route-v1"


def route_signing_payload(topic: str, key: bytes, value: bytes | None) -> bytes:
    """The canonical bytes a route record's signature covers.

    ``tag | len(topic) topic | len(key) key | kind [len(value) value]``, lengths
    as 8-byte big-endian unsigned ints, ``kind`` = ``b"T"`` for a tombstone
    (``value`` None) else ``b"V"``: no two (topic, key, value) share a payload,
    and a signed route cannot be replayed as a tombstone or on another topic.
    """
    parts = [_PAYLOAD_TAG]
    for field in (topic.encode(), key):
        parts += [len(field).to_bytes(8, "big"), field]
    parts += [b"T"] if value is None else [b"V", len(value).to_bytes(8, "big"), value]
    return b"".join(parts)


def sign_route(secret: bytes, topic: str, key: bytes, value: bytes | None) -> bytes:
    """The header value: the signature of :func:`route_signing_payload` under ``secret`` (the project's signer,
    :mod:`connectors.signing`, purpose :data:`~connectors.signing.ROUTE_RECORD`; URL-safe base64, ASCII bytes)."""
    return Signer([secret], ROUTE_RECORD).sign(route_signing_payload(topic, key, value))


def route_signature_problem(
    secret: bytes, topic: str, key: bytes, value: bytes | None, headers: Sequence[tuple[str, bytes | None]] | None
) -> str | None:
    """Why a record's ``hourglass-route-sig`` header does not authenticate it (``"unsigned"`` or
    ``"bad signature"``), or None when it does (itsdangerous compares in constant time)."""
    sigs = [v for k, v in headers or () if k == SIGNATURE_HEADER]
    if not sigs or sigs[-1] is None:
        return "unsigned"
    try:
        Signer([secret], ROUTE_RECORD).verify(route_signing_payload(topic, key, value), sigs[-1])
    except BadSignature:
        return "bad signature"
    return None


class RoutePublisher:
    """Publishes routes to ``kafka.routes_topic`` (acks=all, flushed before :meth:`publish` returns)."""

    def __init__(self, kafka: KafkaConfig) -> None:
        self.kafka = kafka
        self._producer: KafkaProducer | None = None

    def publish(self, routes: dict[str, dict | None]) -> None:
        """Send ``{public model name: route dict, or None to remove it}``; returns once the broker acknowledged all.

        Raises:
            BrokerUnavailableError: the broker did not take them (the caller retries later).
        """
        if not routes:
            return
        try:
            if self._producer is None:
                self._producer = KafkaProducer(
                    bootstrap_servers=self.kafka.bootstrap_servers,
                    acks="all",
                    retries=3,
                    linger_ms=0,
                    max_in_flight_requests_per_connection=1,
                    request_timeout_ms=self.kafka.request_timeout_ms,
                    max_block_ms=self.kafka.request_timeout_ms,
                )
            futures = [
                self._send(model.encode(), None if route is None else json.dumps(route, sort_keys=True).encode())
                for model, route in sorted(routes.items())
            ]
            for future in futures:
                future.get(timeout=self.kafka.request_timeout_ms / 1000)
        except (KafkaError, OSError) as err:
            self.close()
            raise BrokerUnavailableError(
                f"could not publish routes {sorted(routes)} to {self.kafka.routes_topic!r} at {self.kafka.bootstrap_servers}: {err}"
            ) from err

    def _send(self, key: bytes, value: bytes | None) -> FutureRecordMetadata:
        """One record, signed when ``kafka.routes_signing_key`` is set; returns kafka-python's future."""
        assert self._producer is not None
        topic = self.kafka.routes_topic
        secret = self.kafka.routes_signing_key
        headers = (
            []
            if secret is None
            else [(SIGNATURE_HEADER, sign_route(secret.get_secret_value().encode(), topic, key, value))]
        )
        return self._producer.send(topic, key=key, value=value, headers=headers)

    def close(self) -> None:
        if self._producer is not None:
            try:
                self._producer.close(timeout=5)
            except Exception:  # closing a broken producer must not hide the error that broke it
                pass
            self._producer = None


class RouteFollower:
    """Follows ``kafka.routes_topic`` on a daemon thread; :meth:`routes` is the current ``{model: route dict}``.

    :meth:`ready` is set once the follower has read up to the end offsets it
    found at its start (or found no topic yet: no routes published), i.e. it
    holds the routes that were current when it started.
    """

    def __init__(self, kafka: KafkaConfig, *, poll_ms: int = 100, retry_s: float = 1.0) -> None:
        self.kafka = kafka
        self.poll_ms = poll_ms
        self.retry_s = retry_s
        self.ready = threading.Event()
        self._routes: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    def routes(self) -> dict[str, dict]:
        """A copy of the routes known now."""
        with self._lock:
            return dict(self._routes)

    def start(self, wait_s: float = 0.0) -> bool:
        """Start following; wait up to ``wait_s`` for :attr:`ready`. Returns whether it is ready."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="hourglass-route-follower", daemon=True)
            self._thread.start()
        return self.ready.wait(wait_s) if wait_s > 0 else self.ready.is_set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _apply(
        self, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]] | None = None
    ) -> None:
        """Apply one record (``headers``: the record's Kafka headers); a refused one is logged and counted."""
        try:
            model = (key or b"").decode()
        except UnicodeDecodeError:
            model = ""
        if not model:
            REFUSED.inc()
            log.warning("route record without a UTF-8 key skipped")
            return
        secret = self.kafka.routes_signing_key
        if secret is not None:
            try:
                unsigned = route_signature_problem(
                    secret.get_secret_value().encode(), self.kafka.routes_topic, key or b"", value, headers
                )
            except (TypeError, ValueError):  # a header value of the wrong type cannot be a valid signature
                unsigned = "bad signature"
            if unsigned is not None:
                REFUSED.inc()
                kind = "tombstone" if value is None else "record"
                log.warning("route %s for %r skipped (%s); keeping its current route", kind, model[:200], unsigned)
                return
        if value is None:
            with self._lock:
                self._routes.pop(model, None)
            return
        try:
            entry = json.loads(value)
            route_from_dict(entry, model)
        except (ValueError, RecursionError) as err:  # RouteRecordError and UnicodeDecodeError are ValueErrors
            REFUSED.inc()
            # the reason quotes the key: cap it, or one record with a 1 MiB key writes a 1 MiB log line
            why = str(err)[:300] if isinstance(err, RouteRecordError) else "not JSON, or nested too deep"
            log.warning("route record for %r skipped (%s): %r", model[:200], why, value[:200])
            return
        with self._lock:
            self._routes[model] = entry

    def _run(self) -> None:
        while not self._stop.is_set():
            consumer = None
            try:
                consumer = KafkaConsumer(
                    bootstrap_servers=self.kafka.bootstrap_servers,
                    group_id=None,
                    enable_auto_commit=False,
                    auto_offset_reset="earliest",
                    request_timeout_ms=self.kafka.request_timeout_ms,
                    client_id="hourglass-gateway-routes",
                )
                self._follow(consumer)
            except (KafkaError, OSError, AssertionError) as err:  # kafka-python asserts on some broken connections
                self.last_error = f"{type(err).__name__}: {err}"
                log.warning(
                    "routes topic %s: %s; keeping the last known routes, retrying", self.kafka.routes_topic, err
                )
                self._stop.wait(self.retry_s)
            except Exception as err:  # a bug must not end the thread silently: the gateway would never see a flip
                self.last_error = f"{type(err).__name__}: {err}"
                log.exception(
                    "routes topic %s: follower failed; keeping the last known routes, retrying", self.kafka.routes_topic
                )
                self._stop.wait(self.retry_s)
            finally:
                if consumer is not None:
                    try:
                        consumer.close(autocommit=False)
                    except Exception:
                        pass

    def _follow(self, consumer: KafkaConsumer) -> None:
        topic = self.kafka.routes_topic
        partitions = consumer.partitions_for_topic(topic)
        while not partitions:  # not created yet: nothing was ever published, so "no routes" is current
            self.ready.set()
            if self._stop.wait(self.retry_s):
                return
            consumer.topics()  # refresh metadata
            partitions = consumer.partitions_for_topic(topic)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        while not self._stop.is_set():
            batches = consumer.poll(timeout_ms=self.poll_ms)
            for records in batches.values():
                for record in records:
                    self._apply(record.key, record.value, record.headers)
            if not self.ready.is_set() and all(consumer.position(tp) >= ends[tp] for tp in tps):
                self.ready.set()
                self.last_error = None
