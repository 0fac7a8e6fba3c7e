"""Feedback carried by OTel spans and events: each configured attribute becomes an hourglass.feedback/v1
event for the GenAI span it points at (event on the GenAI span, child span, linked span), with the same
derived trace id as that span's trace; values the signal cannot take are refused."""

from __future__ import annotations

import json

import pytest

from connectors.otel import OtelFeedbackRule, OtelSourceConfig, decode_payload, native_events
from connectors.otel.feedback import signal_value
from connectors.otel.wire import Refused
from connectors.schema import FeedbackEvent, UserHasher, parse_record
from tests.connectors.otel.otel_fixtures import (
    SIMPLE_ATTRS,
    SIMPLE_INPUT,
    SIMPLE_OUTPUT,
    SPAN_ID,
    START_NS,
    TRACE_ID,
    event,
    proto_bytes,
    span,
    v137_span,
)

THUMBS = OtelFeedbackRule(attribute="feedback.thumbs", signal="thumbs")
EVAL = OtelFeedbackRule(
    attribute="gen_ai.evaluation.score.value", signal="reward", evaluation_name="helpfulness", score_min=1, score_max=5
)
CFG = OtelSourceConfig(feedback=[THUMBS, EVAL])
HASHER = UserHasher("k" * 32, ["user"])
FEEDBACK_SPAN = "aaaaaaaaaaaaaaaa"
SIMPLE_ATTRS_WITH_VOTE = {**SIMPLE_ATTRS, "feedback.thumbs": "up", "user.id": "carol"}


def feedback_events(*spans: object, cfg: OtelSourceConfig = CFG) -> list[dict]:
    out = native_events(proto_bytes(*spans), cfg)  # type: ignore[arg-type]
    assert not out.rejected, out.rejected
    return [e for e in out.events if e["schema"] == "hourglass.feedback/v1"]


def test_a_child_span_with_thumbs_becomes_feedback_for_its_parent_genai_span() -> None:
    genai = v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT)
    vote = span(
        {"feedback.thumbs": "up", "user.id": "alice"},
        span_id=FEEDBACK_SPAN,
        parent_span_id=SPAN_ID,
        name="user feedback",
        start_ns=START_NS + 60_000_000_000,
        end_ns=START_NS + 60_000_000_000,
    )
    out = native_events(proto_bytes(genai, vote), CFG)
    trace = next(e for e in out.events if e["schema"] == "hourglass.trace/v2")
    (fb,) = [e for e in out.events if e["schema"] == "hourglass.feedback/v1"]
    assert fb["trace_id"] == trace["trace_id"] == f"otel-{TRACE_ID}-{SPAN_ID}"
    assert (fb["thumbs"], fb["ts"], fb["metadata"]["user"]) == ("up", "2026-01-01T00:01:00Z", "alice")
    assert fb["metadata"]["otel"] == {
        "trace_id": TRACE_ID,
        "span_id": FEEDBACK_SPAN,
        "source": "span",
        "attributes": ["feedback.thumbs"],
    }
    stored = parse_record(json.dumps(fb).encode(), max_record_bytes=1 << 20, hasher=HASHER)
    assert isinstance(stored, FeedbackEvent) and stored.thumbs == "up"
    assert stored.metadata["user"].startswith("hmac-sha256:")


def test_a_linked_span_in_another_trace_points_at_the_linked_genai_span() -> None:
    other_trace = "0af7651916cd43dd8448eb211c80319c"
    vote = span(
        {"feedback.thumbs": False},
        trace_id=other_trace,
        span_id=FEEDBACK_SPAN,
        parent_span_id="bbbbbbbbbbbbbbbb",
        links=[(TRACE_ID, SPAN_ID)],
    )
    (fb,) = feedback_events(vote)
    assert fb["trace_id"] == f"otel-{TRACE_ID}-{SPAN_ID}" and fb["thumbs"] == "down"


