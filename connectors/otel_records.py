"""OTel topic records -> native event records, dead letters and skip counts, ahead of the ingest parser.

The ingest worker reads the Collector's Kafka-exporter topic (``[otel]`` section) next to the native
topics. :func:`expand_otel_records` turns each record of that topic into what the native path takes:

- every GenAI inference span and every configured feedback item becomes one :class:`OtelEventRecord`
  holding the ``hourglass.trace/v2`` / ``hourglass.feedback/v1`` JSON that
  :func:`connectors.otel.native_events` built, with the **source record's** topic, partition, offset and
  key. These go through :func:`connectors.fast_parse.parse_batch` like any native record: the same
  validation, time window, user-id hashing (``metadata.user``) and ``metadata.user_hash`` (the same keyed
  hasher), de-duplication by trace id (derived from the OTel trace and span ids, so a redelivered payload
  gives the same ids) and the same offset commit after the buffer write;
- every refused payload or span becomes a dead letter with its reason code; its payload is not kept (the
  raw OTLP may hold user ids in clear): the letter keeps the record's coordinates, and for a span its OTel
  trace and span ids in the detail;
- spans that are not GenAI inference are counted by reason (``not_genai``, ``not_inference``,
  ``failed_call``) and otherwise ignored.

Records of other topics pass through unchanged. Never raises on bad input: a record whose decoding
fails in an unforeseen way is one ``parse_error`` dead letter.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from connectors.dead_letter import DeadLetter
from connectors.otel import OtelSourceConfig, native_events
from connectors.otel.types import INVALID_CONTENT, Rejected
from connectors.schema import PARSE_ERROR, UserHasher


class _Record(Protocol):
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class OtelEventRecord:
    """One native event built from an OTel span, standing in for a Kafka record (the source record's
    coordinates and key; several may share one offset)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


@dataclass
class OtelExpansion:
    """What :func:`expand_otel_records` made of one batch: the records for the parser (in order), the OTel
    dead letters, the skipped spans by reason, and how many OTel records and spans were read."""

    records: list[Any] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    otel_records: int = 0
    spans: int = 0


def expand_otel_records(
    records: Iterable[_Record],
    cfg: OtelSourceConfig,
    hasher: UserHasher,
    passthrough: Callable[[Any], bool] = lambda _record: False,
) -> OtelExpansion:
    """Replace each record of ``cfg.topic`` by the native event records of its spans (see the module doc).

    Records of other topics, and those ``passthrough`` picks (ingest passes the stand-ins of records the
    consumer could not decode, :class:`~connectors.fast_parse.UndecodableRecord`), go to the parser unchanged.
    """
    out = OtelExpansion()
    for record in records:
        if record.topic != cfg.topic or passthrough(record):
            out.records.append(record)
            continue
        out.otel_records += 1
        try:
            mapped = native_events(record.value, cfg, hasher.digest)
            events, unserialisable = _serialise(mapped.events)
        except Exception as err:  # noqa: BLE001 - last resort: one record the decoder cannot handle never stops the batch
            out.dead_letters.append(
                DeadLetter(
                    PARSE_ERROR,
                    f"the OpenTelemetry source failed on this record ({type(err).__name__}: {str(err)[:300]}); "
                    "please report it (the payload is not kept; read it at these coordinates)",
                    record.topic,
                    record.partition,
                    record.offset,
                    None,
                    record.key,
                )
            )
            continue
        out.spans += mapped.spans
        out.skipped.update(mapped.skipped)
        out.dead_letters.extend(_letter(rejected, record) for rejected in mapped.rejected)
        out.dead_letters.extend(
            DeadLetter(
                INVALID_CONTENT,
                f"an event of this record holds a value that is not JSON data ({detail}); the record's other "
                "events count",
                record.topic,
                record.partition,
                record.offset,
                None,
                record.key,
            )
            for detail in unserialisable
        )
        out.records.extend(
            OtelEventRecord(record.topic, record.partition, record.offset, record.key, value) for value in events
        )
    return out


def _serialise(events: Iterable[dict[str, Any]]) -> tuple[list[bytes], list[str]]:
    """Each native event as JSON bytes, and a reason for each event that is not JSON data (an OTLP
    ``bytes_value`` kept inside tool arguments or schemas, nesting too deep): that event alone is refused."""
    out: list[bytes] = []
    refused: list[str] = []
    for event in events:
        try:
            out.append(json.dumps(event, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        except (TypeError, ValueError, RecursionError) as err:
            refused.append(f"{type(err).__name__}: {str(err)[:200]}")
    return out, refused


def _letter(rejected: Any, record: _Record) -> DeadLetter:
    where = ""
    if isinstance(rejected, Rejected) and rejected.trace_id is not None:
        where = f" [otel trace {rejected.trace_id} span {rejected.span_id}]"
    return DeadLetter(
        rejected.reason,
        f"{rejected.detail}{where}",
        record.topic,
        record.partition,
        record.offset,
        None,  # the raw OTLP payload may hold user ids in clear: the coordinates point at it
        record.key,
    )
