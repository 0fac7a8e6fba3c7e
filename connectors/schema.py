"""Wire format of trace and feedback events, and the parser for raw Kafka values.

Contract: docs/architecture.md §3. A trace event (topic ``hourglass.traces``, schema tag
``hourglass.trace/v2``, or ``hourglass.trace/v1`` without the conversation fields) is one
served assistant turn; a feedback event (topic ``hourglass.feedback``, tag
``hourglass.feedback/v1``) carries user signals about a trace, joined later by ``trace_id``.

``hourglass.trace/v2`` adds optional conversation fields to v1: ``tools`` (the function tools
offered), ``completion_tool_calls``, ``finish_reason``, ``prompt_token_ids`` (what vLLM
rendered), ``usage``, ``conversation_id``, ``turn`` and ``parent_trace_id``; chat messages may
carry ``tool_calls`` (assistant) and ``tool_call_id`` (tool). A v1 event is read as before
(those fields absent); a v1 event that carries one of them is a schema violation that names
the tag to use.

:func:`parse_record` turns the raw bytes of one Kafka record into an event or
a :class:`Rejected` value (a dead-letter reason); it never raises on bad
input, so one bad record cannot stop a consumer.

Timestamps (``ts``): an RFC 3339 string (``2026-01-31T07:00:00Z``; no offset
means UTC) or a JSON number of epoch **milliseconds** (``1767225600000``).
Strings of digits (``"1767225600"``) are refused as schema violations: the
same digits would otherwise mean seconds as a string and milliseconds as a
number. When a :class:`TsWindow` is given (the ingest worker always gives
one), an event whose ``ts`` is older than ``buffer.max_event_age_s`` or newer
than now + ``buffer.max_clock_skew_s`` is refused as ``ts_out_of_range``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

TRACE_SCHEMA_V1: Final = "hourglass.trace/v1"
TRACE_SCHEMA: Final = "hourglass.trace/v2"  # what Hourglass writes; v1 is still read
TRACE_SCHEMAS = (TRACE_SCHEMA_V1, TRACE_SCHEMA)
FEEDBACK_SCHEMA: Final = "hourglass.feedback/v1"
KNOWN_SCHEMAS = (*TRACE_SCHEMAS, FEEDBACK_SCHEMA)
# Conversation fields of hourglass.trace/v2 (absent in v1), in stored column order.
CONVERSATION_FIELDS: Final = (
    "tools",
    "completion_tool_calls",
    "finish_reason",
    "prompt_token_ids",
    "conversation_id",
    "turn",
    "parent_trace_id",
    "usage",
)
MAX_TRACE_TOOLS = 256  # tools offered, and tool calls of one message or answer, in one trace
MAX_ID_CHARS = 256  # trace, conversation and tool call ids
# The chat roles a trace may hold (OpenAI's, "developer" included); chat templates know no others.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_TOOL_NAME_CHARS = 256
SIGNAL_FIELDS = ("reward", "thumbs", "rating", "edited", "regenerated")

# Dead-letter reason codes (stable strings; `hourglass dlq list` shows them).
OVERSIZE = "oversize"
NOT_UTF8 = "not_utf8"
INVALID_JSON = "invalid_json"
NOT_AN_OBJECT = "not_an_object"
UNKNOWN_SCHEMA = "unknown_schema"
NON_FINITE_REWARD = "non_finite_reward"
SCHEMA_VIOLATION = "schema_violation"
EMPTY_VALUE = "empty_value"
UNMATCHED_FEEDBACK = "unmatched_feedback"
INVALID_UNICODE = "invalid_unicode"  # a lone surrogate (\ud800 in JSON) or other text UTF-8 cannot encode
TS_OUT_OF_RANGE = "ts_out_of_range"
OVERSIZE_CORRECTION = "oversize_correction"
HIDDEN_CHARACTERS = "hidden_characters"  # a correction holding invisible format or control characters
PARSE_ERROR = "parse_error"  # last resort: the parser itself failed on this record (a bug; the record is kept)
UNDECODABLE_RECORD = "undecodable_record"  # Kafka could not decode the record batch (codec, corruption)
NESTING_TOO_DEEP = "nesting_too_deep"  # arrays/objects nested past the JSON parser's recursion limit

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # range of the stored token-id column
FLOAT32_MAX = 3.4028234663852886e38  # largest finite float32: the stored logprob column's range


def content_text(content: Any) -> str:
    """A chat message's content as one text: a string as is, OpenAI content parts -> their ``text`` parts
    joined by newlines (other parts, e.g. images, dropped), null or missing -> ``""``. The one reading of
    content every path shares (conversation hashes, implicit signals, chat rendering)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p["text"]
            for p in content
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    return ""