def test_an_evaluation_event_on_the_genai_span_itself() -> None:
    result = event(
        "gen_ai.evaluation.result",
        {"gen_ai.evaluation.name": "helpfulness", "gen_ai.evaluation.score.value": 4.0, "user.id": "grader-7"},
        time_ns=START_NS + 5_000_000_000,
    )
    other = event(
        "gen_ai.evaluation.result", {"gen_ai.evaluation.name": "relevance", "gen_ai.evaluation.score.value": 1.0}
    )
    genai = v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, events=[result, other])
    out = native_events(proto_bytes(genai), CFG)
    assert [e["schema"] for e in out.events] == [
        "hourglass.trace/v2",
        "hourglass.feedback/v1",
    ]  # relevance is not configured
    fb = out.events[1]
    assert fb["trace_id"] == out.events[0]["trace_id"]
    assert fb["reward"] == pytest.approx(0.5)  # 4 on the 1..5 scale
    assert fb["metadata"]["user"] == "grader-7" and fb["metadata"]["otel"]["evaluation_name"] == "helpfulness"
    assert fb["ts"] == "2026-01-01T00:00:05Z"


def test_several_rules_on_one_item_make_one_event() -> None:
    cfg = OtelSourceConfig(feedback=[THUMBS, OtelFeedbackRule(attribute="feedback.stars", signal="rating")])
    vote = span({"feedback.thumbs": "down", "feedback.stars": 2}, span_id=FEEDBACK_SPAN, parent_span_id=SPAN_ID)
    (fb,) = feedback_events(vote, cfg=cfg)
    assert (fb["thumbs"], fb["rating"]) == ("down", 2)


def test_no_rules_no_feedback_and_items_without_the_attribute_are_ignored() -> None:
    vote = span({"feedback.thumbs": "up"}, span_id=FEEDBACK_SPAN, parent_span_id=SPAN_ID)
    assert feedback_events(vote, cfg=OtelSourceConfig()) == []
    assert feedback_events(span({"http.route": "/"}, span_id=FEEDBACK_SPAN, parent_span_id=SPAN_ID)) == []


def test_unlinked_feedback_and_bad_values_are_rejected() -> None:
    lonely = span({"feedback.thumbs": "up"}, span_id=FEEDBACK_SPAN)
    bad = span({"feedback.thumbs": "sideways"}, span_id="cccccccccccccccc", parent_span_id=SPAN_ID)
    batch = decode_payload(proto_bytes(lonely, bad), CFG)
    assert [(r.reason, r.span_id) for r in batch.rejected] == [
        ("unlinked_feedback", FEEDBACK_SPAN),
        ("invalid_signal", "cccccccccccccccc"),
    ]
    assert not batch.feedback


@pytest.mark.parametrize(
    ("signal", "value", "expected"),
    [
        ("thumbs", "UP", "up"),
        ("thumbs", True, "up"),
        ("thumbs", -1, "down"),
        ("thumbs", 0, None),
        ("thumbs", "meh", None),
        ("rating", 4, 4),
        ("rating", 4.0, 4),
        ("rating", 4.5, None),
        ("rating", 6, None),
        ("rating", True, None),
        ("reward", 0.25, 0.25),
        ("reward", float("nan"), None),
        ("reward", "0.5", None),
        ("edited", True, True),
        ("edited", "yes", None),
        ("regenerated", 1, None),
    ],
)
def test_signal_values(signal: str, value: object, expected: object) -> None:
    rule = OtelFeedbackRule(attribute="a", signal=signal)  # type: ignore[arg-type]
    if expected is None:
        with pytest.raises(Refused) as err:
            signal_value(rule, value)
        assert err.value.reason == "invalid_signal"
    else:
        assert signal_value(rule, value) == expected


def test_rule_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="both"):
        OtelFeedbackRule(attribute="a", signal="reward", score_min=0)
    with pytest.raises(ValueError, match="apply to signal .reward. only"):
        OtelFeedbackRule(attribute="a", signal="thumbs", score_min=0, score_max=1)
    with pytest.raises(ValueError, match="below"):
        OtelFeedbackRule(attribute="a", signal="reward", score_min=1, score_max=1)


def test_feedback_on_the_genai_span_itself_and_the_voter_hash() -> None:
    genai = v137_span(SIMPLE_INPUT, SIMPLE_OUTPUT, attrs={**SIMPLE_ATTRS_WITH_VOTE})
    out = native_events(proto_bytes(genai), CFG, HASHER.digest)
    trace, fb = out.events
    assert fb["trace_id"] == trace["trace_id"] and fb["thumbs"] == "up"
    assert fb["metadata"]["user_hash"] == trace["metadata"]["user_hash"] == HASHER.digest("otel\x00carol")
