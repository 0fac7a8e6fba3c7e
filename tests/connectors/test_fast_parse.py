"""Unit tests of the batch parser: the msgspec fast path must store exactly what the pydantic reference stores."""

from __future__ import annotations

import json
import typing
import math
from dataclasses import dataclass
from datetime import datetime, timezone

import pytest

from connectors import schema as s
from connectors.fast_parse import _Message, parse_batch
from connectors.segments import to_json

HASHER = s.UserHasher("secret", ["user", "user_id", "email"])
MAX_BYTES = 4096
INGESTED = datetime(2026, 3, 4, 5, 6, 7, tzinfo=timezone.utc)
METADATA = -4  # the metadata column of a trace row (before topic, partition, offset)


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def _trace(i: int, **over: object) -> dict:
    event = {
        "schema": s.TRACE_SCHEMA,
        "trace_id": f"t{i}",
        "ts": "2026-01-02T03:04:05.123456Z",
        "model": "base",
        "adapter_version": "v1",
        "prompt": [{"role": "user", "content": f"what is {i}+1?"}],
        "completion": f"{i + 1}",
        "completion_token_ids": [5, 6, i],
        "completion_logprobs": [-0.25, -1.5, -3e-05],
        "metadata": {"user_id": f"u{i % 3}", "task": "add"},
    }
    event.update(over)
    return event


def _feedback(i: int, **over: object) -> dict:
    event = {"schema": s.FEEDBACK_SCHEMA, "trace_id": f"t{i}", "ts": 1767323045123, "thumbs": "up"}
    event.update(over)
    return event


def _enc(obj: object) -> bytes:
    return obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()


TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers é",
        "parameters": {"type": "object", "properties": {"a": {"type": "number", "minimum": -1.5e3}}},
        "strict": False,
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
CONVERSATION = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
]
# hourglass.trace/v2 records (and a v1 record whose messages carry tool calls) the fast path takes.
V2_FAST = [
    _trace(
        6,
        schema=s.TRACE_SCHEMA,
        prompt=CONVERSATION,
        tools=[TOOL],
        completion="",
        completion_tool_calls=[{**CALL, "id": "call_2"}, {"function": {"name": "", "arguments": "{not json"}}],
        finish_reason="tool_calls",
        prompt_token_ids=[1, 2, 3, 2**31 - 1],
        usage={"prompt_tokens": 4, "completion_tokens": 3},
        conversation_id="conv-abc",
        turn=1,
        parent_trace_id="t5",
    ),
    _trace(7, schema=s.TRACE_SCHEMA, usage={}, prompt_token_ids=[], tools=[{"function": {"name": "x"}}]),
    _trace(8, schema=s.TRACE_SCHEMA_V1, prompt=CONVERSATION[:3]),
    _trace(14, prompt=[{"role": "user", "content": "x", "name": "n"}, {"role": "system", "content": None}]),
]