def _to_utc(value: Any) -> Any:
    """Epoch milliseconds (int) -> aware UTC datetime; strings are left to pydantic."""
    if isinstance(value, bool):
        raise ValueError("ts must be an RFC 3339 string or epoch milliseconds, not a boolean")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"ts {value!r} is not a finite epoch-milliseconds number")
        try:
            return datetime.fromtimestamp(value / 1000.0, tz=timezone.utc)
        except (OverflowError, OSError, ValueError) as err:  # pydantic reports only ValueError as invalid input
            raise ValueError(f"ts {value!r} epoch milliseconds is out of the supported date range: {err}") from err
    if isinstance(value, str) and _NUMERIC.fullmatch(value.strip()):
        raise ValueError(
            f"ts {value!r} is a numeric string; send epoch milliseconds as a JSON number or an RFC 3339 string"
        )
    return value


_NUMERIC = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _aware_utc(value: datetime) -> datetime:
    # A timestamp without an offset is read as UTC (the contract says UTC).
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    try:
        return value.astimezone(timezone.utc)
    except OverflowError as err:  # e.g. 9999-12-31T23:59:59-01:00; pydantic reports only ValueError as invalid input
        raise ValueError(f"ts {value.isoformat()} is out of the supported date range in UTC") from err


def _not_bool(value: Any, name: str | None) -> Any:
    # pydantic's lax mode reads JSON true/false as 1/0 for int and float fields; a boolean is not a number here.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, not a boolean (got {str(value).lower()})")
    return value


class FunctionCall(BaseModel):
    """The function a tool call calls: its name and its arguments as JSON text (as the model wrote them,
    which may not parse: the tool-call rewards judge that)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(max_length=MAX_TOOL_NAME_CHARS, description="The function name the model called.")
    arguments: str = Field(description="The arguments, JSON text as generated.")


class ToolCall(BaseModel):
    """One OpenAI tool call: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(default="", max_length=MAX_ID_CHARS, description="The call id (empty when the source had none).")
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    """A function tool offered to the model (OpenAI's ``tools[i].function``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="The arguments' JSON Schema.")
    strict: bool | None = Field(default=None, strict=True)

    @field_validator("parameters")
    @classmethod
    def _json_numbers(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and finite_or_null(value) is not value:
            raise ValueError("parameters holds a number JSON cannot carry (NaN, Infinity or beyond float range)")
        return value


class ToolDefinition(BaseModel):
    """One OpenAI tool definition: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class Usage(BaseModel):
    """Token counts of one answer, as the serving engine reported them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int | None = Field(default=None, ge=0, strict=True)
    completion_tokens: int | None = Field(default=None, ge=0, strict=True)


class ChatMessage(BaseModel):
    """One OpenAI-style chat message (``tool_calls`` on assistant messages, ``tool_call_id`` on tool results)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TRACE_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)

    @field_validator("role")
    @classmethod
    def _known_role(cls, value: str) -> str:
        if value not in CHAT_ROLES:
            raise ValueError(f"role {value[:64]!r} is not one of {sorted(CHAT_ROLES)}")
        return value


