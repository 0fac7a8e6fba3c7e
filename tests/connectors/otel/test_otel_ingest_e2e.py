"""End to end with real components: a real vLLM chat call, recorded as OpenTelemetry GenAI spans by the
OpenTelemetry Python SDK, encoded by the SDK's own OTLP protobuf encoder, produced to a real Tansu
broker, read by the real ingest worker into the reward buffer.

Which producer: the OpenTelemetry Collector binary is not available from a package registry here, and
``opentelemetry-instrumentation-openai-v2`` is not in ``requirements.lock``. So the spans are made with
the SDK tracer, with the GenAI attributes set exactly as that instrumentation sets them in the current
semconv layout (``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental``, content captured on the
span), from the request and the real response; and each export is
``opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans(spans).SerializeToString()``: an
``ExportTraceServiceRequest``, the same ``otlp_proto`` bytes the Collector's Kafka exporter writes as a
record value (its default ``encoding: otlp_proto``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from kafka import KafkaProducer
from openai import OpenAI
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, format_span_id, format_trace_id
from prometheus_client import REGISTRY

from connectors.buffer import RewardBuffer
from connectors.config import BufferConfig, KafkaConfig
from connectors.dead_letter import DeadLetterStore
from connectors.ingest import IngestWorker
from connectors.kafka_admin import ensure_topics
from connectors.otel import OtelFeedbackRule, OtelSourceConfig
from connectors.schema import UserHasher
from tests.connectors.connector_helpers import wait_for
from trainer.config import CandidateConfig, ModelConfig, RewardTerm, RLConfig
from trainer.data import round_inputs, split_snapshot
from trainer.round import run_round
from trainer.types import RoundSpec

pytestmark = pytest.mark.integration

MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a colour."},
]


def _genai_attributes(
    response: Any,
    base_url: str,
    *,
    content: bool,
    messages: list[dict[str, str]] = MESSAGES,
    user: str = "alice@example.com",
) -> dict[str, Any]:
    """The attributes ``opentelemetry-instrumentation-openai-v2`` puts on its ``chat {model}`` span (latest
    experimental GenAI semconv; messages as JSON strings when content capture is on), plus what the
    application adds (``user.id``, ``gen_ai.conversation.id``)."""
    choice = response.choices[0]
    host, _, port = base_url.removeprefix("http://").partition(":")
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "base",
        "gen_ai.request.max_tokens": 8,
        "gen_ai.request.temperature": 0.0,
        "server.address": host,
        "server.port": int(port),
        "gen_ai.response.id": response.id,
        "gen_ai.response.model": response.model,
        "gen_ai.response.finish_reasons": [choice.finish_reason],
        "gen_ai.usage.input_tokens": response.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": response.usage.completion_tokens,
        "gen_ai.conversation.id": "conv-1",
        "user.id": user,
    }
    if content:
        attrs["gen_ai.system_instructions"] = json.dumps([{"type": "text", "content": messages[0]["content"]}])
        attrs["gen_ai.input.messages"] = json.dumps(
            [{"role": "user", "parts": [{"type": "text", "content": messages[1]["content"]}]}]
        )
        attrs["gen_ai.output.messages"] = json.dumps(
            [
                {
                    "role": "assistant",
                    "parts": [{"type": "text", "content": choice.message.content}],
                    "finish_reason": choice.finish_reason,
                }
            ]
        )
    return attrs


def _record_spans(response: Any, base_url: str) -> tuple[list[ReadableSpan], list[ReadableSpan], str]:
    """(the request's spans: chat with content, chat without content, the app's HTTP server span; the
    feedback span; the derived Hourglass trace id of the chat span)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "shop-assistant"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("opentelemetry.instrumentation.openai_v2", "2.3b0")
    with tracer.start_as_current_span("POST /ask", kind=SpanKind.SERVER, attributes={"http.route": "/ask"}):
        with tracer.start_as_current_span("chat base", kind=SpanKind.CLIENT) as chat:
            chat.set_attributes(_genai_attributes(response, base_url, content=True))
        with tracer.start_as_current_span("chat base", kind=SpanKind.CLIENT) as bare:  # content capture off
            bare.set_attributes(_genai_attributes(response, base_url, content=False))
    context = chat.get_span_context()
    with tracer.start_as_current_span(
        "user_feedback", links=[Link(context)], attributes={"feedback.thumbs": "up", "user.id": "alice@example.com"}
    ):
        pass
    provider.shutdown()
    chat_done, bare_done, http_done, vote_done = exporter.get_finished_spans()
    trace_id = f"otel-{format_trace_id(context.trace_id)}-{format_span_id(context.span_id)}"
    return [chat_done, bare_done, http_done], [vote_done], trace_id


