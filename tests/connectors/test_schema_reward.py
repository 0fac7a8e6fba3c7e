"""Unit tests of the pure logic: event parsing, dead-letter reasons, user-id hashing, reward mapping."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from connectors import schema as s
from connectors.config import RewardSpec
from connectors.reward import merge_signals, reward_from_signals

HASHER = s.UserHasher("secret", ["user", "user_id", "email"])


def _trace(**over: object) -> dict:
    base = {
        "schema": s.TRACE_SCHEMA,
        "trace_id": "t1",
        "ts": "2026-01-02T03:04:05Z",
        "model": "m",
        "adapter_version": None,
        "prompt": "hello",
        "completion": "hi",
    }
    base.update(over)
    return base


def _parse(obj: object, max_bytes: int = 10_000) -> s.Event | s.Rejected:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return s.parse_record(raw, max_record_bytes=max_bytes, hasher=HASHER)


def test_trace_parses_rfc3339_and_epoch_ms_to_same_utc_time() -> None:
    a = _parse(_trace(ts="2026-01-02T05:04:05+02:00"))
    b = _parse(_trace(ts=int(datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc).timestamp() * 1000)))
    assert isinstance(a, s.TraceEvent) and isinstance(b, s.TraceEvent)
    assert a.ts == b.ts == datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert a.ts.tzinfo == timezone.utc


def test_plain_text_prompt_becomes_one_user_message() -> None:
    event = _parse(_trace(prompt="what is 2+2?"))
    assert isinstance(event, s.TraceEvent)
    assert event.messages() == [{"role": "user", "content": "what is 2+2?"}]
    chat = _parse(_trace(prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]))
    assert isinstance(chat, s.TraceEvent)
    assert [m["role"] for m in chat.messages()] == ["system", "user"]


def test_user_identifiers_are_hashed_with_hmac_at_any_depth() -> None:
    event = _parse(_trace(metadata={"user": "alice", "session": {"Email": "a@x.org"}, "task": "add"}))
    assert isinstance(event, s.TraceEvent)
    md = event.metadata
    assert md["task"] == "add"
    assert md["user"].startswith("hmac-sha256:") and "alice" not in md["user"]
    assert md["session"]["Email"].startswith("hmac-sha256:")
    # keyed: same input, same key -> same digest; another key -> another digest
    assert md["user"] == HASHER.digest("alice") != s.UserHasher("other", ["user"]).digest("alice")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", s.EMPTY_VALUE),
        (b"{not json", s.INVALID_JSON),
        (b"\xff\xfe\x00garbage", s.NOT_UTF8),
        (b"[1, 2]", s.NOT_AN_OBJECT),
        (json.dumps(_trace(schema="hourglass.trace/v9")).encode(), s.UNKNOWN_SCHEMA),
        (json.dumps(_trace()).replace('"hi"', '"hi", "reward": NaN').encode(), s.NON_FINITE_REWARD),
        (json.dumps(_trace()).replace('"hi"', '"hi", "reward": 1e999').encode(), s.NON_FINITE_REWARD),
        (json.dumps({k: v for k, v in _trace().items() if k != "completion"}).encode(), s.SCHEMA_VIOLATION),
        (json.dumps(_trace(rating=7)).encode(), s.SCHEMA_VIOLATION),
        (json.dumps(_trace(completion_token_ids=[1, 2], completion_logprobs=[-0.1])).encode(), s.SCHEMA_VIOLATION),
        (json.dumps(_trace(completion="x" * 5000)).encode(), s.OVERSIZE),
    ],
)
def test_bad_records_are_rejected_with_reason(raw: bytes, reason: str) -> None:
    result = s.parse_record(raw, max_record_bytes=4096, hasher=HASHER)
    assert isinstance(result, s.Rejected)
    assert result.reason == reason
    assert result.detail


def test_an_integer_too_long_to_read_is_invalid_json_not_a_parser_failure() -> None:
    raw = json.dumps(_trace()).replace('"hi"', '"hi", "reward": ' + "9" * 5000).encode()
    result = s.parse_record(raw, max_record_bytes=1 << 20, hasher=HASHER)
    # was a ValueError out of the slow path: ingest stored it as parse_error, "please report it"
    assert isinstance(result, s.Rejected) and result.reason == s.INVALID_JSON and "4300" in result.detail


def test_schema_violation_names_the_field() -> None:
    result = _parse({k: v for k, v in _trace().items() if k != "completion"})
    assert isinstance(result, s.Rejected) and "completion" in result.detail


@pytest.mark.parametrize("role", ["banana", "function", "USER", "model"])
def test_a_message_role_no_chat_template_knows_is_a_schema_violation(role: str) -> None:
    result = _parse(_trace(prompt=[{"role": role, "content": "hi"}]))
    assert isinstance(result, s.Rejected) and result.reason == s.SCHEMA_VIOLATION, result
    assert "role" in result.detail and repr(role) in result.detail


def test_feedback_event_and_wire_round_trip() -> None:
    fb = _parse({"schema": s.FEEDBACK_SCHEMA, "trace_id": "t1", "thumbs": "down", "ts": 1_700_000_000_000})
    assert isinstance(fb, s.FeedbackEvent) and fb.signals() == {"thumbs": "down"}
    again = s.parse_record(fb.to_json_bytes(), max_record_bytes=10_000, hasher=HASHER)
    assert again == fb
    trace = _parse(_trace(completion_token_ids=[5, 6], completion_logprobs=[-0.5, -1.25], reward=0.5))
    assert isinstance(trace, s.TraceEvent)
    assert s.parse_record(trace.to_json_bytes(), max_record_bytes=10_000, hasher=s.UserHasher("k", [])) == trace


SPEC = RewardSpec()


@pytest.mark.parametrize(
    ("signals", "expected"),
    [
        ({}, (None, None)),
        ({"reward": 0.25}, (0.25, "reward")),
        ({"reward": 0.25, "thumbs": "down"}, (0.25, "reward")),
        ({"thumbs": "up"}, (1.0, "thumbs")),
        ({"thumbs": "down"}, (-1.0, "thumbs")),
        ({"rating": 5}, (1.0, "rating")),
        ({"rating": 1}, (-1.0, "rating")),
        ({"rating": 3}, (0.0, "rating")),
        ({"thumbs": "up", "edited": True}, (0.5, "thumbs+edited")),
        ({"edited": True, "regenerated": True}, (-1.0, "edited+regenerated")),
        ({"edited": False}, (None, None)),
        ({"reward": 50.0}, (1.0, "reward")),  # default clip 1.0: rewards stay on the thumbs scale
        ({"reward": -3.0, "edited": True}, (-1.0, "reward+edited")),
    ],
)
def test_reward_spec_mapping(signals: dict, expected: tuple) -> None:
    assert reward_from_signals(signals, SPEC) == expected


def test_reward_clip_is_configurable() -> None:
    assert reward_from_signals({"reward": 50.0}, RewardSpec(clip=10.0)) == (10.0, "reward")


def test_reward_spec_priority_is_configurable() -> None:
    spec = RewardSpec(priority=["rating", "thumbs"], thumbs_up=0.7)
    assert reward_from_signals({"thumbs": "up", "rating": 2}, spec) == (-0.5, "rating")
    assert reward_from_signals({"thumbs": "up", "reward": 3.0}, spec) == (0.7, "thumbs")


def test_later_feedback_wins_and_duplicates_change_nothing() -> None:
    t0, t1 = datetime(2026, 1, 1, tzinfo=timezone.utc), datetime(2026, 1, 2, tzinfo=timezone.utc)
    merged = merge_signals({"thumbs": "up"}, [(t1, {"thumbs": "down"}), (t0, {"rating": 4}), (t1, {"thumbs": "down"})])
    assert merged == {"thumbs": "down", "rating": 4}


@pytest.mark.parametrize(
    "over",
    [
        {"rating": True},  # would be read as 1 star: reward -1 for a client that meant "liked"
        {"reward": True},
        {"reward": False},
        {"completion_token_ids": [True, False], "completion_logprobs": [-0.1, -0.2]},
        {"completion_logprobs": [False, -0.2], "completion_token_ids": [1, 2]},
    ],
)
def test_json_booleans_are_not_numbers(over: dict) -> None:
    """A JSON ``true`` is not the number 1 (pydantic's lax mode would coerce it), on traces and feedback
    alike; the fast path refuses them too, so both paths dead-letter them naming the field."""
    from connectors.fast_parse import parse_batch

    events = [_trace(**over)]
    if "rating" in over or "reward" in over:
        events.append({"schema": s.FEEDBACK_SCHEMA, "trace_id": "t1", **over})
    for event in events:
        result = _parse(event)
        assert isinstance(result, s.Rejected) and result.reason == s.SCHEMA_VIOLATION, result
        assert "bool" in result.detail and next(iter(over)) in result.detail

        class Rec:
            topic, partition, offset, key, value = "t", 0, 7, None, json.dumps(event).encode()

        batch = parse_batch([Rec()], max_record_bytes=10_000, hasher=HASHER)
        assert (
            batch.traces == []
            and batch.feedback == []
            and [d.reason for d in batch.dead_letters] == [s.SCHEMA_VIOLATION]
        )


@pytest.mark.parametrize(
    "over",
    [
        {"edited": "yes"},  # was read as edited=True: a reward the user never gave
        {"edited": "false"},
        {"edited": 1},
        {"regenerated": "true"},
        {"rating": "1"},  # was read as 1 star
        {"rating": 3.0},
        {"reward": "0.5"},
    ],
)
def test_signals_are_type_strict_on_both_parsers(over: dict) -> None:
    """A flag is JSON true/false, a rating a JSON integer, a reward a JSON number: any other form is a
    forgery or a mistake and is dead-lettered naming the field, never coerced (pydantic's lax mode would)."""
    from connectors.fast_parse import parse_batch

    for event in (_trace(**over), {"schema": s.FEEDBACK_SCHEMA, "trace_id": "t1", **over}):
        result = _parse(event)
        assert isinstance(result, s.Rejected) and result.reason == s.SCHEMA_VIOLATION, result
        assert next(iter(over)) in result.detail

        class Rec:
            topic, partition, offset, key, value = "t", 0, 7, None, json.dumps(event).encode()

        for fast in (True, False):
            batch = parse_batch([Rec()], max_record_bytes=10_000, hasher=HASHER, fast=fast)
            assert batch.traces == batch.feedback == [] and [d.reason for d in batch.dead_letters] == [
                s.SCHEMA_VIOLATION
            ]


def test_strict_signals_still_take_json_booleans_integers_and_integer_rewards() -> None:
    event = _parse({"schema": s.FEEDBACK_SCHEMA, "trace_id": "t1", "edited": False, "rating": 4, "reward": 1})
    assert isinstance(event, s.FeedbackEvent)
    assert event.signals() == {"reward": 1.0, "rating": 4, "edited": False}


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        ("42", []),
        ("line one\n\tline two\r\n", []),
        ("7\u200b", ["U+200B"]),  # zero-width space
        ("7\u200d", ["U+200D"]),  # a joiner after ASCII joins nothing
        ("\u200d\u0645", ["U+200D"]),  # nor one at an end
        ("\u0645\u06cc\u200c\u062e\u0648\u0627\u0645", []),  # Persian: the non-joiner between letters is kept
        ("\u0915\u094d\u200d\u0937", []),  # Devanagari: a joiner between non-ASCII letters is kept
        ("\u0645\u200c\u200c\u0645", ["U+200C"]),  # a run of joiners spells bits
        ("\U0001f469\u200d\U0001f4bb", []),  # an emoji ZWJ sequence
        ("\U0001f441\ufe0f\u200d\U0001f5e8\ufe0f", []),  # with presentation selectors inside it
        ("7\ufe0f\u20e3", []),  # a keycap: 7, emoji presentation, enclosing keycap
        ("\U0001f600\ufe0f\ufe0f", ["U+FE0F"]),  # two selectors in a row
        ("\U0001f600\ufe01", ["U+FE01"]),  # a selector no emoji uses
        ("8 \u200f- 3", ["U+200F"]),  # a direction mark without right-to-left letters reorders what is drawn
        ("\u05e9\u05dc\u05d5\u05dd \u200f8", []),  # in Hebrew text it is what the writer needs
        ("8\u202e12", ["U+202E"]),  # a right-to-left override
        ("\U000e0069\U000e0067 8\U000e0069", ["U+E0069", "U+E0067"]),  # tag characters, each named once
        ("\u3164", ["U+3164"]),  # Hangul filler
        ("\u2800", ["U+2800"]),  # blank braille cell
        ("\u2065", ["U+2065"]),  # unassigned but default-ignorable
        ("8\uffff", ["U+FFFF"]),  # a noncharacter
        ("\x00\x7f\x85", ["U+0000", "U+007F", "U+0085"]),  # control characters
        ("\u00ad", ["U+00AD"]),  # soft hyphen
        ("\uff17 \u00e9 e\u0301 \u2028", []),  # visible: fullwidth 7, accents (precomposed, combining), separator
        ("\u0645\u200d7", ["U+200D"]),  # a joiner before ASCII
        ("\u0645\u200c \u0645", ["U+200C"]),  # or before a space
        ("\u05e9 7" + "\u200e\u200f\u061c" * 3, ["U+200E", "U+200F", "U+061C"]),  # a run of marks spells bits
        ("\u0627\u061c8", []),  # one Arabic letter mark
        ("T\ufe0eh\ufe0fe 7\ufe0e", ["U+FE0E", "U+FE0F"]),  # selectors after letters draw nothing
        ("\u2764\ufe0f \u263a\ufe0e", []),  # emoji and text presentation of symbols
        ("a\rb", ["U+000D"]),  # a lone carriage return: what follows overwrites what went before in a terminal
        ("7\U0001d159", ["U+1D159"]),  # musical null notehead: drawn blank
        ("\u034f\u17b4\u180b\u115f\uffa0\ufdd0", ["U+034F", "U+17B4", "U+180B", "U+115F", "U+FFA0", "U+FDD0"]),
        ("\u8fbb\U000e0100", ["U+E0100"]),  # an ideographic variation sequence: refused (documented)
        ("\u1781\u17d2\u1798\u17c2\u179a\u200b\u1797\u17b6\u179f\u17b6", ["U+200B"]),  # Khmer's word gap: too
    ],
)
def test_hidden_characters_are_those_a_reader_cannot_see_but_where_a_script_needs_them(
    text: str, hidden: list[str]
) -> None:
    assert s.hidden_characters(text) == hidden


def test_a_correction_of_hidden_characters_is_dead_lettered_with_a_short_reason() -> None:
    many = "".join(chr(c) for c in range(0xE0000, 0xE1000))  # 4096 distinct hidden characters
    rejected = s.correction_refused(many, 4096)
    assert isinstance(rejected, s.Rejected) and rejected.reason == s.HIDDEN_CHARACTERS
    assert "U+E0000, U+E0001" in rejected.detail and "and 4088 more" in rejected.detail and len(rejected.detail) < 300
    assert s.correction_refused(many, 4095).reason == s.OVERSIZE_CORRECTION  # type: ignore[union-attr]
    assert s.correction_refused("8", 4096) is None and s.correction_refused(None, 1) is None
    feedback = json.dumps({"schema": s.FEEDBACK_SCHEMA, "trace_id": "t", "thumbs": "down", "correction": "7\u2060"})
    parsed = s.parse_record(feedback.encode(), max_record_bytes=1 << 20, hasher=HASHER, max_correction_chars=64)
    assert isinstance(parsed, s.Rejected) and parsed.reason == s.HIDDEN_CHARACTERS and "U+2060" in parsed.detail