# Records the fast path must take (canonical forms), then valid records it must leave to pydantic
# (lax or unusual forms), then one record per dead-letter reason and a few subtle invalid ones.
FAST = [
    _trace(0),
    _trace(1, ts="2026-01-02T05:04:05+02:00", reward=0.5, rating=4, edited=False, regenerated=True, thumbs="down"),
    _trace(2, ts=1767323045999, prompt="plain text é ✓ \u2028 \x01", adapter_version=None),
    _trace(3, metadata={"Email": "a@x.org", "nested": [{"user": "bob"}, 1, None, True], "score": 5e-05, "big": 2**70}),
    _trace(4, completion_token_ids=None, completion_logprobs=None, metadata={}, reward=-1),
    _trace(5, metadata={"note": "v1.2 release", "user": {"id": 7}}),
    *V2_FAST,
    _feedback(0),
    _feedback(1, ts=None, rating=2, reward=1, metadata={"user": "carol"}),
    _feedback(2, ts="2026-01-02T03:04:05Z", edited=True),
    _feedback(3, ts="2026-01-02T03:04:05Z", trace_id="x" * 256),
    _feedback(4, correction="the answer is 5, not 6 é \u2028", rating=1),
    _feedback(5, correction="x" * 64, thumbs=None, metadata={"user_hash": "hmac-sha256:ab"}),
]
SLOW_VALID = [
    _trace(10, ts="2026-01-02 03:04:05"),  # naive, space separator
    _trace(11, ts="2026-01-02T03:04:05.1234567Z"),  # more than microseconds
    _trace(12, ts=1767323045999.5),  # float epoch ms
    _trace(13, completion_token_ids=[1.0, 2, 3]),  # lax token ids
    _trace(15, prompt=[{"content": "reordered", "role": "user"}, {"role": "user", "content": [{"type": "text"}]}]),
    b'{"schema":"hourglass.feedback/v1","trace_id":"t12","schema":"hourglass.trace/v1","ts":0,"model":"m",'
    b'"prompt":"p","completion":"c"}',  # duplicate tag: the last one wins, as in pydantic
    _trace(18, schema=s.TRACE_SCHEMA, prompt_token_ids=[1.0, 2]),  # lax token ids
    _trace(19, schema=s.TRACE_SCHEMA, prompt=[{"role": "assistant", "content": "x", "reasoning_content": "r"}]),
]
BAD = [
    (s.EMPTY_VALUE, b""),
    (s.EMPTY_VALUE, None),
    (s.OVERSIZE, _enc(_trace(20, completion="x" * MAX_BYTES))),
    (s.NOT_UTF8, b'{"schema": "\xff\xfe"}'),
    (s.INVALID_JSON, b'{"schema": "hourglass.trace/v1", "trace_id": '),
    (s.NOT_AN_OBJECT, b'["a list"]'),
    (s.UNKNOWN_SCHEMA, _enc(_trace(21, schema="hourglass.trace/v9"))),
    (s.UNKNOWN_SCHEMA, _enc({k: v for k, v in _trace(22).items() if k != "schema"})),
    (s.NON_FINITE_REWARD, _enc(_trace(23, reward=float("nan")))),
    (s.NON_FINITE_REWARD, _enc(_feedback(24, reward=float("inf")))),
    (s.SCHEMA_VIOLATION, _enc(_trace(25, completion=None))),
    (s.SCHEMA_VIOLATION, _enc(_trace(26, completion_token_ids=[1, 2]))),  # not aligned with logprobs
    (s.SCHEMA_VIOLATION, _enc(_trace(27, completion_token_ids=[2**31, 1, 2]))),  # beyond the int32 column
    (s.SCHEMA_VIOLATION, _enc(_trace(28, trace_id="x" * 257))),
    (s.SCHEMA_VIOLATION, _enc(_trace(29, extra_field=1))),
    (s.SCHEMA_VIOLATION, _enc(_trace(30, thumbs="sideways", rating=9))),
    (s.SCHEMA_VIOLATION, _enc(_trace(31, metadata=["not", "a", "dict"]))),
    (s.SCHEMA_VIOLATION, _enc(_trace(32, ts="2026-13-02T03:04:05Z"))),
    (s.SCHEMA_VIOLATION, _enc(_trace(33, prompt=[{"role": "", "content": "x"}]))),
    (s.SCHEMA_VIOLATION, _enc(_trace(35, ts="9999-12-31T23:59:59-01:00"))),  # past datetime.max in UTC
    (s.SCHEMA_VIOLATION, _enc(_trace(36, ts=10**20))),  # epoch ms past datetime.max
    (s.SCHEMA_VIOLATION, _enc(_feedback(37, ts="1767323045"))),  # digits as a string: refused (ms or s?)
    (s.SCHEMA_VIOLATION, _enc(_trace(38, ts="-1000"))),
    (s.SCHEMA_VIOLATION, _enc(_feedback(39, correction=5))),
    # signals are strict: a string, number or float form is a forgery or a mistake, never read as the value
    (s.SCHEMA_VIOLATION, _enc(_trace(16, edited="true"))),
    (s.SCHEMA_VIOLATION, _enc(_trace(17, rating=5.0))),
    (s.SCHEMA_VIOLATION, _enc(_feedback(44, edited="yes"))),
    (s.SCHEMA_VIOLATION, _enc(_feedback(45, regenerated=1))),
    (s.SCHEMA_VIOLATION, _enc(_feedback(46, rating="1"))),
    (s.SCHEMA_VIOLATION, _enc(_feedback(47, reward="0.5"))),
    # conversation fields: only under hourglass.trace/v2, strict types, bounded
    (s.SCHEMA_VIOLATION, _enc(_trace(50, schema=s.TRACE_SCHEMA_V1, turn=1))),  # a v1 event with a v2 field
    (s.SCHEMA_VIOLATION, _enc(_trace(51, schema=s.TRACE_SCHEMA, turn=-1))),
    (s.SCHEMA_VIOLATION, _enc(_trace(52, schema=s.TRACE_SCHEMA, turn=True))),
    (s.SCHEMA_VIOLATION, _enc(_trace(53, schema=s.TRACE_SCHEMA, tools=[{"type": "code_interpreter"}]))),
    (s.SCHEMA_VIOLATION, _enc(_trace(54, schema=s.TRACE_SCHEMA, completion_tool_calls=[{**CALL, "x": 1}]))),
    (s.SCHEMA_VIOLATION, _enc(_trace(55, schema=s.TRACE_SCHEMA, usage={"prompt_tokens": "3"}))),
    (s.SCHEMA_VIOLATION, _enc(_trace(56, schema=s.TRACE_SCHEMA, prompt_token_ids=[2**31]))),
    (s.SCHEMA_VIOLATION, _enc(_trace(57, schema=s.TRACE_SCHEMA, conversation_id=""))),
    (
        s.SCHEMA_VIOLATION,
        _enc(_trace(59, schema=s.TRACE_SCHEMA, tools=[{"function": {"name": "x", "parameters": {"m": "@"}}}])).replace(
            b'"@"', b"1e999"
        ),
    ),
    (s.SCHEMA_VIOLATION, _enc(_trace(60, prompt=[{"role": "assistant", "tool_calls": [{"id": "c"}]}]))),
    (s.OVERSIZE_CORRECTION, _enc(_feedback(40, correction="y" * 65))),
    (s.HIDDEN_CHARACTERS, _enc(_feedback(44, correction="7\u2060"))),  # a word joiner: "7" to a reader
    (s.INVALID_UNICODE, _enc(_trace(41)).replace(b'"u2"', b'"\\ud800"').replace(b'"u1"', b'"\\ud800"')),
    (s.INVALID_UNICODE, _enc(_feedback(42, metadata={"note": "@"})).replace(b'"@"', b'"a\\udfffb"')),
    (s.INVALID_UNICODE, _enc(_trace(43, prompt="@")).replace(b'"@"', b'"\\ud83d"')),  # half an emoji
    (
        s.SCHEMA_VIOLATION,
        b'{"schema":"hourglass.trace/v1","trace_id":"t34","ts":"2026-01-02T03:04:05Z","model":"m",'
        b'"prompt":"p","completion":"c","completion_logprobs":[1e999]}',
    ),
]


