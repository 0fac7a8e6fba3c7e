"""One Kafka record of the Collector's Kafka exporter -> GenAI calls, feedback signals, skips and refusals.

:func:`decode_payload` is the whole source for one record value: decode (``otlp_proto`` / ``otlp_json``),
walk every span (at most ``max_spans_per_payload``), classify it (:mod:`connectors.otel.genai`) and read
its feedback items (:mod:`connectors.otel.feedback`). :func:`native_events` maps the result to
``hourglass.trace/v2`` / ``hourglass.feedback/v1`` dicts for the ingest path. Neither raises on bad input:
a payload that cannot be decoded is one :class:`Rejected` without span ids; a span that cannot be used is
a :class:`Rejected` with its ids, and the other spans of the payload still count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connectors.otel.config import OtelSourceConfig
from connectors.otel.feedback import read_feedback
from connectors.otel.genai import operation_of, read_call
from connectors.otel.mapping import Digest, feedback_event, trace_event
from connectors.otel.types import TOO_MANY_SPANS, GenAICall, OtelBatch, Rejected, Skipped
from connectors.otel.wire import Attrs, Refused, decode_request


def decode_payload(value: bytes | None, cfg: OtelSourceConfig) -> OtelBatch:
    """Every GenAI call and feedback signal of one payload, plus what was skipped (counted by reason) and
    refused (with reason codes; see :mod:`connectors.otel.types`)."""
    out = OtelBatch()
    try:
        request = decode_request(value, cfg)
    except Refused as err:
        out.rejected.append(Rejected(err.reason, err.detail))
        return out
    total = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
    if total > cfg.max_spans_per_payload:
        out.rejected.append(
            Rejected(
                TOO_MANY_SPANS,
                f"payload holds {total} spans, above otel.max_spans_per_payload={cfg.max_spans_per_payload}; "
                "lower the Collector's batch size (batch processor send_batch_max_size)",
            )
        )
        return out
    for i, rs in enumerate(request.resource_spans):
        resource = Attrs(rs.resource.attributes, cfg, f"resource #{i}")
        try:
            service = resource.text("service.name")
        except Refused:
            service = None
        for ss in rs.scope_spans:
            scope = ss.scope.name or None
            for span in ss.spans:
                out.spans += 1
                attrs = Attrs(span.attributes, cfg, f"span {span.name[:80]!r}")
                result = read_call(span, attrs, resource, cfg, service, scope)
                if isinstance(result, GenAICall):
                    out.calls.append(result)
                elif isinstance(result, Skipped):
                    out.skipped[result.reason] += 1
                else:
                    out.rejected.append(result)
                try:
                    operation = operation_of(attrs)
                except Refused:
                    operation = None
                for item in read_feedback(span, attrs, resource, operation, cfg):
                    if isinstance(item, Rejected):
                        out.rejected.append(item)
                    else:
                        out.feedback.append(item)
    return out


@dataclass
class NativeEvents:
    """A payload mapped for ingest: event dicts to validate and store, refusals to dead-letter, skips to count."""

    events: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    spans: int = 0


def native_events(value: bytes | None, cfg: OtelSourceConfig, digest: Digest | None = None) -> NativeEvents:
    """:func:`decode_payload`, then each call as a trace dict (:func:`~connectors.otel.mapping.trace_event`)
    and each feedback signal as a feedback dict, traces first, each in span order. ``digest``: ingest's
    ``UserHasher.digest``, for ``metadata.user_hash`` (see :func:`~connectors.otel.mapping.trace_event`)."""
    batch = decode_payload(value, cfg)
    out = NativeEvents(rejected=list(batch.rejected), skipped=dict(batch.skipped), spans=batch.spans)
    for call in batch.calls:
        event = trace_event(call, cfg, digest)
        if isinstance(event, Rejected):
            out.rejected.append(event)
        else:
            out.events.append(event)
    out.events.extend(feedback_event(signal, digest) for signal in batch.feedback)
    return out
