"""Unit tests of the replay readers: truncated JSON arrays (ShareGPT), conversation -> trace, JSONL."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from connectors.errors import ReplayError
from connectors.replay import iter_json_array, iter_sharegpt_traces, read_trace_jsonl, sharegpt_trace

TS = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _conv(i: int, turns: list[tuple[str, str]]) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_truncated_array_yields_complete_records_then_stops(tmp_path: Path) -> None:
    records = [_conv(i, [("human", "x" * (i * 50)), ("gpt", "y")]) for i in range(40)]
    text = json.dumps(records, indent=2)
    cut = text.index('"c37"')  # mid-record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    got = list(iter_json_array(path, chunk_chars=256))  # small chunks: records straddle reads
    assert [r["id"] for r in got] == [f"c{i}" for i in range(37)]
    path.write_text(text)
    assert len(list(iter_json_array(path, chunk_chars=256))) == 40  # complete file: all of it


def test_not_an_array_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "obj.json"
    path.write_text('{"a": 1}')
    with pytest.raises(ReplayError, match="expected a JSON array"):
        list(iter_json_array(path))


def test_conversation_to_trace() -> None:
    event = sharegpt_trace(
        _conv(1, [("system", "s"), ("human", "h1"), ("human", "h2"), ("gpt", "g1"), ("human", "h3")]), TS
    )
    assert event is not None
    assert event.trace_id == "sharegpt-c1" and event.completion == "g1"
    assert event.messages() == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "h1"},
        {"role": "user", "content": "h2"},
    ]
    assert sharegpt_trace(_conv(2, [("gpt", "no question")]), TS) is None
    assert sharegpt_trace(_conv(3, [("human", "unanswered")]), TS) is None


def test_shipped_sharegpt_file_streams_to_its_truncation() -> None:
    events = list(iter_sharegpt_traces(None))
    assert len(events) > 5000
    assert len({e.trace_id for e in events}) == len(events)


def test_jsonl_reader_names_the_bad_line(tmp_path: Path) -> None:
    good = {"schema": "hourglass.trace/v1", "trace_id": "a", "ts": 0, "model": "m", "prompt": "p", "completion": "c"}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "trace_id": "b"}) + "\n{oops\n")
    reader = read_trace_jsonl(path)
    assert [next(reader).trace_id, next(reader).trace_id] == ["a", "b"]
    with pytest.raises(ReplayError, match=r"t.jsonl:4"):
        next(reader)


def test_every_sharegpt_record_is_a_trace_or_a_reason() -> None:
    from connectors import replay as r
    from connectors.schema import INVALID_UNICODE, Rejected, TraceEvent

    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    cases = [
        ({"id": "x", "conversations": ["human: hi"]}, r.SHAREGPT_BAD_TURN),
        ({"id": "x", "conversations": "human: hi"}, r.SHAREGPT_CONVERSATIONS_NOT_A_LIST),
        ({"id": "x", "conversations": {"from": "human"}}, r.SHAREGPT_CONVERSATIONS_NOT_A_LIST),
        ({"id": "x", "conversations": []}, r.SHAREGPT_NO_CONVERSATION),
        ({"id": "x"}, r.SHAREGPT_NO_CONVERSATION),
        ({"id": "x", "conversations": [{"from": "bing", "value": "?"}]}, r.SHAREGPT_UNKNOWN_ROLE),
        (_conv(1, [("human", "unanswered")]), r.SHAREGPT_NO_ANSWER),
        (_conv(1, [("system", "s")]), r.SHAREGPT_NO_HUMAN_TURN),
        (_conv(1, [("gpt", "g"), ("human", "h")]), r.SHAREGPT_GPT_BEFORE_HUMAN),
        ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "g"}]}, r.SHAREGPT_BAD_VALUE),
        ({"conversations": [{"from": "human", "value": None}]}, r.SHAREGPT_BAD_VALUE),
        ({"conversations": [{"value": "h"}]}, r.SHAREGPT_BAD_TURN),
        ({"conversations": [{"from": None, "value": "h"}]}, r.SHAREGPT_BAD_TURN),
        (["not", "an", "object"], r.SHAREGPT_NOT_AN_OBJECT),
        ("just a string", r.SHAREGPT_NOT_AN_OBJECT),
        ({"id": "y" * 300, **good}, r.SHAREGPT_INVALID_TRACE),
        ({"conversations": [{"from": "human", "value": "\ud800"}, {"from": "gpt", "value": "g"}]}, INVALID_UNICODE),
    ]
    for record, reason in cases:
        verdict = r.sharegpt_verdict(record, TS, 7)
        assert isinstance(verdict, Rejected) and verdict.reason == reason, (record, verdict)
        assert "record 7" in verdict.detail
    a, b = r.sharegpt_verdict(good, TS, 1), r.sharegpt_verdict(good, TS, 2)
    assert isinstance(a, TraceEvent) and isinstance(b, TraceEvent)
    assert a.trace_id != b.trace_id  # no id: content hash + record number, never "sharegpt-None"
    assert r.sharegpt_verdict(good, TS, 1).trace_id == a.trace_id  # deterministic


def test_sharegpt_jsonl_file_accounts_for_every_line(tmp_path: Path) -> None:
    from connectors import replay as r
    from connectors.schema import TraceEvent

    lines = [
        json.dumps(_conv(1, [("human", "h"), ("gpt", "g")])),
        "{oops",
        "",
        json.dumps(_conv(1, [("human", "h2"), ("gpt", "g2")])),  # same id again
        json.dumps({"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]}),
        "42",
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = [(n, v.reason if not isinstance(v, TraceEvent) else v.trace_id) for n, _, v in r.iter_sharegpt(path)]
    assert out[0] == (1, "sharegpt-c1") and out[1] == (2, r.SHAREGPT_INVALID_JSON)
    assert out[2] == (4, r.SHAREGPT_DUPLICATE_ID) and out[3][1].startswith("sharegpt-h") and out[3][1].endswith("-5")
    assert out[4] == (6, r.SHAREGPT_NOT_AN_OBJECT)


_CONV = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}


def test_json_array_file_with_a_utf8_bom_is_read_as_an_array(tmp_path: Path) -> None:
    """Editors on Windows save JSON with a byte-order mark: still the array of conversations, not one
    ``sharegpt_not_an_object`` record."""
    from connectors.replay import iter_sharegpt

    path = tmp_path / "bom.json"
    path.write_text(json.dumps([{"id": "a", **_CONV}, {"id": "b", **_CONV}]), encoding="utf-8-sig")
    assert [(n, getattr(v, "trace_id", None)) for n, _, v in iter_sharegpt(path)] == [
        (1, "sharegpt-a"),
        (2, "sharegpt-b"),
    ]


def test_json_array_element_nested_too_deep_is_a_clear_error(tmp_path: Path) -> None:
    """Not a RecursionError traceback: a ReplayError naming where the element starts."""
    from connectors.replay import iter_sharegpt

    path = tmp_path / "deep.json"
    path.write_text("[" + json.dumps({"id": "a", **_CONV}) + ", " + "[" * 50_000 + "]" * 50_000 + "]")
    got = []
    with pytest.raises(ReplayError, match="nested too deep"):
        for number, _, verdict in iter_sharegpt(path):
            got.append((number, verdict.trace_id))
    assert got == [(1, "sharegpt-a")]


def test_jsonl_reader_refuses_non_utf8_and_names_the_missing_field(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'\xff\xfe{"a": 1}\n')
    with pytest.raises(ReplayError, match="latin1.jsonl:1: not UTF-8"):
        list(read_trace_jsonl(path))
    path = tmp_path / "partial.jsonl"
    path.write_text('{"schema": "hourglass.trace/v1", "trace_id": "a"}\n')
    with pytest.raises(ReplayError, match=r"partial.jsonl:1: .*ts: Field required"):
        list(read_trace_jsonl(path))