def _batch() -> list[Record]:
    values = [_enc(v) for v in FAST + SLOW_VALID] + [raw for _, raw in BAD]
    order = sorted(range(len(values)), key=lambda i: (i * 7) % len(values))  # interleave good and bad
    return [Record("traces", i % 2, 100 + n, f"k{i}".encode(), values[i]) for n, i in enumerate(order)]


def test_fast_path_and_reference_store_identical_rows_and_dead_letters() -> None:
    records = _batch()
    fast = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER, max_correction_chars=64)
    slow = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER, fast=False, max_correction_chars=64)

    assert fast.fast == len(FAST) and slow.fast == 0  # the fast path really ran, and only on canonical records
    assert fast.traces == slow.traces and fast.feedback == slow.feedback
    assert fast.trace_table(INGESTED).equals(slow.trace_table(INGESTED))
    assert fast.feedback_table(INGESTED).equals(slow.feedback_table(INGESTED))
    assert fast.dead_letters == slow.dead_letters

    assert len(fast.traces) + len(fast.feedback) == len(FAST) + len(SLOW_VALID)
    expected = {raw: reason for reason, raw in BAD}
    by_coordinates = {(r.partition, r.offset): r for r in records}
    got = {by_coordinates[(letter.partition, letter.offset)].value: letter.reason for letter in fast.dead_letters}
    assert got == expected
    assert set(got.values()) == {
        s.EMPTY_VALUE,
        s.OVERSIZE,
        s.NOT_UTF8,
        s.INVALID_JSON,
        s.NOT_AN_OBJECT,
        s.UNKNOWN_SCHEMA,
        s.NON_FINITE_REWARD,
        s.SCHEMA_VIOLATION,
        s.OVERSIZE_CORRECTION,
        s.HIDDEN_CHARACTERS,
        s.INVALID_UNICODE,
    }
    for letter in fast.dead_letters:  # Kafka coordinates and key travel with the dead letter
        record = by_coordinates[(letter.partition, letter.offset)]
        assert (letter.topic, letter.key) == (record.topic, record.key)
        assert b'"user_id": "u' not in (letter.payload or b"")  # identifiers are hashed in stored payloads