class _Signals(BaseModel):
    """Feedback signals, inline on a trace or in a feedback event."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # strict: a signal is training data, so "yes" / 1 for a flag, or "1" / 3.0 for a rating, is refused
    # (schema_violation), never read as true / 1 (pydantic's lax mode would).
    reward: float | None = Field(
        default=None, strict=True, description='Explicit scalar reward (a finite JSON number; "0.5" is refused).'
    )
    thumbs: Literal["up", "down"] | None = Field(default=None, description="Thumbs up / down.")
    rating: int | None = Field(
        default=None, ge=1, le=5, strict=True, description='Star rating 1..5 (a JSON integer; "3" and 3.0 are refused).'
    )
    edited: bool | None = Field(
        default=None, strict=True, description='The user edited the answer (JSON true/false only; "yes" is refused).'
    )
    regenerated: bool | None = Field(
        default=None, strict=True, description="The user asked for another answer (JSON true/false only)."
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="Free-form; user ids are hashed on ingest.")

    @field_validator("reward", "rating", mode="before")
    @classmethod
    def _no_bool(cls, value: Any, info: ValidationInfo) -> Any:
        return _not_bool(value, info.field_name)

    @field_validator("metadata")
    @classmethod
    def _hash_user_ids(cls, metadata: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # pydantic's JSON parser reads NaN, Infinity and 1e999; stored as such they would not be JSON: null instead
        metadata = finite_or_null(metadata)
        hasher = (info.context or {}).get("hasher")
        return hasher(metadata) if hasher is not None and metadata else metadata

    def signals(self) -> dict[str, Any]:
        """The signals that are present (not None), by name."""
        return {name: getattr(self, name) for name in SIGNAL_FIELDS if getattr(self, name) is not None}


class TraceEvent(_Signals):
    """One served assistant turn (``hourglass.trace/v2``; ``hourglass.trace/v1`` = without the conversation fields)."""

    schema_: Literal["hourglass.trace/v1", "hourglass.trace/v2"] = Field(default=TRACE_SCHEMA, alias="schema")
    trace_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    ts: datetime = Field(description="When the completion was served (UTC).")
    model: str = Field(min_length=1, description="Served model name the client asked for.")
    adapter_version: str | None = Field(default=None, description="Adapter version that answered; None = base.")
    prompt: list[ChatMessage] | str = Field(description="Chat messages or plain text.")
    completion: str
    completion_token_ids: list[Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]] | None = Field(
        default=None, description="Token ids of the completion (stored as int32)."
    )
    completion_logprobs: list[float] | None = Field(default=None, description="Per-token natural-log probabilities.")
    # --- hourglass.trace/v2: the conversation (CONVERSATION_FIELDS) ---
    tools: list[ToolDefinition] | None = Field(
        default=None, max_length=MAX_TRACE_TOOLS, description="The function tools offered with the prompt."
    )
    completion_tool_calls: list[ToolCall] | None = Field(
        default=None, max_length=MAX_TRACE_TOOLS, description="The answer's tool calls."
    )
    finish_reason: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="Why generation stopped (OpenAI words: stop, length, tool_calls).",
    )
    prompt_token_ids: list[Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]] | None = Field(
        default=None, description="Token ids of the prompt as the serving engine rendered it (stored as int32)."
    )
    usage: Usage | None = Field(default=None, description="Token counts of the answer.")
    conversation_id: str | None = Field(
        default=None, min_length=1, max_length=MAX_ID_CHARS, description="The conversation this turn belongs to."
    )
    turn: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        strict=True,
        description="0-based index of this assistant turn: the assistant messages already in the prompt.",
    )
    parent_trace_id: str | None = Field(
        default=None, min_length=1, max_length=MAX_ID_CHARS, description="The trace whose answer this turn continues."
    )

    @field_validator("ts", mode="before")
    @classmethod
    def _ts_in(cls, value: Any) -> Any:
        return _to_utc(value)

    @field_validator("ts")
    @classmethod
    def _ts_out(cls, value: datetime) -> datetime:
        return _aware_utc(value)

    @field_validator("turn", mode="before")
    @classmethod
    def _turn_not_bool(cls, value: Any) -> Any:
        return _not_bool(value, "turn")

    @field_validator("completion_token_ids", "completion_logprobs", "prompt_token_ids", mode="before")
    @classmethod
    def _no_bools(cls, values: Any, info: ValidationInfo) -> Any:
        if isinstance(values, list):
            for i, value in enumerate(values):
                _not_bool(value, f"{info.field_name}.{i}")
        return values

    @field_validator("completion_logprobs")
    @classmethod
    def _finite_logprobs(cls, values: list[float] | None) -> list[float] | None:
        if values is not None and not all(math.isfinite(v) for v in values):
            raise ValueError("completion_logprobs must all be finite (got NaN or inf)")
        if values is not None and not all(abs(v) <= FLOAT32_MAX for v in values):
            raise ValueError(
                f"completion_logprobs must fit float32 (|x| <= {FLOAT32_MAX:.4g}); stored as float32 they would be infinite"
            )
        return values

    @model_validator(mode="after")
    def _aligned(self) -> "TraceEvent":
        ids, lps = self.completion_token_ids, self.completion_logprobs
        if ids is not None and lps is not None and len(ids) != len(lps):
            raise ValueError(f"completion_token_ids has {len(ids)} entries but completion_logprobs has {len(lps)}")
        if self.schema_ == TRACE_SCHEMA_V1:
            present = [name for name in CONVERSATION_FIELDS if getattr(self, name) is not None]
            if present:
                raise ValueError(f'{present[0]} is a field of {TRACE_SCHEMA}: tag the event "schema": "{TRACE_SCHEMA}"')
        return self

    def messages(self) -> list[dict[str, Any]]:
        """The prompt as chat messages; plain text becomes one user message."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [m.model_dump(exclude_none=True) for m in self.prompt]

    def to_json_bytes(self) -> bytes:
        """The event as it goes on the wire (UTF-8 JSON, RFC 3339 ``ts``)."""
        return self.model_dump_json(by_alias=True, exclude_none=True).encode("utf-8")


