"""Decoding of the Collector's Kafka exporter payloads, and bounded reads of OTLP attribute values.

Wire formats (opentelemetry-proto 1.x, ``opentelemetry.proto.collector.trace.v1``): ``otlp_proto`` is a
serialized ``ExportTraceServiceRequest`` (the exporter's default encoding); ``otlp_json`` is the same
message in the OTLP/JSON mapping (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding), which
differs from protobuf's canonical JSON in three ways: trace and span ids are hex strings (not base64),
enums may be integers, and 64-bit integers may be strings. The last two are what ``json_format`` reads
anyway; the ids are rewritten from hex to base64 before ``json_format.ParseDict``.

Every function here returns a value or raises :class:`Refused` (a reason code and a detail), which the
callers turn into a :class:`~connectors.otel.types.Rejected`; no other error escapes on bad input.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from connectors.otel.config import OtelSourceConfig
from connectors.otel.types import (
    EMPTY_VALUE,
    INVALID_CONTENT,
    INVALID_JSON,
    INVALID_OTLP,
    INVALID_PROTOBUF,
    NESTING_TOO_DEEP,
    OVERSIZE,
    OVERSIZE_ATTRIBUTE,
)


class Refused(Exception):
    """Internal control flow: why a payload or span is unusable (never leaves the package)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


# --- payloads ----------------------------------------------------------------------------------------

_ID_KEYS = ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id")


def decode_request(value: bytes | None, cfg: OtelSourceConfig) -> ExportTraceServiceRequest:
    """One Kafka record value as an ``ExportTraceServiceRequest``.

    Raises:
        Refused: ``empty_value``, ``oversize`` (above ``max_payload_bytes``), ``invalid_protobuf``,
            ``invalid_json``, ``invalid_otlp`` or ``nesting_too_deep``.
    """
    if not value:
        raise Refused(EMPTY_VALUE, "record has no value (tombstone or empty); expected an OTLP trace payload")
    if len(value) > cfg.max_payload_bytes:
        raise Refused(OVERSIZE, f"payload is {len(value)} bytes, above otel.max_payload_bytes={cfg.max_payload_bytes}")
    as_json = cfg.encoding == "otlp_json" or (cfg.encoding == "auto" and value.lstrip()[:1] == b"{")
    request = _from_json(value) if as_json else _from_proto(value)
    if not request.resource_spans:  # bytes that happen to parse as a message of unknown fields only, or {}
        raise Refused(
            INVALID_OTLP if as_json else INVALID_PROTOBUF,
            f"payload of {len(value)} bytes holds no resourceSpans: not an OTLP trace export "
            f"(is the exporter's encoding {'otlp_json' if as_json else 'otlp_proto'}, and is this the traces topic?)",
        )
    return request


def _from_proto(value: bytes) -> ExportTraceServiceRequest:
    try:
        return ExportTraceServiceRequest.FromString(value)
    except (DecodeError, RecursionError, ValueError) as err:
        raise Refused(
            INVALID_PROTOBUF,
            f"payload is not an OTLP ExportTraceServiceRequest protobuf ({type(err).__name__}: {str(err)[:200]}); "
            "is the exporter's encoding otlp_proto (otel.encoding)?",
        ) from None