def test_fast_rows_hash_user_ids_and_keep_record_order() -> None:
    records = [Record("traces", 0, n, None, _enc(v)) for n, v in enumerate(FAST)]
    batch = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER)
    assert batch.fallback == 0
    assert [row[0] for row in batch.traces][:6] == [f"t{i}" for i in range(6)]
    assert json.loads(batch.feedback[4][2]) == {
        "thumbs": "up",
        "rating": 1,
        "correction": "the answer is 5, not 6 é \u2028",
    }
    assert [row[-1] for row in batch.traces] == list(range(len(batch.traces)))  # offsets, in record order
    md = json.loads(batch.traces[3][METADATA])
    assert md["Email"] == HASHER.digest("a@x.org") and md["nested"][0]["user"] == HASHER.digest("bob")
    assert md["score"] == 5e-05 and md["big"] == 2**70
    assert json.loads(batch.traces[5][METADATA])["user"] == HASHER.digest({"id": 7})
    assert batch.traces[1][1] == datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert batch.feedback[1][1] is None  # no ts: the table fills in the ingest time
    assert batch.feedback_table(INGESTED)["ts"][1].as_py() == INGESTED


@pytest.mark.parametrize("value", [1e16, 1e-07, 5e-05, 0.1, -0.0, 123456789012345.6, 2**64, 'é\u2028\x00"\\'])
def test_to_json_matches_json_dumps(value: object) -> None:
    assert to_json({"v": [value]}) == json.dumps({"v": [value]}, ensure_ascii=False, separators=(",", ":"))


def _tables_equal(records: list[Record]) -> tuple[object, object]:
    fast = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER)
    slow = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER, fast=False)
    assert fast.trace_table(INGESTED).equals(slow.trace_table(INGESTED))
    assert fast.dead_letters == slow.dead_letters
    return fast, slow


def test_canonical_batch_carries_lists_as_arrow_columns_equal_to_the_reference() -> None:
    values = [_enc(v) for v in FAST]
    values.append(json.dumps(_trace(40, completion_token_ids=[], completion_logprobs=[])).encode())  # ", " separators
    values.append(_enc(_trace(41, completion_logprobs=None)))  # one list null, the other not
    extremes = {
        "completion_token_ids": [-0, 2**31 - 1, -(2**31)],
        "completion_logprobs": [-0.0, 1e-300, -3e38],
    }  # -3e38: float32 range
    values.append(_enc(_trace(42, **extremes)))
    fast, slow = _tables_equal([Record("traces", 0, n, None, v) for n, v in enumerate(values)])
    assert fast.token_ids is not None and fast.logprobs is not None and slow.token_ids is None
    assert fast.fallback == 0
    assert [row[:6] + row[8:11] + row[12:] for row in fast.traces] == [
        row[:6] + row[8:11] + row[12:] for row in slow.traces
    ]
    assert fast.token_ids.to_pylist() == [row[6] for row in slow.traces]
    assert fast.prompt_ids is not None and fast.prompt_ids.to_pylist() == [row[11] for row in slow.traces]
    assert [1, 2, 3, 2**31 - 1] in fast.prompt_ids.to_pylist()
    assert fast.token_ids.to_pylist()[-3:] == [[], [5, 6, 41], [0, 2**31 - 1, -(2**31)]]
    assert fast.logprobs.to_pylist()[-2] is None


def test_random_logprobs_read_by_arrow_equal_the_reference_float32_values() -> None:
    import random

    rng = random.Random(7)
    values = []
    for i in range(300):
        lps = [
            rng.choice([-rng.expovariate(0.3), -rng.random() * 10.0 ** rng.randint(-30, 30), -0.0]) for _ in range(5)
        ]
        values.append(
            _enc(
                _trace(
                    i, completion_token_ids=[rng.randrange(-(2**31), 2**31) for _ in range(5)], completion_logprobs=lps
                )
            )
        )
    fast, _ = _tables_equal([Record("traces", 0, n, None, v) for n, v in enumerate(values)])
    assert fast.logprobs is not None and fast.fallback == 0


