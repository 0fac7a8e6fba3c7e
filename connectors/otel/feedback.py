"""User feedback carried by OTel spans and span events -> :class:`~connectors.otel.types.FeedbackSignal`.

The config names the attributes that carry a signal (:class:`~connectors.otel.config.OtelFeedbackRule`),
e.g. ``feedback.thumbs`` set by the app, or ``gen_ai.evaluation.score.value`` with
``gen_ai.evaluation.name`` (the ``gen_ai.evaluation.result`` event of semantic conventions 1.41, which
"SHOULD be parented to the GenAI operation span being evaluated"). What an item points at:

- the GenAI inference span itself, or an event on it: that span;
- any other span, or an event on it: the span's first link, else its parent span.

Every rule that matches one item adds its signal to the same :class:`FeedbackSignal` (one feedback event
per item; the first rule wins when two name the same signal).
"""

from __future__ import annotations

import math
from typing import Any

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from connectors.otel.config import OtelFeedbackRule, OtelSourceConfig
from connectors.otel.genai import INFERENCE_OPERATIONS, span_ids, user_id, utc
from connectors.otel.types import INVALID_SIGNAL, UNLINKED_FEEDBACK, FeedbackSignal, Rejected
from connectors.otel.wire import Attrs, Refused, kind_of

EVALUATION_NAME = "gen_ai.evaluation.name"


def read_feedback(
    span: Span, attrs: Attrs, resource: Attrs, operation: str | None, cfg: OtelSourceConfig
) -> list[FeedbackSignal | Rejected]:
    """The feedback items of one span (the span itself, then its events, in order); [] without rules."""
    if not cfg.feedback:
        return []
    out: list[FeedbackSignal | Rejected] = []
    trace_hex, span_hex = span.trace_id.hex(), span.span_id.hex()
    items: list[tuple[str, Attrs, int]] = [("span", attrs, span.end_time_unix_nano or span.start_time_unix_nano)]
    items += [
        ("event", Attrs(e.attributes, cfg, f"event {e.name[:80]!r}"), e.time_unix_nano or span.end_time_unix_nano)
        for e in span.events[: cfg.max_events_per_span]
    ]
    for source, item_attrs, unix_nano in items:
        try:
            signals, names, evaluation = _signals(item_attrs, cfg.feedback)
            if not signals:
                continue
            target = _target(span, source, operation)
            ts = utc(unix_nano, f"feedback {source} time")
            who = user_id(cfg, item_attrs, attrs, resource) if source == "event" else user_id(cfg, attrs, resource)
        except Refused as err:
            out.append(Rejected(err.reason, err.detail, trace_hex, span_hex))
            continue
        out.append(
            FeedbackSignal(
                target_trace_id=target[0],
                target_span_id=target[1],
                signals=signals,
                ts=ts,
                user_id=who,
                attributes=names,
                evaluation_name=evaluation,
                source_trace_id=trace_hex,
                source_span_id=span_hex,
                source=source,
            )
        )
    return out


def _signals(attrs: Attrs, rules: list[OtelFeedbackRule]) -> tuple[dict[str, Any], tuple[str, ...], str | None]:
    """(signal name -> value, the attributes read, the evaluation name) of one item."""
    signals: dict[str, Any] = {}
    names: list[str] = []
    evaluation = attrs.text(EVALUATION_NAME) if EVALUATION_NAME in attrs else None
    for rule in rules:
        if rule.attribute not in attrs or rule.signal in signals:
            continue
        if rule.evaluation_name is not None and evaluation != rule.evaluation_name:
            continue
        signals[rule.signal] = signal_value(rule, attrs.value(rule.attribute))
        names.append(rule.attribute)
    return signals, tuple(names), evaluation


def signal_value(rule: OtelFeedbackRule, value: Any) -> Any:
    """``value`` of ``rule.attribute`` in the type of ``rule.signal``.

    Raises:
        Refused: ``invalid_signal`` (a value the signal cannot take, NaN, a rating outside 1..5).
    """
    where = f"feedback attribute {rule.attribute!r}"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and not math.isfinite(value):
        raise Refused(INVALID_SIGNAL, f"{where} is {value!r}; signals must be finite")
    if rule.signal == "thumbs":
        if isinstance(value, str) and value.lower() in ("up", "down"):
            return value.lower()
        if isinstance(value, bool):
            return "up" if value else "down"
        if number and value != 0:
            return "up" if value > 0 else "down"
        raise Refused(
            INVALID_SIGNAL, f'{where} is {kind_of(value)}; thumbs takes "up"/"down", true/false or a signed number'
        )
    if rule.signal == "rating":
        if number and float(value).is_integer() and 1 <= value <= 5:
            return int(value)
        raise Refused(INVALID_SIGNAL, f"{where} is {kind_of(value)}; a rating is an integer 1..5")
    if rule.signal == "reward":
        if not number:
            raise Refused(INVALID_SIGNAL, f"{where} is {kind_of(value)}; a reward is a number")
        if rule.score_min is not None and rule.score_max is not None:
            return -1.0 + 2.0 * (float(value) - rule.score_min) / (rule.score_max - rule.score_min)
        return float(value)
    if isinstance(value, bool):  # edited / regenerated
        return value
    raise Refused(INVALID_SIGNAL, f"{where} is {kind_of(value)}; {rule.signal} takes true/false")


def _target(span: Span, source: str, operation: str | None) -> tuple[str, str]:
    """(trace id, span id) in hex of the GenAI span an item (``source``: "span" / "event") is about (module doc).

    Raises:
        Refused: ``unlinked_feedback`` (nothing to point at), ``invalid_span`` (bad ids).
    """
    if operation in INFERENCE_OPERATIONS:
        return span_ids(span)
    for link in span.links:
        if len(link.trace_id) == 16 and any(link.trace_id) and len(link.span_id) == 8 and any(link.span_id):
            return link.trace_id.hex(), link.span_id.hex()
    if len(span.parent_span_id) == 8 and any(span.parent_span_id):
        trace_id, _ = span_ids(span)
        return trace_id, span.parent_span_id.hex()
    raise Refused(
        UNLINKED_FEEDBACK,
        f"feedback {source} on span {span.name[:80]!r} points at no GenAI span: give the feedback span a link to "
        "the GenAI span (or make it the GenAI span's child), or add the feedback as an event of the GenAI span",
    )
