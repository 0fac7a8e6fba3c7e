"""Gateways that share routes through the compacted routes topic (real broker, real MLflow).

The serving controller publishes the routes file's changes to ``kafka.routes_topic``
at the end of a reconcile pass; each gateway (the real app, with its own
follower) reads the topic from the beginning and follows it. A recording
upstream shows which served name each gateway asked for.
"""

from __future__ import annotations

import time
import uuid
from contextlib import ExitStack

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from tests.http_helpers import serve
from kafka import KafkaProducer

from connectors.config import GatewayConfig
from connectors.gateway.app import create_gateway_app
from connectors.gateway.routes import Route, write_route
from pipeline.cli.gateway import route_resolver
from pipeline.config import HourglassConfig
from pipeline.serving.controller import ServingController

pytestmark = pytest.mark.integration


class Upstream:
    """An OpenAI-shaped completions server whose completion text is the model it was asked for (the gateway
    answers the client with the public name, so the text is what shows the served name)."""

    def __init__(self) -> None:
        self.app = FastAPI()
        self.app.post("/v1/completions")(self._complete)

    async def _complete(self, request: Request) -> dict:
        body = await request.json()
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "text": body["model"], "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }


def _served(client: TestClient) -> str:
    response = client.post("/v1/completions", json={"model": "hg", "prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "hg"
    return response.json()["choices"][0]["text"]


def _gateway(cfg: HourglassConfig, upstream: str, stack: ExitStack) -> TestClient:
    """A gateway app with its own route follower (closed with ``stack``), running (lifespan entered)."""
    resolver = route_resolver(cfg, ready_wait_s=30)
    stack.callback(resolver.follower.close)
    assert resolver.follower.ready.is_set(), resolver.follower.last_error
    app = create_gateway_app(
        cfg.kafka, upstream, resolver, list_models=resolver.names, gateway=GatewayConfig(require_api_key=False)
    )
    client = stack.enter_context(TestClient(app))
    client.follower = resolver.follower  # type: ignore[attr-defined]
    return client


def _topic_config(
    tmp_path, broker: str, mlflow_uri: str, upstream: str, prefix: str, **kafka: object
) -> HourglassConfig:
    """A service config whose gateways follow their own routes topic on ``broker`` (fresh topics per call)."""
    tag = f"{prefix}-{uuid.uuid4().hex[:8]}"
    return HourglassConfig(
        state_dir=str(tmp_path / "state"),
        kafka={
            "bootstrap_servers": [broker],
            "traces_topic": f"{tag}-traces",
            "feedback_topic": f"{tag}-feedback",
            "routes_topic": f"{tag}-routes",
            "partitions": 1,
            "embedded": False,
            **kafka,
        },
        registry={"tracking_uri": mlflow_uri, "experiment": tag, "embedded": False},
        serving={"model_name": "hg", "replicas": [upstream], "embedded": False, "routes_source": "kafka"},
    )


def test_two_gateways_follow_one_route_flip_within_a_second(tmp_path, broker: str, mlflow_uri: str) -> None:
    with serve(Upstream().app, "upstream") as upstream, ExitStack() as stack:
        cfg = _topic_config(tmp_path, broker, mlflow_uri, upstream, "rt")
        controller = ServingController(cfg, base_fingerprint="test-base")
        stack.callback(controller.close)
        write_route(cfg.state_dir, "hg", Route("hg-v1", "1", "2026-01-01T00:00:00+00:00"))
        controller.reconcile_once()  # no @champion in MLflow: the pass only publishes the routes file

        gw_a = _gateway(cfg, upstream, stack)  # a gateway started after the publish knows the current route
        gw_b = _gateway(cfg, upstream, stack)
        assert _served(gw_a) == _served(gw_b) == "hg-v1"

        write_route(cfg.state_dir, "hg", Route("hg-v2", "2", "2026-01-01T00:01:00+00:00"))
        started = time.monotonic()
        controller.reconcile_once()  # returns once the broker acknowledged the new route
        flipped = time.monotonic()
        while {_served(gw_a), _served(gw_b)} != {"hg-v2"}:
            assert time.monotonic() - flipped < 1.0, "the gateways did not follow the flip within a second"
            time.sleep(0.02)
        took = time.monotonic() - flipped
        print(
            f"both gateways on hg-v2 {took * 1000:.0f} ms after the publish (reconcile pass {(flipped - started) * 1000:.0f} ms)"
        )

        # a hostile record on the topic is skipped: the gateways keep the last good route
        producer = KafkaProducer(bootstrap_servers=[broker], acks="all")
        producer.send(cfg.kafka.routes_topic, key=b"hg", value=b"{not json").get(timeout=30)
        producer.send(cfg.kafka.routes_topic, key=b"hg", value=b'{"served_name": 7}').get(timeout=30)
        forged = [
            b"[" * 5000,  # nested past the JSON parser: ended the follower thread (no flip was ever seen again)
            b'{"served_name": "hg-v2", "version": "2", "updated_at": "", "challenger_served_name": "hg-v3", '
            b'"challenger_version": "3", "fraction": "0.5"}',  # was a TypeError: 500 on every request
            b'{"served_name": "grpo-s3", "version": "3", "updated_at": ""}',  # not a registered version's name
            b'{"served_name": "base", "version": null, "updated_at": ""}',  # a forged "back to the base"
        ]
        for value in forged:
            producer.send(cfg.kafka.routes_topic, key=b"hg", value=value).get(timeout=30)
        producer.close()
        time.sleep(0.5)
        assert _served(gw_a) == _served(gw_b) == "hg-v2"
        write_route(cfg.state_dir, "hg", Route("hg-v4", "4", "2026-01-01T00:02:00+00:00"))
        controller.reconcile_once()  # the followers are still alive: the next real flip arrives
        deadline = time.monotonic() + 5
        while {_served(gw_a), _served(gw_b)} != {"hg-v4"}:
            assert time.monotonic() < deadline, "a follower stopped following after the hostile records"
            time.sleep(0.05)

        # a gateway that starts now reads the topic from the beginning: the newest good value per key wins
        gw_c = _gateway(cfg, upstream, stack)
        assert _served(gw_c) == "hg-v4"
        assert gw_c.follower.routes()["hg"]["version"] == "4"


def test_with_a_routes_key_the_gateway_follows_the_controller_but_not_a_forged_well_formed_record(
    tmp_path, broker: str, mlflow_uri: str
) -> None:
    with serve(Upstream().app, "upstream") as upstream, ExitStack() as stack:
        # the same config (so the same key) for the controller and the gateway
        cfg = _topic_config(tmp_path, broker, mlflow_uri, upstream, "rs", routes_signing_key="r" * 32)
        controller = ServingController(cfg, base_fingerprint="test-base")
        stack.callback(controller.close)
        write_route(cfg.state_dir, "hg", Route("hg-v1", "1", "2026-01-01T00:00:00+00:00"))
        controller.reconcile_once()
        gw = _gateway(cfg, upstream, stack)
        assert _served(gw) == "hg-v1"

        producer = KafkaProducer(bootstrap_servers=[broker], acks="all")
        forged = b'{"served_name": "hg-v9", "version": "9", "updated_at": "2026-01-01T00:05:00+00:00"}'
        producer.send(cfg.kafka.routes_topic, key=b"hg", value=forged).get(timeout=30)  # valid route, no signature
        producer.send(cfg.kafka.routes_topic, key=b"hg", value=None).get(timeout=30)  # unsigned tombstone
        producer.close()
        time.sleep(0.5)
        assert _served(gw) == "hg-v1"
        assert gw.follower.routes()["hg"]["version"] == "1"

        write_route(cfg.state_dir, "hg", Route("hg-v2", "2", "2026-01-01T00:01:00+00:00"))
        controller.reconcile_once()  # signed: the gateway follows it
        deadline = time.monotonic() + 5
        while _served(gw) != "hg-v2":
            assert time.monotonic() < deadline, "the signed flip did not reach the gateway"
            time.sleep(0.05)


def test_routes_file_stays_the_single_host_default(tmp_path) -> None:
    cfg = HourglassConfig(state_dir=str(tmp_path / "state"))
    assert cfg.serving.routes_source == "file" and cfg.kafka.routes_topic == "hourglass.routes"
    write_route(cfg.state_dir, "hourglass", Route("hourglass-v3", "3", "2026-01-01T00:00:00+00:00"))
    write_route(cfg.state_dir, "not-served-here", Route("not-served-here-v1", "1", "2026-01-01T00:00:00+00:00"))
    resolver = route_resolver(cfg, ttl_s=0.0)
    assert resolver("hourglass") == ("hourglass-v3", "3")
    assert resolver.names() == ["hourglass"]  # only the configured public names are routed
    assert not hasattr(resolver, "follower")


class _DownBroker:
    """A route publisher whose broker never acknowledges (unit test of the controller's ordering)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def publish(self, routes: dict) -> None:
        from connectors.errors import BrokerUnavailableError

        self.calls.append(routes)
        raise BrokerUnavailableError("broker down (test)")

    def close(self) -> None:
        pass


def test_a_replaced_version_stays_loaded_until_the_routes_topic_took_the_new_route(tmp_path) -> None:
    cfg = HourglassConfig(
        state_dir=str(tmp_path / "state"), serving={"model_name": "hg", "routes_source": "kafka", "drain_s": 0}
    )
    controller = ServingController(
        cfg, base_fingerprint="test-base", client=object()
    )  # MLflow calls fail: reported, skipped
    controller._route_publisher = down = _DownBroker()
    controller._published_routes = {}  # the topic exists and holds nothing yet
    write_route(cfg.state_dir, "hg", Route("hg-v2", "2", "2026-01-01T00:01:00+00:00"))
    controller._draining["hg-v1"] = 0.0  # v1 was replaced and its drain time is over
    status = controller.reconcile_once()
    assert down.calls == [
        {
            "hg": {
                "served_name": "hg-v2",
                "version": "2",
                "updated_at": "2026-01-01T00:01:00+00:00",
                "challenger_served_name": None,
                "challenger_version": None,
                "fraction": 0.0,
            }
        }
    ]
    assert "hg-v1" in controller._draining  # not unloaded: gateways may still route to it
    assert "broker down" in status["hg"]["last_transient_error"]
    controller.close()