class FeedbackEvent(_Signals):
    """User feedback about one trace (``hourglass.feedback/v1``)."""

    schema_: Literal["hourglass.feedback/v1"] = Field(default=FEEDBACK_SCHEMA, alias="schema")
    trace_id: str = Field(min_length=1, max_length=256)
    ts: datetime | None = Field(default=None, description="When the feedback was given (UTC); default: ingest time.")
    correction: str | None = Field(
        default=None, description="The user's corrected answer (text); size-limited by buffer.max_correction_chars."
    )

    @field_validator("ts", mode="before")
    @classmethod
    def _ts_in(cls, value: Any) -> Any:
        return None if value is None else _to_utc(value)

    @field_validator("ts")
    @classmethod
    def _ts_out(cls, value: datetime | None) -> datetime | None:
        return None if value is None else _aware_utc(value)

    def to_json_bytes(self) -> bytes:
        """The event as it goes on the wire (UTF-8 JSON)."""
        return self.model_dump_json(by_alias=True, exclude_none=True).encode("utf-8")


Event = TraceEvent | FeedbackEvent
_ANY_EVENT: TypeAdapter[Event] = TypeAdapter(Annotated[Event, Field(discriminator="schema_")])


@dataclass(frozen=True)
class Rejected:
    """Why a record cannot be used: a reason code (see module constants) and a readable detail."""

    reason: str
    detail: str


_MIN_UTC = datetime.min.replace(tzinfo=timezone.utc)
_MAX_UTC = datetime.max.replace(tzinfo=timezone.utc)


def shift(when: datetime, seconds: float) -> datetime:
    """``when + seconds`` clamped to the datetime range (never raises OverflowError)."""
    try:
        return when + timedelta(seconds=seconds)
    except OverflowError:
        return _MAX_UTC if seconds > 0 else _MIN_UTC


