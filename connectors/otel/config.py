"""Typed settings of the OpenTelemetry trace source (:class:`OtelSourceConfig`, section ``[otel]``).

Every size a producer controls is bounded here: bytes per payload, spans per payload, events and
messages per span, bytes per attribute, JSON nesting, tool definitions, token ids. A payload or span
past a bound is refused with a reason code (see :mod:`connectors.otel.types`), never truncated.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from connectors.config import check_topic_name
from connectors.config_base import Section

Encoding = Literal["otlp_proto", "otlp_json", "auto"]
SignalName = Literal["reward", "thumbs", "rating", "edited", "regenerated"]


class OtelFeedbackRule(Section):
    """One OTel attribute that carries a user signal about an earlier GenAI span.

    A span or span event that has ``attribute`` (and, when ``evaluation_name`` is set, a
    ``gen_ai.evaluation.name`` equal to it) becomes one ``hourglass.feedback/v1`` event for the GenAI
    span it points at: the GenAI span itself, or an event on it, points at that span; any other span (or an
    event on it) points at its first link, else at its parent span.
    """

    attribute: str = Field(
        min_length=1,
        max_length=256,
        description="Attribute that carries the signal, e.g. `feedback.thumbs` or `gen_ai.evaluation.score.value`.",
    )
    signal: SignalName = Field(
        description='The Hourglass signal the value stands for: `thumbs` ("up"/"down", true/false, or a number '
        "whose sign is the vote), `rating` (an integer 1..5; 4.0 counts as 4), `reward` (a number), `edited` / "
        "`regenerated` (true/false)."
    )
    evaluation_name: str | None = Field(
        default=None,
        max_length=256,
        description="Only items whose `gen_ai.evaluation.name` equals this count (e.g. `user_thumbs`); unset: any.",
    )
    score_min: float | None = Field(
        default=None,
        description='For `signal = "reward"`: the lowest score of the evaluator\'s scale, mapped linearly to -1 '
        "(with `score_max` to +1). Unset: the value is the reward as is (ingest clips it to buffer.reward.clip).",
    )
    score_max: float | None = Field(
        default=None, description='For `signal = "reward"`: the highest score, mapped to +1.'
    )

    @model_validator(mode="after")
    def _scale(self) -> "OtelFeedbackRule":
        if (self.score_min is None) != (self.score_max is None):
            raise ValueError("set both score_min and score_max, or neither")
        if self.score_min is not None and self.score_max is not None:
            if self.signal != "reward":
                raise ValueError(f"score_min/score_max apply to signal 'reward' only, not {self.signal!r}")
            if not self.score_min < self.score_max:
                raise ValueError(f"score_min={self.score_min} must be below score_max={self.score_max}")
        return self


class OtelSourceConfig(Section):
    """OpenTelemetry GenAI traces from Kafka: what the Collector's Kafka exporter writes, and how it is read.

    Inference spans (`gen_ai.operation.name` = `chat` or `text_completion`) become `hourglass.trace/v2`
    events; spans or events that carry a configured feedback attribute become `hourglass.feedback/v1`
    events. An OTel topic is a trusted producer, like the gateway: restrict who may write to it (topic ACLs).
    """

    topic: str = Field(
        default="otlp_spans",
        description="Topic the Collector's Kafka exporter writes spans to (its default is `otlp_spans`).",
    )
    encoding: Encoding = Field(
        default="otlp_proto",
        description="The exporter's `encoding`: `otlp_proto` (its default: an ExportTraceServiceRequest protobuf), "
        "`otlp_json` (OTLP/JSON), or `auto` (a value that starts with `{` is JSON, any other protobuf).",
    )
    user_id_attributes: list[str] = Field(
        default_factory=lambda: ["user.id", "enduser.id"],
        max_length=16,
        description="Attributes holding the end user's id, looked up in this order on the span, then on its "
        "resource; the first found goes to the event's `metadata.user`, which ingest replaces by its keyed hash.",
    )
    model_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Public model name the traces are filed under (the served model a round trains). Unset: the "
        "span's `gen_ai.request.model`, else `gen_ai.response.model`. The span's own names stay in metadata.otel.",
    )
    prompt_token_ids_attribute: str | None = Field(
        default="hourglass.prompt_token_ids",
        description="Span attribute (an int array) with the prompt's token ids, where an instrumentation or a span "
        "processor records them (the GenAI conventions define none). Unset: not read.",
    )
    completion_token_ids_attribute: str | None = Field(
        default="hourglass.completion_token_ids",
        description="Span attribute (an int array) with the first choice's token ids (see prompt_token_ids_attribute).",
    )
    feedback: list[OtelFeedbackRule] = Field(
        default_factory=list,
        max_length=32,
        description="Attributes that carry user feedback (array of tables); empty: no feedback is read from spans.",
    )
    max_payload_bytes: int = Field(
        default=1_048_576,
        ge=1024,
        description="Largest payload (one Kafka record value), bytes; the exporter's producer.max_message_bytes "
        "default (1000000) fits. Larger: rejected as `oversize`.",
    )
    max_spans_per_payload: int = Field(
        default=10_000,
        ge=1,
        description="Most spans in one payload; more: the payload is rejected as `too_many_spans` (lower the "
        "Collector's batch size).",
    )
    max_events_per_span: int = Field(
        default=512, ge=1, description="Most span events read on one span; more: `too_many_messages`."
    )
    max_messages_per_span: int = Field(
        default=256,
        ge=1,
        description="Most input messages (and output choices) of one span; more: `too_many_messages`.",
    )
    max_attribute_bytes: int = Field(
        default=262_144,
        ge=256,
        description="Largest value of one attribute the source reads (a JSON string, or a structured value's "
        "protobuf size), bytes; larger: the span is rejected as `oversize_attribute`.",
    )
    max_json_depth: int = Field(
        default=32,
        ge=4,
        le=512,
        description="Deepest nesting of a structured or JSON attribute value; deeper: `nesting_too_deep`.",
    )
    max_tools: int = Field(
        default=128,
        ge=1,
        description="Most tool definitions, and most tool calls in one message; more: `too_many_tools`.",
    )
    max_token_ids: int = Field(
        default=131_072, ge=1, description="Most token ids in one token-id attribute; more: `oversize_attribute`."
    )

    @field_validator("topic")
    @classmethod
    def _topic_name(cls, topic: str) -> str:
        return check_topic_name(topic)

    @field_validator("user_id_attributes")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        if any(not name or len(name) > 256 for name in names):
            raise ValueError("user_id_attributes must be attribute names of 1..256 characters")
        return names
