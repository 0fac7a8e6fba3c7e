"""The real gateway with a canary route: each user sticks to one side, and every trace records the
version that answered and ``metadata.canary`` (real broker and vLLM; the champion side is the base model,
the challenger a real adapter loaded into vLLM under its contract name ``hg-v2``)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from kafka import KafkaConsumer, TopicPartition

from connectors.config import GatewayConfig, KafkaConfig
from connectors.gateway.app import TRACE_HEADER, create_gateway_app
from connectors.kafka_admin import ensure_topics
from connectors.gateway.routes import RouteResolver, Route, write_route
from tests.pipeline.serving_helpers import make_adapter

pytestmark = pytest.mark.integration


def _traces(kafka: KafkaConfig, wanted: set[str], timeout_s: float = 60.0) -> dict[str, dict]:
    consumer = KafkaConsumer(
        bootstrap_servers=kafka.bootstrap_servers, group_id=None, auto_offset_reset="earliest", enable_auto_commit=False
    )
    consumer.assign([TopicPartition(kafka.traces_topic, p) for p in range(kafka.partitions)])
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not wanted <= seen.keys() and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                for record in records:
                    seen[record.key.decode()] = json.loads(record.value)
    finally:
        consumer.close()
    assert wanted <= seen.keys(), f"{len(wanted - seen.keys())} trace(s) never arrived"
    return seen


def test_gateway_splits_sticky_per_user_and_traces_say_which_side(
    tmp_path, broker: str, vllm_tiny: str, tiny_model: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    kafka = KafkaConfig(
        bootstrap_servers=[broker], traces_topic=f"cg-traces-{tag}", feedback_topic=f"cg-feedback-{tag}", partitions=1
    )
    ensure_topics(kafka)
    adapter = make_adapter(tiny_model, tmp_path / "adapter")
    load = httpx.post(
        f"{vllm_tiny}/v1/load_lora_adapter", json={"lora_name": "hg-v2", "lora_path": str(adapter)}, timeout=120
    )
    assert load.status_code == 200, load.text
    try:
        _split_and_check(tmp_path, kafka, vllm_tiny)
    finally:
        httpx.post(f"{vllm_tiny}/v1/unload_lora_adapter", json={"lora_name": "hg-v2"}, timeout=60)


def _split_and_check(tmp_path, kafka: KafkaConfig, vllm_tiny: str) -> None:
    # the champion is the base (no version yet); the challenger is version 2, served as hg-v2 (the routes contract)
    write_route(tmp_path, "hg", Route("base", None, "2026-01-01T00:00:00+00:00", "hg-v2", "2", 0.5))
    resolver = RouteResolver(tmp_path, "hg", "base", ttl_s=0.0)
    sides: dict[str, set[tuple[str | None, bool]]] = {}
    gateway = GatewayConfig(require_api_key=False)  # identity here comes from the request's `user` (no key needed)
    with TestClient(create_gateway_app(kafka, vllm_tiny, resolver, gateway=gateway)) as client:
        ids: dict[str, str] = {}
        for user in [f"user-{i}" for i in range(6)] * 2:
            body = {"model": "hg", "prompt": "Hello", "max_tokens": 2, "user": user, "metadata": {"canary": "forged"}}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            ids[response.headers[TRACE_HEADER]] = user
    traces = _traces(kafka, set(ids))
    for trace_id, user in ids.items():
        trace = traces[trace_id]
        canary = trace["metadata"]["canary"]
        version = trace.get("adapter_version")  # absent on the base side
        assert canary is (version == "2")  # set by the gateway, not by the client
        sides.setdefault(user, set()).add((version, canary))
    assert all(len(s) == 1 for s in sides.values()), sides  # sticky: a user's two requests went to one side
    assert {v for s in sides.values() for v, _ in s} == {None, "2"}, sides  # both sides served someone