@dataclass(frozen=True)
class TsWindow:
    """Event times accepted at ingest: ``[now - max_age_s, now + max_skew_s]`` (aware UTC datetimes).

    One policy for traces and feedback, from Kafka and from replays: an event
    outside the window would be deleted by the next retention pass (too old) or
    sit in the buffer ahead of every snapshot window (too new), so it is refused
    as ``ts_out_of_range`` instead, with the value and the accepted range.
    """

    earliest: datetime
    latest: datetime
    max_age_s: float
    max_skew_s: float

    @classmethod
    def around(cls, now: datetime, max_age_s: float, max_skew_s: float) -> "TsWindow":
        """The window around ``now`` (aware) for ``buffer.max_event_age_s`` / ``buffer.max_clock_skew_s``."""
        return cls(shift(now, -max_age_s), shift(now, max_skew_s), max_age_s, max_skew_s)

    def check(self, ts: datetime | None) -> Rejected | None:
        """None when ``ts`` is inside the window (or absent: feedback without ``ts`` takes the ingest time)."""
        if ts is None or self.earliest <= ts <= self.latest:
            return None
        return Rejected(
            TS_OUT_OF_RANGE,
            f"ts {ts.isoformat()} is outside the accepted range [{self.earliest.isoformat()}, {self.latest.isoformat()}] "
            f"(ingest time - buffer.max_event_age_s={self.max_age_s:g}, + buffer.max_clock_skew_s={self.max_skew_s:g}); "
            "send when the event happened in UTC (RFC 3339, or a JSON number of epoch milliseconds), "
            "fix the producer's clock, or raise buffer.max_event_age_s to backfill older events",
        )


def finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinite float (at any depth) replaced by None; the same object when none."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        out = {key: finite_or_null(item) for key, item in value.items()}
        return value if all(out[k] is value[k] for k in value) else out
    if isinstance(value, list):
        items = [finite_or_null(item) for item in value]
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