def _from_json(value: bytes) -> ExportTraceServiceRequest:
    try:
        data = json.loads(value)
    except RecursionError:
        raise Refused(NESTING_TOO_DEEP, "OTLP/JSON payload nests deeper than the JSON parser allows") from None
    except (UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise Refused(
            INVALID_JSON, f"payload is not JSON ({str(err)[:200]}); is the exporter's encoding otlp_json?"
        ) from None
    if not isinstance(data, dict):
        raise Refused(INVALID_OTLP, f"OTLP/JSON payload is a JSON {type(data).__name__}, expected an object")
    _hex_ids_to_base64(data)
    try:
        return json_format.ParseDict(data, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except RecursionError:
        raise Refused(NESTING_TOO_DEEP, "OTLP/JSON payload nests deeper than the protobuf parser allows") from None
    except (json_format.ParseError, ValueError, TypeError, AttributeError) as err:
        raise Refused(INVALID_OTLP, f"payload is not OTLP/JSON: {str(err)[:300]}") from None


def _hex_ids_to_base64(data: dict[str, Any]) -> None:
    """Rewrite OTLP/JSON's hex ``traceId`` / ``spanId`` / ``parentSpanId`` (of spans and of their links) to the
    base64 that ``json_format`` expects for ``bytes`` fields, in place."""
    for i, rs in enumerate(_list(data, ("resourceSpans", "resource_spans"), "resourceSpans")):
        for j, ss in enumerate(_list(rs, ("scopeSpans", "scope_spans"), f"resourceSpans[{i}].scopeSpans")):
            for k, span in enumerate(_list(ss, ("spans",), f"resourceSpans[{i}].scopeSpans[{j}].spans")):
                where = f"resourceSpans[{i}].scopeSpans[{j}].spans[{k}]"
                _rewrite_ids(span, where)
                for n, link in enumerate(_list(span, ("links",), f"{where}.links")):
                    _rewrite_ids(link, f"{where}.links[{n}]")


def _list(obj: Any, keys: Iterable[str], where: str) -> list[Any]:
    if not isinstance(obj, dict):
        raise Refused(INVALID_OTLP, f"{where}: expected an object, got a JSON {type(obj).__name__}")
    present = [key for key in keys if key in obj]
    if len(present) > 1:  # protobuf's JSON reader would keep one of them silently
        raise Refused(INVALID_OTLP, f"{where}: both {' and '.join(present)} given; send one of them")
    for key in keys:
        if key in obj and obj[key] is not None:
            items = obj[key]
            if not isinstance(items, list):
                raise Refused(INVALID_OTLP, f"{where}: expected an array, got a JSON {type(items).__name__}")
            return items
    return []


def _rewrite_ids(obj: Any, where: str) -> None:
    if not isinstance(obj, dict):
        raise Refused(INVALID_OTLP, f"{where}: expected an object, got a JSON {type(obj).__name__}")
    for key in _ID_KEYS:
        text = obj.get(key)
        if text is None:
            continue
        if not isinstance(text, str):
            raise Refused(INVALID_OTLP, f"{where}.{key}: expected a hex string, got a JSON {type(text).__name__}")
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raise Refused(INVALID_OTLP, f"{where}.{key}: {text[:80]!r} is not hex (OTLP/JSON ids are hex)") from None
        obj[key] = base64.b64encode(raw).decode("ascii")


# --- attribute values ----------------------------------------------------------------------------------


class Attrs:
    """The attributes of a span, event, link or resource, by key (the last of duplicate keys wins), read with
    the source's bounds. Values are converted only when read."""

    __slots__ = ("_by_key", "_cfg", "_where")

    def __init__(self, pairs: Iterable[KeyValue], cfg: OtelSourceConfig, where: str) -> None:
        self._by_key: dict[str, AnyValue] = {kv.key: kv.value for kv in pairs}
        self._cfg = cfg
        self._where = where

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def keys(self) -> Iterable[str]:
        return self._by_key.keys()

    def raw(self, key: str) -> AnyValue | None:
        return self._by_key.get(key)

    def value(self, key: str) -> Any:
        """The value as Python data (None when absent); a JSON string stays a string.

        Raises:
            Refused: ``oversize_attribute`` or ``nesting_too_deep``.
        """
        raw = self._by_key.get(key)
        if raw is None:
            return None
        return any_value(raw, self._cfg, f"{self._where} attribute {key!r}")

    def text(self, key: str) -> str | None:
        """A string attribute; None when absent or not a string (ints are given as text)."""
        value = self.value(key)
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            return str(value)
        return value if isinstance(value, str) and value else None

    def integer(self, key: str) -> int | None:
        """An int attribute (an integral double counts); None when absent.

        Raises:
            Refused: ``invalid_content`` for any other type.
        """
        value = self.value(key)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise Refused(INVALID_CONTENT, f"{self._where} attribute {key!r} is {_kind(value)}, expected an integer")

    def structured(self, key: str) -> Any:
        """An attribute that holds JSON data, recorded either in structured form or as a JSON string (the GenAI
        conventions allow both on spans); None when absent.

        Raises:
            Refused: ``invalid_content`` (a string that is not JSON), ``oversize_attribute``,
                ``nesting_too_deep``.
        """
        value = self.value(key)
        if isinstance(value, str):
            return json_text(value, self._cfg, f"{self._where} attribute {key!r}")
        return value


def any_value(value: AnyValue, cfg: OtelSourceConfig, where: str) -> Any:
    """An OTLP ``AnyValue`` as Python data (str, bool, int, float, bytes, list, dict, None).

    Raises:
        Refused: ``oversize_attribute`` (protobuf size above ``max_attribute_bytes``), ``nesting_too_deep``.
    """
    size = value.ByteSize()
    if size > cfg.max_attribute_bytes:
        raise Refused(
            OVERSIZE_ATTRIBUTE, f"{where} is {size} bytes, above otel.max_attribute_bytes={cfg.max_attribute_bytes}"
        )
    return _convert(value, cfg.max_json_depth, where, 0)


def _convert(value: AnyValue, max_depth: int, where: str, depth: int) -> Any:
    if depth > max_depth:
        raise Refused(NESTING_TOO_DEEP, f"{where} nests deeper than otel.max_json_depth={max_depth}")
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        return value.double_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "bytes_value":
        return value.bytes_value
    if kind == "array_value":
        return [_convert(item, max_depth, where, depth + 1) for item in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _convert(kv.value, max_depth, where, depth + 1) for kv in value.kvlist_value.values}
    return None  # unset, or a dictionary index (profiles only)


def json_text(text: str, cfg: OtelSourceConfig, where: str) -> Any:
    """``text`` parsed as JSON, bounded in bytes and nesting.

    Raises:
        Refused: ``oversize_attribute``, ``invalid_content``, ``nesting_too_deep``.
    """
    if len(text) > cfg.max_attribute_bytes or len(text.encode("utf-8", "surrogatepass")) > cfg.max_attribute_bytes:
        raise Refused(OVERSIZE_ATTRIBUTE, f"{where} is above otel.max_attribute_bytes={cfg.max_attribute_bytes}")
    try:
        data = json.loads(text)
    except RecursionError:
        raise Refused(NESTING_TOO_DEEP, f"{where} nests deeper than the JSON parser allows") from None
    except ValueError as err:
        raise Refused(INVALID_CONTENT, f"{where} is not JSON: {str(err)[:200]}") from None
    if _depth(data) > cfg.max_json_depth:
        raise Refused(NESTING_TOO_DEEP, f"{where} nests deeper than otel.max_json_depth={cfg.max_json_depth}")
    return data


def _depth(data: Any) -> int:
    """Nesting depth of decoded JSON (0 for a scalar), without recursion."""
    deepest, stack = 0, [(data, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__} ({str(value)[:60]!r})"


def kind_of(value: Any) -> str:
    """How a value is named in a detail: ``a str ('abc')``, ``a dict ({...})``, ``null``."""
    return _kind(value)