def _chat(base_url: str, messages: list[dict[str, str]]) -> Any:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    return client.chat.completions.create(
        model="base",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0.0,
        extra_body={"min_tokens": 8},  # the tiny random model: never an empty answer
    )


def _produce(kafka: KafkaConfig, topic: str, values: list[bytes]) -> None:
    """Produce ``values`` in order to partition 0 of ``topic`` (created first: offsets 0, 1, ...)."""
    ensure_topics(kafka, [topic])
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap_servers, acks="all")
    try:
        for value in values:
            producer.send(topic, value=value, partition=0).get(timeout=30)
    finally:
        producer.close()


def _skipped(reason: str) -> float:
    return REGISTRY.get_sample_value("hourglass_otel_spans_skipped_total", {"reason": reason}) or 0.0


def test_sdk_genai_spans_of_a_real_vllm_call_land_in_the_buffer(
    vllm_tiny: str,
    kafka_cfg: KafkaConfig,
    buffer_cfg: BufferConfig,
    run_worker: Callable[..., IngestWorker],
) -> None:
    response = _chat(vllm_tiny, MESSAGES)
    assert response.choices[0].message.content
    request_spans, vote_spans, trace_id = _record_spans(response, vllm_tiny)
    calls = encode_spans(request_spans).SerializeToString()  # = the Kafka exporter's otlp_proto record value
    vote = encode_spans(vote_spans).SerializeToString()

    otel = OtelSourceConfig(
        topic=f"otlp_spans-{kafka_cfg.group_id}",
        feedback=[OtelFeedbackRule(attribute="feedback.thumbs", signal="thumbs")],
    )
    # calls twice: a retried export (offsets 0..3, in this order)
    _produce(kafka_cfg, otel.topic, [calls, vote, calls, b"\x07 not an ExportTraceServiceRequest"])
    before = _skipped("not_genai")
    worker = run_worker(kafka_cfg, buffer_cfg, otel=otel)
    wait_for(lambda: worker.stats().otel_records >= 4 and worker.stats().commits >= 1, 90, "4 OTel records stored")

    snap = RewardBuffer(buffer_cfg).snapshot()
    assert snap["trace_id"].to_pylist() == [trace_id]  # once, though its payload was delivered twice
    row = snap.filter(pc.equal(snap["trace_id"], trace_id))
    assert json.loads(row["prompt"][0].as_py()) == MESSAGES
    assert row["completion"][0].as_py() == response.choices[0].message.content
    assert row["model"][0].as_py() == "base"
    assert row["reward"][0].as_py() == 1.0  # the thumbs-up span linked to the chat span joined it
    metadata = json.loads(row["metadata"][0].as_py())
    hasher = UserHasher(buffer_cfg.user_hash_key.get_secret_value(), buffer_cfg.user_id_keys)
    assert metadata["user"] == hasher.digest("alice@example.com")
    assert metadata["user_hash"] == hasher.digest("otel\x00alice@example.com")
    assert metadata["usage"] == {
        "prompt_tokens": response.usage.prompt_tokens,  # type: ignore[union-attr]
        "completion_tokens": response.usage.completion_tokens,  # type: ignore[union-attr]
    }
    assert metadata["finish_reason"] == response.choices[0].finish_reason
    # the hourglass.trace/v2 columns the span carries
    assert json.loads(row["usage"][0].as_py()) == metadata["usage"]
    assert row["conversation_id"][0].as_py() == "conv-1" and row["turn"][0].as_py() == 0
    assert row["finish_reason"][0].as_py() == response.choices[0].finish_reason
    assert metadata["otel"]["conversation_id"] == "conv-1" and metadata["otel"]["service_name"] == "shop-assistant"
    assert "alice" not in row["metadata"][0].as_py()

    letters = DeadLetterStore(buffer_cfg.dead_letter_root).list()
    assert sorted((letter["offset"], letter["reason"]) for letter in letters) == [
        (0, "no_content"),
        (2, "no_content"),
        (3, "invalid_protobuf"),
    ]
    bare_span_id = format_span_id(request_spans[1].context.span_id)  # type: ignore[union-attr]
    assert all(bare_span_id in letter["detail"] for letter in letters if letter["reason"] == "no_content")
    # the HTTP span of both deliveries and the feedback span are not inference calls: counted, not stored
    assert worker.stats().otel_spans_skipped == 3 and _skipped("not_genai") - before == 3

    # Every record redelivered (a new consumer group reads the topic from the start): nothing is duplicated.
    again = run_worker(kafka_cfg.model_copy(update={"group_id": f"{kafka_cfg.group_id}-again"}), buffer_cfg, otel=otel)
    wait_for(lambda: again.stats().otel_records >= 4 and again.stats().commits >= 1, 90, "4 OTel records re-read")
    snap = RewardBuffer(buffer_cfg).snapshot()
    assert snap["trace_id"].to_pylist() == [trace_id] and snap["reward"].to_pylist() == [1.0]