def unencodable_path(value: Any, path: str = "") -> str | None:
    """The path (``metadata.user_id``, ``prompt[0].content``) of the first string or key in a decoded JSON
    value that UTF-8 cannot encode (a lone surrogate such as ``"\\ud800"``); None when there is none."""
    if isinstance(value, str):
        return None if _encodable(value) else (path or "(value)")
    if isinstance(value, dict):
        for key, item in value.items():
            shown = key if _encodable(str(key)) else str(key).encode("utf-8", "backslashreplace").decode("utf-8")
            where = f"{path}.{shown}" if path else shown
            if shown != key:
                return where
            found = unencodable_path(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = unencodable_path(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class UserHasher:
    """Replaces user identifiers in metadata with ``hmac-sha256:<hex>`` (keyed, so not reversible
    by a dictionary attack without the key).

    Keys are matched case-insensitively at any depth of nested dicts/lists.
    Source: RFC 2104 HMAC with SHA-256 (``hmac`` stdlib).
    """

    def __init__(self, key: bytes | str, id_keys: Iterable[str]) -> None:
        self._keyed = hmac.new(key.encode("utf-8") if isinstance(key, str) else key, digestmod=hashlib.sha256)
        self._id_keys = frozenset(k.lower() for k in id_keys)
        # The same users come back batch after batch: remember recent digests (bounded, per hasher).
        self._digest_text = functools.lru_cache(maxsize=4096)(self._digest_text)  # type: ignore[method-assign]

    def derive(self, label: str) -> bytes:
        """A key of its own for another use of this hasher's secret: ``HMAC(key, label)`` (32 bytes), so a
        digest made for one use (conversation ids, say) never equals a user hash of the same text."""
        mac = self._keyed.copy()
        mac.update(b"\x00derive\x00" + label.encode("utf-8"))
        return mac.digest()

    def digest(self, value: Any) -> str:
        """``hmac-sha256:<hex>`` of a value (strings as UTF-8, anything else as sorted-key JSON); never raises
        (text UTF-8 cannot encode, such as a lone surrogate, is hashed with its surrogates passed through)."""
        if isinstance(value, str):
            return self._digest_text(value)
        try:
            text = json.dumps(value, sort_keys=True)
        except (TypeError, ValueError):  # not JSON data (keys of mixed types, cycles): hash its repr
            text = repr(value)
        return self._digest_text(text)

    def _digest_text(self, text: str) -> str:
        mac = self._keyed.copy()  # cheaper than re-keying per value
        mac.update(text.encode("utf-8", "surrogatepass"))
        return "hmac-sha256:" + mac.hexdigest()

    def __call__(self, metadata: Any) -> Any:
        if isinstance(metadata, dict):
            out = {}
            for k, v in metadata.items():
                if isinstance(k, str) and k.lower() in self._id_keys and v is not None:
                    out[k] = self.digest(v)
                else:
                    out[k] = self(v) if isinstance(v, (dict, list)) else v
            return out
        if isinstance(metadata, list):
            return [self(v) if isinstance(v, (dict, list)) else v for v in metadata]
        return metadata


def _first_error(err: ValidationError) -> str:
    problems = []
    for e in err.errors()[:5]:
        loc = ".".join(str(p) for p in e["loc"]) or "(event)"
        problems.append(f"{loc}: {e['msg']}")
    more = f" (+{err.error_count() - 5} more)" if err.error_count() > 5 else ""
    return "; ".join(problems) + more


def parse_record(
    value: bytes | None,
    *,
    max_record_bytes: int,
    hasher: UserHasher,
    window: TsWindow | None = None,
    max_correction_chars: int | None = None,
) -> Event | Rejected:
    """Parse one Kafka record value into an event, or say why it is unusable.

    Args:
        value: the raw record value (None for a tombstone).
        max_record_bytes: larger values are rejected as ``oversize``.
        hasher: applied to ``metadata`` of valid events (user ids hashed).
        window: accepted ``ts`` range (None: any representable time).
        max_correction_chars: a feedback ``correction`` longer than this (characters) is rejected.

    Returns:
        A :class:`TraceEvent` / :class:`FeedbackEvent`, or a :class:`Rejected`
        with one of the reason codes ``empty_value``, ``oversize``,
        ``not_utf8``, ``invalid_json``, ``invalid_unicode``, ``not_an_object``,
        ``unknown_schema``, ``non_finite_reward``, ``schema_violation``,
        ``oversize_correction``, ``hidden_characters``, ``ts_out_of_range``, ``nesting_too_deep``. Never raises
        on bad input.
    """
    if not value:
        return Rejected(EMPTY_VALUE, "record has no value (tombstone or empty); expected a JSON event")
    if len(value) > max_record_bytes:
        return Rejected(OVERSIZE, f"record is {len(value)} bytes, above kafka.max_record_bytes={max_record_bytes}")
    try:  # fast path: one pass of pydantic-core's JSON parser for the (usual) valid record
        event: Event = _ANY_EVENT.validate_json(value, context={"hasher": hasher})  # hashes user ids
    except ValidationError as err:
        if any(e["type"] == "json_invalid" and "recursion limit" in e["msg"] for e in err.errors()):
            return _too_deep(err.errors()[0]["msg"])
        return _diagnose(value)  # slow path: say precisely what is wrong
    if event.reward is not None and not math.isfinite(event.reward):
        return Rejected(
            NON_FINITE_REWARD, f"reward is {event.reward!r} (NaN or infinite); rewards must be finite numbers"
        )
    if isinstance(event, FeedbackEvent):
        refused = correction_refused(event.correction, max_correction_chars)
        if refused is not None:
            return refused
    rejected = window.check(event.ts) if window is not None else None
    return rejected or event


# Code points a reader cannot see: Unicode's Default_Ignorable_Code_Point ranges (DerivedCoreProperties:
# soft hyphen, combining grapheme joiner, Hangul and Mongolian fillers and selectors, zero-width characters,
# bidirectional controls, invisible operators, variation selectors, the byte-order mark, the tag characters
# of "ASCII smuggling"), the blank braille cell, the musical null notehead, and noncharacters. With Cc and Cf (control and format
# characters) they are what :func:`hidden_characters` refuses, but for the few uses below.
_IGNORABLE = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x2800, 0x2800),
    (0x3164, 0x3164),
    (0xFDD0, 0xFDEF),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D159, 0x1D159),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
