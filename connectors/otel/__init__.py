"""OpenTelemetry GenAI traces from Kafka: the Collector's Kafka exporter payloads (``otlp_proto`` /
``otlp_json``) decoded into GenAI calls and feedback signals, and mapped to Hourglass events.

Modules: :mod:`.config` (settings), :mod:`.types` (the values produced and the reason codes),
:mod:`.wire` (payload decoding, bounded attribute reads), :mod:`.messages` (GenAI message shapes ->
OpenAI chat messages), :mod:`.genai` (one span -> a call; the layouts read and the spec versions),
:mod:`.feedback` (spans/events carrying feedback), :mod:`.mapping` (-> ``hourglass.trace/v2`` /
``hourglass.feedback/v1`` dicts), :mod:`.source` (one record -> everything in it).
"""

from connectors.otel.config import OtelFeedbackRule, OtelSourceConfig
from connectors.otel.mapping import conversation_fields, derived_trace_id, feedback_event, trace_event
from connectors.otel.source import NativeEvents, decode_payload, native_events
from connectors.otel.types import FeedbackSignal, GenAICall, OtelBatch, Rejected, Skipped

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