@pytest.mark.parametrize(
    ("name", "text", "columns_kept"),
    [
        ("completion_token_ids", b"[1.0,2,3]", False),  # lax int: the reference accepts it as 1
        ("completion_token_ids", b"[2147483648,1,2]", False),  # int32 overflow: dead letter
        ("completion_logprobs", b"[1e999,0,0]", False),  # double overflow: dead letter
        ("completion_token_ids", b"[[1],[2],[3]]", False),
        ("completion_logprobs", b'["-1","-2","-3"]', False),
        ("completion_token_ids", b'"123"', True),  # not a list at all: that record alone goes to the reference
    ],
)
def test_an_odd_list_gets_the_reference_verdict(name: str, text: bytes, columns_kept: bool) -> None:
    value = _enc(_trace(9, **{name: "@"})).replace(b'"@"', text)
    records = [Record("traces", 0, n, None, _enc(_trace(n))) for n in range(5)] + [Record("traces", 0, 5, None, value)]
    fast, slow = _tables_equal(records)
    assert (fast.token_ids is not None) is columns_kept  # else: lists decoded record by record
    assert fast.fast == 5 and len(fast.traces) == len(slow.traces)


def test_dead_letters_keep_no_raw_user_ids() -> None:
    """A rejected record is stored with its user identifiers hashed, like the buffer's rows."""
    bad_schema = _trace(
        1, schema="hourglass.trace/v9", metadata={"user_id": "carol@example.com", "nested": {"email": "c@x.org"}}
    )
    no_ids = _trace(2, schema="hourglass.trace/v9", metadata={"task": "add"})
    records = [
        Record("traces", 0, 0, None, _enc(bad_schema)),
        Record("traces", 0, 1, None, _enc(no_ids)),
        Record("traces", 0, 2, None, b"\xff{user_id"),
    ]
    batch = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER)
    assert len(batch.dead_letters) == 3
    stored = json.loads(batch.dead_letters[0].payload)
    assert b"carol@example.com" not in batch.dead_letters[0].payload and b"c@x.org" not in batch.dead_letters[0].payload
    assert stored["metadata"] == {
        "user_id": HASHER.digest("carol@example.com"),
        "nested": {"email": HASHER.digest("c@x.org")},
    }
    assert batch.dead_letters[0].reason == s.UNKNOWN_SCHEMA
    assert batch.dead_letters[1].payload == _enc(no_ids)  # nothing to hash: the exact bytes are kept
    assert batch.dead_letters[2].payload == b"\xff{user_id"  # not JSON: kept for diagnosis


def test_lone_surrogates_are_invalid_unicode_with_the_field_path_and_never_raise() -> None:
    """Issue: a lone surrogate in metadata.user_id crashed the hasher (UnicodeEncodeError) and stopped ingest."""
    value = _enc(_trace(1, metadata={"user_id": "@", "deep": [{"k": "ok"}]})).replace(b'"@"', b'"\\ud800"')
    key_bad = _enc(_trace(2, metadata={"@": 1})).replace(b'"@"', b'"\\udc00"')
    records = [Record("traces", 0, 0, None, value), Record("traces", 0, 1, None, key_bad)]
    for fast in (True, False):
        batch = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER, fast=fast)
        assert [d.reason for d in batch.dead_letters] == [s.INVALID_UNICODE, s.INVALID_UNICODE]
        assert batch.dead_letters[0].detail.startswith("metadata.user_id: ")
        assert batch.dead_letters[1].detail.startswith("metadata.\\udc00: ")
        assert "duplicate keys" not in batch.dead_letters[0].detail
        payload = batch.dead_letters[0].payload
        assert payload is not None and b"\\ud800" not in payload  # the user id is hashed even here
        assert json.loads(payload)["metadata"]["user_id"].startswith("hmac-sha256:")
    assert HASHER.digest("\ud800").startswith("hmac-sha256:")  # the hasher itself never raises