_JOINERS = frozenset("\u200c\u200d")  # zero-width non-joiner and joiner: Persian, Indic scripts, emoji sequences
_DIRECTION_MARKS = frozenset("\u200e\u200f\u061c")  # left-to-right, right-to-left and Arabic letter marks
_PRESENTATION = frozenset("\ufe0e\ufe0f")  # text and emoji presentation selectors
_IGNORABLE_RE = re.compile("[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in _IGNORABLE) + "]")
_KEYCAP_BASES = frozenset("0123456789#*")  # "7\ufe0f\u20e3": a keycap emoji


def _ignorable(c: str) -> bool:
    """Whether ``c`` draws nothing (or is no character): see :data:`_IGNORABLE`."""
    if " " <= c <= "~":  # printable ASCII: most of any text
        return False
    if (ord(c) & 0xFFFE) == 0xFFFE:  # U+FFFE, U+FFFF and their copies in every plane: noncharacters
        return True
    return unicodedata.category(c) in ("Cc", "Cf") or _IGNORABLE_RE.match(c) is not None


def hidden_characters(text: str) -> list[str]:
    """The characters of ``text`` a reader cannot see and a correction may not hold, as ``U+200B``-style names in order,
    each once: control characters but tab, newline and a carriage return before a newline; format characters;
    Unicode's default-ignorable code points, the blank braille cell, the musical null notehead and
    noncharacters. Allowed where a script needs them, one at a time (never next to another such character):

    - a joiner (U+200C, U+200D) between two visible non-ASCII characters (Persian and Indic words, emoji
      sequences; after an emoji's presentation selector too);
    - a direction mark (U+200E, U+200F, U+061C) in a text holding right-to-left letters;
    - a presentation selector (U+FE0E, U+FE0F) after a visible non-ASCII character, or in a keycap
      (``0-9 # *``, the selector, U+20E3).

    Anything else of them could spell a hidden message in a text that reads as the answer. What stays: one
    joiner per gap between non-ASCII characters, one mark per gap in right-to-left text, one selector per
    non-ASCII character (a bit or so each), and what is visible but alike (look-alike letters, space
    variants, combining sequences); refused with the rest: the zero-width space some Khmer, Thai, Lao or
    Myanmar text puts between words, the isolates and embeddings some apps wrap right-to-left text in, soft
    hyphens, a leading byte-order mark, Mongolian variation selectors, ideographic variation sequences and
    the flags of subdivisions (tag sequences)."""
    ignorable = [_ignorable(c) for c in text]  # once per character: the rules below read neighbours
    rtl = any(unicodedata.bidirectional(c) in ("R", "AL") and not ig for c, ig in zip(text, ignorable))  # RLM is R

    def at(i: int) -> str:
        return text[i] if 0 <= i < len(text) else ""

    def hidden_kind(i: int) -> bool:
        return 0 <= i < len(text) and ignorable[i]

    def visible(i: int) -> bool:  # a non-ASCII character that draws something
        c = at(i)
        return bool(c) and not ignorable[i] and not c.isspace() and not c.isascii()

    found: dict[str, None] = {}
    for i, c in enumerate(text):
        if not ignorable[i] or c in "\t\n" or (c == "\r" and at(i + 1) == "\n"):
            continue
        if c in _JOINERS:
            after_selector = at(i - 1) in _PRESENTATION and visible(i - 2)  # an emoji, its selector, the joiner
            if (visible(i - 1) or after_selector) and visible(i + 1):
                continue
        elif c in _DIRECTION_MARKS:
            if rtl and not hidden_kind(i - 1) and not hidden_kind(i + 1):  # no runs
                continue
        elif c in _PRESENTATION:
            keycap = at(i - 1) in _KEYCAP_BASES and at(i + 1) == "\u20e3"
            if (visible(i - 1) or keycap) and (not hidden_kind(i + 1) or at(i + 1) in _JOINERS):
                continue
        found[f"U+{ord(c):04X}"] = None
    return list(found)


