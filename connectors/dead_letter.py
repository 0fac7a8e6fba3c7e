"""The dead-letter store: every unusable record, kept with its reason and Kafka coordinates.

Each batch of dead letters is one JSON-lines file, written durably (fsync +
rename on local disks) *before* the consumer commits the batch's offsets, so
a rejected record is never lost. Layout::

    <dead_letter_root>/dt=YYYY-MM-DD/dlq-<ms>-<writer>-<seq>.jsonl

Each line: ``reason``, ``detail``, ``topic``, ``partition``, ``offset``,
``key`` and ``payload`` (UTF-8 text) or ``payload_b64`` (base64 when the bytes
are not UTF-8), ``dead_lettered_at`` (RFC 3339).
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from connectors.storage import list_files, open_location, read_bytes, write_durable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeadLetter:
    """One rejected record."""

    reason: str
    detail: str
    topic: str
    partition: int
    offset: int
    payload: bytes | None
    key: bytes | None = None

    def to_json(self, at: datetime) -> dict[str, Any]:
        row: dict[str, Any] = {
            "reason": self.reason,
            "detail": self.detail,
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "key": _text_or_b64(self.key)[0],
            "dead_lettered_at": at.isoformat(),
        }
        text, is_b64 = _text_or_b64(self.payload)
        row["payload_b64" if is_b64 else "payload"] = text
        return row


def _text_or_b64(data: bytes | None) -> tuple[str | None, bool]:
    if data is None:
        return None, False
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), True


class DeadLetterStore:
    """Durable, append-only store of :class:`DeadLetter` records (local path or pyarrow.fs URI)."""

    def __init__(self, root: str, writer_id: str | None = None) -> None:
        self.loc = open_location(root)
        self.writer_id = writer_id or uuid.uuid4().hex[:8]
        self._seq = itertools.count()
        self.skipped_lines = 0  # damaged lines the last list() skipped

    def write(self, letters: list[DeadLetter], now: datetime | None = None) -> str | None:
        """Store ``letters`` durably as one file; returns its path (None when there were none).

        Raises:
            BufferStorageError: the file could not be written durably.
        """
        if not letters:
            return None
        now = now or datetime.now(timezone.utc)
        lines = "".join(json.dumps(letter.to_json(now), ensure_ascii=False) + "\n" for letter in letters)
        name = f"dlq-{int(now.timestamp() * 1000):013d}-{self.writer_id}-{next(self._seq):06d}.jsonl"
        path = self.loc.path(f"dt={now:%Y-%m-%d}", name)
        # backslashreplace: a lone surrogate in a detail becomes its JSON escape text (\ud800), still valid JSON
        write_durable(self.loc, path, lines.encode("utf-8", "backslashreplace"))
        return path

    def list(self, limit: int | None = None, reason: str | None = None) -> list[dict[str, Any]]:
        r"""Stored dead letters, oldest first; optionally only one ``reason``, at most ``limit``.

        Lines are split on ``\n`` only (payloads may hold U+2028, \x85, \x0c... which ``str.splitlines``
        would split on). A line that is not a JSON object with a ``reason`` (a damaged file) is skipped and
        counted in :attr:`skipped_lines` (and logged), never raised.
        """
        out: list[dict[str, Any]] = []
        self.skipped_lines = 0
        for info in list_files(self.loc, self.loc.base, ".jsonl"):
            for raw in read_bytes(self.loc, info.path).split(b"\n"):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                    if not isinstance(row, dict) or not isinstance(row.get("reason"), str):
                        raise ValueError("not a dead-letter object")
                except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                    self.skipped_lines += 1
                    continue
                if reason is None or row["reason"] == reason:
                    out.append(row)
                    if limit is not None and len(out) >= limit:
                        break
            else:
                continue
            break
        if self.skipped_lines:
            log.warning("skipped %d damaged dead-letter line(s) under %s", self.skipped_lines, self.loc.base)
        return out

    def count_by_reason(self) -> dict[str, int]:
        """How many dead letters per reason code."""
        counts: dict[str, int] = {}
        for row in self.list():
            counts[row["reason"]] = counts.get(row["reason"], 0) + 1
        return counts