def test_ts_window_dead_letters_too_old_and_too_new_events_on_both_paths() -> None:
    now = datetime(2026, 12, 1, tzinfo=timezone.utc)
    window = s.TsWindow.around(now, max_age_s=3600, max_skew_s=300)
    ms = int(now.timestamp() * 1000)
    cases = {
        "ok-now": (_trace(1, ts=ms), None),
        "ok-skew": (_trace(2, ts="2026-12-01T00:04:59Z"), None),
        "ok-fb-no-ts": (_feedback(3, ts=None), None),
        "old": (_trace(4, ts="2026-11-30T22:59:59Z"), s.TS_OUT_OF_RANGE),
        "future": (_trace(5, ts="9999-12-31T23:59:59Z"), s.TS_OUT_OF_RANGE),
        "year-1": (_trace(6, ts="0001-01-01T00:00:00Z"), s.TS_OUT_OF_RANGE),
        "zero": (_feedback(7, ts=0), s.TS_OUT_OF_RANGE),
        "negative": (_trace(8, ts=-1000), s.TS_OUT_OF_RANGE),
        "seconds-as-int": (_trace(9, ts=ms // 1000), s.TS_OUT_OF_RANGE),  # read as ms: January 1970
        "fb-future": (_feedback(10, ts=ms + 301_000), s.TS_OUT_OF_RANGE),
    }
    records = [Record("traces", 0, n, None, _enc(v)) for n, (v, _) in enumerate(cases.values())]
    for fast in (True, False):
        batch = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER, fast=fast, window=window)
        got = {list(cases)[d.offset]: d.reason for d in batch.dead_letters}
        assert got == {name: reason for name, (_, reason) in cases.items() if reason}
        assert len(batch.traces) + len(batch.feedback) == 3
    detail = next(d.detail for d in batch.dead_letters if d.offset == 4)
    assert (
        "9999-12-31T23:59:59+00:00" in detail and "2026-12-01T00:05:00+00:00" in detail and "max_clock_skew_s" in detail
    )


def test_an_unexpected_parser_failure_dead_letters_only_that_record(monkeypatch: pytest.MonkeyPatch) -> None:
    import connectors.fast_parse as fp

    real = fp.parse_record

    def flaky(value: bytes | None, **kwargs: object) -> object:
        if value is not None and b'"t1"' in value:
            raise RuntimeError("boom")
        return real(value, **kwargs)

    monkeypatch.setattr(fp, "parse_record", flaky)
    records = [Record("traces", 0, n, None, _enc(_trace(n, ts="2026-01-02 03:04:05"))) for n in range(3)]  # slow path
    batch = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER)
    assert [row[0] for row in batch.traces] == ["t0", "t2"]
    assert [(d.reason, d.offset) for d in batch.dead_letters] == [(s.PARSE_ERROR, 1)]
    assert "RuntimeError: boom" in batch.dead_letters[0].detail and batch.dead_letters[0].payload == records[1].value


def test_undecodable_records_become_dead_letters_with_coordinates() -> None:
    from connectors.fast_parse import UndecodableRecord

    records = [
        Record("traces", 0, 0, None, _enc(_trace(0))),
        UndecodableRecord("traces", 1, 7, "UnsupportedCodecError: x"),
    ]
    batch = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER)
    assert len(batch.traces) == 1
    assert [(d.reason, d.topic, d.partition, d.offset) for d in batch.dead_letters] == [
        (s.UNDECODABLE_RECORD, "traces", 1, 7)
    ]


def test_a_row_arrow_refuses_becomes_a_dead_letter_not_a_failed_batch() -> None:
    records = [Record("traces", 0, n, None, _enc(_trace(n, ts="2026-01-02 03:04:05"))) for n in range(2)]  # typed rows
    batch = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER)
    row = list(batch.traces[1])
    row[5] = "\ud800"  # something the parser should never let through: the store must still not fail
    batch.traces[1] = tuple(row)
    traces, feedback = batch.tables(INGESTED)
    assert traces["trace_id"].to_pylist() == ["t0"] and feedback.num_rows == 0
    assert [(d.reason, d.topic, d.partition, d.offset) for d in batch.dead_letters] == [(s.PARSE_ERROR, "traces", 0, 1)]