def correction_refused(correction: str | None, max_chars: int | None) -> Rejected | None:
    """Why a feedback ``correction`` cannot be stored, else None: longer than ``max_chars`` characters
    (``oversize_correction``), or holding characters no reader sees (``hidden_characters``,
    :func:`hidden_characters`). The gateway answers the same verdicts with a 400 naming ``correction``."""
    if correction is None:
        return None
    if max_chars is not None and len(correction) > max_chars:
        return Rejected(
            OVERSIZE_CORRECTION,
            f"correction is {len(correction)} characters, above buffer.max_correction_chars={max_chars}; "
            "send a shorter correction or raise the limit",
        )
    hidden = hidden_characters(correction)
    if hidden:
        shown = ", ".join(hidden[:8]) + (f" and {len(hidden) - 8} more" if len(hidden) > 8 else "")
        return Rejected(
            HIDDEN_CHARACTERS,
            f"correction holds characters a reader cannot see ({shown}); send the answer as a reader sees it",
        )
    return None


def _too_deep(why: str) -> Rejected:
    return Rejected(
        NESTING_TOO_DEEP,
        f"record nests arrays/objects deeper than the JSON parser allows (about 200 levels; {why}); "
        "flatten the nested values (usually in metadata)",
    )


def _diagnose(value: bytes) -> Rejected:
    """Why a record that failed validation is unusable (checks in order, first problem wins)."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as err:
        return Rejected(NOT_UTF8, f"record is not UTF-8: {err}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        return Rejected(INVALID_JSON, f"record is not valid JSON: {err}")
    except RecursionError as err:
        return _too_deep(str(err))
    except ValueError as err:  # an integer of more digits than Python reads (sys.get_int_max_str_digits)
        return Rejected(INVALID_JSON, f"record has a number that cannot be read: {str(err)[:200]}")
    bad_text = unencodable_path(data)
    if bad_text is not None:
        return Rejected(
            INVALID_UNICODE,
            f"{bad_text}: text that UTF-8 cannot encode (a lone UTF-16 surrogate escape such as \\ud800); "
            "send valid Unicode (surrogates only in pairs)",
        )
    if not isinstance(data, dict):
        return Rejected(
            NOT_AN_OBJECT, f"record is a JSON {type(data).__name__}, expected an object with a 'schema' tag"
        )
    tag = data.get("schema")
    if tag not in KNOWN_SCHEMAS:
        return Rejected(UNKNOWN_SCHEMA, f"schema {tag!r} is not one of {list(KNOWN_SCHEMAS)}")
    reward = data.get("reward")
    if isinstance(reward, float) and not math.isfinite(reward):
        return Rejected(NON_FINITE_REWARD, f"reward is {reward!r} (NaN or infinite); rewards must be finite numbers")
    model = TraceEvent if tag in TRACE_SCHEMAS else FeedbackEvent
    try:
        model.model_validate(data)
    except ValidationError as err:
        return Rejected(SCHEMA_VIOLATION, f"{tag}: {_first_error(err)}")
    return Rejected(
        SCHEMA_VIOLATION, f"{tag}: the record does not validate as JSON (duplicate keys or non-standard numbers?)"
    )
