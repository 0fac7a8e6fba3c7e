"""Signed route records: with ``kafka.routes_signing_key`` set, a gateway applies only records (and tombstones)
the serving controller signed; a producer without the key cannot move gateways (real broker for the topic)."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable

import pytest
from kafka import KafkaProducer
from pydantic import SecretStr

from connectors.config import KafkaConfig
from connectors.gateway.route_feed import (
    REFUSED,
    SIGNATURE_HEADER,
    RouteFollower,
    RoutePublisher,
    route_signature_problem,
    sign_route,
)
from connectors.kafka_admin import ensure_routes_topic

KEY = "k" * 32
OTHER_KEY = "o" * 32
V1 = {"served_name": "hg-v1", "version": "1", "updated_at": "2026-01-01T00:00:00+00:00"}
V2 = {"served_name": "hg-v2", "version": "2", "updated_at": "2026-01-01T00:01:00+00:00"}
V3 = {"served_name": "hg-v3", "version": "3", "updated_at": "2026-01-01T00:02:00+00:00"}


def test_sign_and_verify_cover_topic_key_value_and_the_tombstone() -> None:
    value = json.dumps(V1).encode()
    sig = sign_route(KEY.encode(), "t", b"hg", value)
    assert len(base64.urlsafe_b64decode(sig + b"=")) == 32  # an HMAC-SHA256, URL-safe base64 (connectors.signing)
    assert route_signature_problem(KEY.encode(), "t", b"hg", value, [(SIGNATURE_HEADER, sig)]) is None
    assert route_signature_problem(KEY.encode(), "t", b"hg", value, []) == "unsigned"
    assert route_signature_problem(KEY.encode(), "t", b"hg", value, None) == "unsigned"
    assert route_signature_problem(KEY.encode(), "t", b"hg", value, [("other", sig)]) == "unsigned"
    wrong = [
        (OTHER_KEY.encode(), "t", b"hg", value),  # another key
        (KEY.encode(), "u", b"hg", value),  # replayed on another topic
        (KEY.encode(), "t", b"hx", value),  # replayed for another model
        (KEY.encode(), "t", b"hg", json.dumps(V2).encode()),  # another value
        (KEY.encode(), "t", b"hg", None),  # a signed route replayed as a tombstone
    ]
    for secret, topic, key, val in wrong:
        assert route_signature_problem(secret, topic, key, val, [(SIGNATURE_HEADER, sig)]) == "bad signature"
    assert sign_route(KEY.encode(), "t", b"hg", None) != sign_route(KEY.encode(), "t", b"hg", b"")


def test_follower_with_a_key_refuses_unsigned_and_badly_signed_records_keeping_the_route() -> None:
    kafka = KafkaConfig.model_validate({"routes_signing_key": KEY})
    follower = RouteFollower(kafka)
    topic, v1 = kafka.routes_topic, json.dumps(V1).encode()
    follower._apply(b"hg", v1, [(SIGNATURE_HEADER, sign_route(KEY.encode(), topic, b"hg", v1))])
    assert follower.routes()["hg"] == V1
    before = REFUSED._value.get()
    v2 = json.dumps(V2).encode()
    follower._apply(b"hg", v2)  # unsigned
    follower._apply(b"hg", v2, [(SIGNATURE_HEADER, sign_route(OTHER_KEY.encode(), topic, b"hg", v2))])
    follower._apply(b"hg", v2, [(SIGNATURE_HEADER, b"\xff" * 64)])  # garbage header: refused, no crash
    follower._apply(b"hg", v2, [(SIGNATURE_HEADER, None)])
    follower._apply(b"hg", None)  # unsigned tombstone
    assert REFUSED._value.get() - before == 5
    assert follower.routes()["hg"] == V1
    follower._apply(b"hg", None, [(SIGNATURE_HEADER, sign_route(KEY.encode(), topic, b"hg", None))])
    assert "hg" not in follower.routes()


def test_a_routes_key_shorter_than_32_characters_is_refused() -> None:
    with pytest.raises(ValueError, match="routes_signing_key must be at least 32"):
        KafkaConfig.model_validate({"routes_signing_key": "short"})
    assert KafkaConfig.model_validate({"routes_signing_key": ""}).routes_signing_key is None
    assert KEY not in repr(KafkaConfig.model_validate({"routes_signing_key": KEY}))


def _wait(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _kafka(broker: str, prefix: str, **extra: object) -> KafkaConfig:
    """A Kafka config on ``broker`` with fresh topics (``prefix``-<random>-...)."""
    tag = f"{prefix}-{uuid.uuid4().hex[:8]}"
    return KafkaConfig.model_validate(
        {
            "bootstrap_servers": [broker],
            "embedded": False,
            "traces_topic": f"{tag}-traces",
            "feedback_topic": f"{tag}-feedback",
            "routes_topic": f"{tag}-routes",
            **extra,
        }
    )


@pytest.mark.integration
def test_signed_routes_apply_and_forged_records_do_not_on_a_real_broker(broker: str) -> None:
    kafka = _kafka(broker, "rs", routes_signing_key=SecretStr(KEY))
    ensure_routes_topic(kafka)
    publisher = RoutePublisher(kafka)
    follower = RouteFollower(kafka, poll_ms=50)
    producer = KafkaProducer(bootstrap_servers=[broker], acks="all")
    try:
        publisher.publish({"hg": V1, "other": V1 | {"served_name": "other-v1"}})
        assert follower.start(wait_s=30), follower.last_error
        _wait(lambda: follower.routes().get("hg") == V1)
        before = REFUSED._value.get()
        topic = kafka.routes_topic
        v3 = json.dumps(V3).encode()
        producer.send(topic, key=b"hg", value=v3).get(timeout=30)  # forged, unsigned
        bad = sign_route(OTHER_KEY.encode(), topic, b"hg", v3)
        producer.send(topic, key=b"hg", value=v3, headers=[(SIGNATURE_HEADER, bad)]).get(timeout=30)
        producer.send(topic, key=b"other", value=None).get(timeout=30)  # forged, unsigned tombstone
        _wait(lambda: REFUSED._value.get() - before >= 3)
        assert follower.routes()["hg"] == V1 and "other" in follower.routes()
        publisher.publish({"hg": V2, "other": None})  # the controller's signed change and tombstone apply
        _wait(lambda: follower.routes().get("hg") == V2 and "other" not in follower.routes())
        assert REFUSED._value.get() - before == 3
        assert follower.last_error is None
    finally:
        producer.close()
        publisher.close()
        follower.close()


@pytest.mark.integration
def test_without_a_key_unsigned_records_still_apply_on_a_real_broker(broker: str) -> None:
    kafka = _kafka(broker, "ru")
    ensure_routes_topic(kafka)
    follower = RouteFollower(kafka, poll_ms=50)
    producer = KafkaProducer(bootstrap_servers=[broker], acks="all")
    try:
        producer.send(kafka.routes_topic, key=b"hg", value=json.dumps(V1).encode()).get(timeout=30)
        assert follower.start(wait_s=30), follower.last_error
        _wait(lambda: follower.routes().get("hg") == V1)
    finally:
        producer.close()
        follower.close()