@pytest.mark.parametrize("depth", [250, 900, 5000])
def test_deeply_nested_records_are_dead_lettered_alike_without_raw_user_ids(depth: int) -> None:
    """Nesting beyond the JSON parser's recursion limit: the same clear reason on both paths (not the
    internal ``parse_error``, not a record the fast path alone accepts), and the stored payload never keeps
    the identifiers it could not hash."""
    nested = b"[" * depth + b"]" * depth
    trace = _enc(_trace(0, metadata={"email": "alice@x.org", "d": "@"})).replace(b'"@"', nested)
    feedback = _enc(_feedback(1, metadata={"user": "alice", "d": "@"})).replace(b'"@"', nested)
    records = [Record("traces", 0, n, None, v) for n, v in enumerate([trace, feedback, _enc(_trace(2))])]
    fast = parse_batch(records, max_record_bytes=1 << 20, hasher=HASHER)
    slow = parse_batch(records, max_record_bytes=1 << 20, hasher=HASHER, fast=False)
    for out in (fast, slow):
        assert [row[0] for row in out.traces] == ["t2"] and out.feedback == []
        assert [(d.offset, d.reason) for d in out.dead_letters] == [(0, s.NESTING_TOO_DEEP), (1, s.NESTING_TOO_DEEP)]
        assert all("nest" in d.detail for d in out.dead_letters)
        assert all(b"alice" not in (d.payload or b"") for d in out.dead_letters)
    assert fast.dead_letters == slow.dead_letters


@pytest.mark.parametrize("logprob", [-1e300, -3.5e38, 1e39])
def test_logprobs_beyond_float32_are_dead_lettered_not_stored_as_infinity(logprob: float) -> None:
    """completion_logprobs are stored as float32: a finite JSON number beyond its range became -inf/inf in
    the buffer (the contract says finite). Both paths refuse it, naming the field; the rest of the batch lands."""
    bad = _enc(_trace(0, completion_token_ids=[1, 2, 3], completion_logprobs=[-0.5, logprob, -1.0]))
    records = [Record("traces", 0, n, None, v) for n, v in enumerate([bad, _enc(_trace(1))])]
    for fast in (True, False):
        out = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER, fast=fast)
        assert [row[0] for row in out.traces] == ["t1"]
        assert [(d.offset, d.reason) for d in out.dead_letters] == [(0, s.SCHEMA_VIOLATION)]
        assert "completion_logprobs" in out.dead_letters[0].detail
        table = out.trace_table(INGESTED)
        assert all(math.isfinite(v) for row in table["completion_logprobs"].to_pylist() if row for v in row)


@pytest.mark.parametrize("token", [b"NaN", b"-Infinity", b"1e999"])
def test_non_finite_numbers_in_metadata_are_stored_as_null_so_the_buffer_stays_json(token: bytes) -> None:
    """pydantic's JSON parser reads NaN / Infinity / 1e999 in metadata; stored as such the metadata column
    would hold ``NaN`` text, which is not JSON (strict readers of the buffer fail on it). Both paths store
    the record with null in their place (the record is not refused: metadata is free-form)."""
    raw = _enc(_trace(0, metadata={"ok": 1.5, "nested": [{"score": "@"}]})).replace(b'"@"', token)
    feedback = _enc(_feedback(1, metadata={"score": "@"})).replace(b'"@"', token)
    records = [Record("traces", 0, n, None, v) for n, v in enumerate([raw, feedback, _enc(_trace(2))])]

    def strict(text: str) -> object:
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} stored in {text}"))

    for fast in (True, False):
        out = parse_batch(records, max_record_bytes=MAX_BYTES, hasher=HASHER, fast=fast)
        assert out.dead_letters == [] and [row[0] for row in out.traces] == ["t0", "t2"]
        assert strict(out.traces[0][METADATA]) == {"ok": 1.5, "nested": [{"score": None}]}
        assert strict(out.feedback[0][3]) == {"score": None}


@pytest.mark.parametrize("role", ["banana", "function", "USER"])
def test_an_unknown_message_role_gets_the_reference_verdict(role: str) -> None:
    record = Record("t", 0, 1, None, _enc(_trace(1, prompt=[{"role": role, "content": "hi"}])))
    batch = parse_batch([record], max_record_bytes=MAX_BYTES, hasher=HASHER)
    assert not batch.traces and [d.reason for d in batch.dead_letters] == [s.SCHEMA_VIOLATION]


def test_the_fast_path_knows_the_same_roles_as_the_reference() -> None:
    assert set(typing.get_args(typing.get_type_hints(_Message)["role"])) == s.CHAT_ROLES