def test_a_round_trains_on_the_otel_traces_that_landed(
    vllm_tiny: str,
    tiny_model: Path,
    kafka_cfg: KafkaConfig,
    buffer_cfg: BufferConfig,
    run_worker: Callable[..., IngestWorker],
    tmp_path: Path,
) -> None:
    """Six real chat calls by three users, each voted on by its user; an offline round (the logged
    completions and their feedback rewards) trains on the buffer's snapshot."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "shop-assistant"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("opentelemetry.instrumentation.openai_v2", "2.3b0")
    users = ["alice@example.com", "bob@example.com", "carol@example.com"]
    votes = []
    for i in range(6):
        messages = [MESSAGES[0], {"role": "user", "content": f"Name colour number {i}."}]
        response = _chat(vllm_tiny, messages)
        with tracer.start_as_current_span("chat base", kind=SpanKind.CLIENT) as chat:
            chat.set_attributes(
                _genai_attributes(response, vllm_tiny, content=True, messages=messages, user=users[i % 3])
            )
        votes.append((chat.get_span_context(), "up" if i % 2 == 0 else "down", users[i % 3]))
    calls = list(exporter.get_finished_spans())
    exporter.clear()
    for context, thumbs, user in votes:
        with tracer.start_as_current_span(
            "user_feedback", links=[Link(context)], attributes={"feedback.thumbs": thumbs, "user.id": user}
        ):
            pass
    provider.shutdown()
    otel = OtelSourceConfig(
        topic=f"otlp_spans-{kafka_cfg.group_id}",
        feedback=[OtelFeedbackRule(attribute="feedback.thumbs", signal="thumbs")],
    )
    _produce(
        kafka_cfg,
        otel.topic,
        [encode_spans(calls).SerializeToString(), encode_spans(exporter.get_finished_spans()).SerializeToString()],
    )
    worker = run_worker(kafka_cfg, buffer_cfg, otel=otel)
    wait_for(lambda: worker.stats().otel_records >= 2 and worker.stats().commits >= 1, 90, "2 OTel records stored")
    snap = RewardBuffer(buffer_cfg).snapshot()
    assert snap.num_rows == 6 and sorted(snap["reward"].to_pylist()) == [-1.0] * 3 + [1.0] * 3

    train, heldout = split_snapshot(snap, 0.34)
    rl = RLConfig(
        steps_per_round=1,
        prompts_per_step=2,
        rollout={"group_size": 2, "max_new_tokens": 3, "engine": "hf"},
        gate={"eval_prompts": 2, "max_kl": 100.0},
    )
    candidate = CandidateConfig(
        name="otel", algorithm="offline_is", reward=[RewardTerm(fn="logged")], start="fresh", served_model="base"
    )
    result = run_round(
        RoundSpec(ModelConfig(name=str(tiny_model)), (candidate,), rl),
        round_inputs(train, heldout),
        tmp_path / "round",
    )
    (trained,) = result.candidates
    assert (trained.adapter_dir / "adapter_model.safetensors").is_file()
    assert len(trained.step_metrics) == 1 and trained.step_metrics[0]["train/reward_mean"] in (-1.0, 0.0, 1.0)
