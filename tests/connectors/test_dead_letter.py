"""Unit tests of the dead-letter store: line splitting and damaged files."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.dead_letter import DeadLetter, DeadLetterStore

ODD = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\r"]


def test_payloads_with_unicode_line_separators_list_back_intact(tmp_path: Path) -> None:
    store = DeadLetterStore(str(tmp_path / "dlq"))
    letters = [DeadLetter("unknown_schema", f"d{i}", "t", 0, i, f'{{"a":"1{c}2"}}'.encode()) for i, c in enumerate(ODD)]
    store.write(letters)
    rows = store.list()
    assert [row["payload"] for row in rows] == [f'{{"a":"1{c}2"}}' for c in ODD]
    assert store.skipped_lines == 0 and store.count_by_reason() == {"unknown_schema": len(ODD)}


def test_a_damaged_line_is_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DeadLetterStore(str(tmp_path / "dlq"))
    path = store.write([DeadLetter("invalid_json", "x", "t", 0, 1, b"{")])
    with open(path, "ab") as f:
        f.write(b'{"reason": "half a line\n[1, 2]\n\xff\xfe\n')
    store.write([DeadLetter("oversize", "y", "t", 0, 2, b"z")])
    assert [row["reason"] for row in store.list()] == ["invalid_json", "oversize"]
    assert store.skipped_lines == 3
    assert "skipped 3 damaged" in caplog.text
    assert [row["reason"] for row in store.list(limit=1)] == ["invalid_json"]


def test_a_lone_surrogate_in_a_detail_is_stored_as_its_escape(tmp_path: Path) -> None:
    store = DeadLetterStore(str(tmp_path / "dlq"))
    store.write([DeadLetter("invalid_unicode", "bad \ud800 text", "t", 0, 1, None)])
    assert store.list()[0]["detail"] == "bad \ud800 text"
