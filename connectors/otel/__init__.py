"""OpenTelemetry GenAI traces from Kafka: the Collector's Kafka exporter payloads (``otlp_proto`` /
``otlp_json``) decoded into GenAI calls and feedback signals, and mapped to Hourglass events.

Modules: :mod:`.config` (settings), :mod:`.types` (the values produced and the reason codes),
:mod:`.wire` (payload decoding, bounded attribute reads), :mod:`.messages` (GenAI message shapes ->
OpenAI chat messages), :mod:`.genai` (one span -> a call; the layouts read and the spec versions),
:mod:`.feedback` (spans/events carrying feedback), :mod:`.mapping` (-> ``hourglass.trace/v2`` /
``hourglass.feedback/v1`` dicts), :mod:`.source` (one record -> everything in it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The names below are loaded on first use (PEP 562): the configuration imports `connectors.otel.config`, and
# importing this package must not pull the decoders' opentelemetry-proto (the `ingest` extra) into every role.
_WHERE = {
    "OtelFeedbackRule": "config",
    "OtelSourceConfig": "config",
    "conversation_fields": "mapping",
    "derived_trace_id": "mapping",
    "feedback_event": "mapping",
    "trace_event": "mapping",
    "NativeEvents": "source",
    "decode_payload": "source",
    "native_events": "source",
    "FeedbackSignal": "types",
    "GenAICall": "types",
    "OtelBatch": "types",
    "Rejected": "types",
    "Skipped": "types",
}

if TYPE_CHECKING:
    from connectors.otel.config import OtelFeedbackRule, OtelSourceConfig
    from connectors.otel.mapping import conversation_fields, derived_trace_id, feedback_event, trace_event
    from connectors.otel.source import NativeEvents, decode_payload, native_events
    from connectors.otel.types import FeedbackSignal, GenAICall, OtelBatch, Rejected, Skipped


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'connectors.otel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"connectors.otel.{module}"), name)


__all__ = [
    "FeedbackSignal",
    "GenAICall",
    "NativeEvents",
    "OtelBatch",
    "OtelFeedbackRule",
    "OtelSourceConfig",
    "Rejected",
    "Skipped",
    "conversation_fields",
    "decode_payload",
    "derived_trace_id",
    "feedback_event",
    "native_events",
    "trace_event",
]
