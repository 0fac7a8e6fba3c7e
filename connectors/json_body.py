"""One reading of a JSON request body, shared by the gateway and the ops API.

A body is read one way only, so no two parsers (ours, a proxy's, vLLM's)
can see two different requests in the same bytes:

- the media type is ``application/json`` with no ``charset`` or ``charset=utf-8``
  (RFC 8259 section 8.1: JSON between systems is UTF-8);
- the bytes are UTF-8: a byte order mark, UTF-16 / UTF-32 text (NUL bytes, which JSON
  text never holds unescaped) or an invalid sequence is refused, naming which;
- every string is valid Unicode (a ``"\\ud800"`` escape makes a lone surrogate that
  cannot be re-encoded for the model server, the trace or MLflow);
- an object has each key once (RFC 8259 section 4: names SHOULD be unique; parsers
  disagree on which duplicate wins, so neither does);
- nesting is at most ``max_depth`` deep; an integer has at most CPython's
  ``sys.get_int_max_str_digits()`` digits.

``NaN`` / ``Infinity`` literals (and ``1e400``, which reads as infinity) are parsed
here and refused by the callers, which name the field they are in.
"""

from __future__ import annotations

import codecs
import json
import sys
from collections.abc import Iterator
from typing import Any

from connectors.errors import ConnectorError

_BOMS = (
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF8, "UTF-8"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
)


class JsonBodyError(ConnectorError, ValueError):
    """A request body that is not one well-formed reading of UTF-8 JSON: ``status`` (400 or 415),
    ``message`` (what is wrong and what to send) and ``where`` (dotted path from ``body``, or None)."""

    def __init__(self, status: int, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.where = status, message, where

    @property
    def param(self) -> str | None:
        """The field named by ``where`` without the leading ``body.`` (None for the whole body)."""
        return None if self.where in (None, "body") else self.where.removeprefix("body.")


def check_media_type(content_type: str | None) -> None:
    """Accept only ``application/json`` (parameters: at most ``charset=utf-8``).

    Raises:
        JsonBodyError: 415, naming the media type or charset that was sent.
    """
    media, *params = (content_type or "").split(";")
    media = media.strip().lower()
    if media != "application/json":
        raise JsonBodyError(
            415, f"content type {short(media) or '(none)'!r} is not accepted; send the body as application/json"
        )
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise JsonBodyError(
                415,
                f"charset {short(value.strip())!r} is not accepted; JSON bodies are UTF-8 (send charset=utf-8 or none)",
            )


class _TwiceKeyed(dict):
    """An object that had ``twice`` as a key more than once: :func:`_walk` refuses it, naming where it is (the
    parser's hook sees no path)."""

    twice: str


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            flagged = _TwiceKeyed(pairs)
            flagged.twice = key
            return flagged
        out[key] = value
    return out


def decode_text(raw: bytes) -> str:
    """The body as text, when it is UTF-8 without a byte order mark.

    Raises:
        JsonBodyError: 400 naming the BOM, the UTF-16/32 encoding or the invalid byte.
    """
    for bom, name in _BOMS:
        if raw.startswith(bom):
            raise JsonBodyError(
                400, f"request body starts with a {name} byte order mark; send UTF-8 JSON without a BOM"
            )
    if b"\x00" in raw:
        raise JsonBodyError(
            400,
            "request body holds NUL bytes (UTF-16 or UTF-32 text?); JSON bodies must be UTF-8 (RFC 8259 section 8.1)",
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise JsonBodyError(400, f"request body is not UTF-8: {err.reason} at byte {err.start}") from None


def parse(raw: bytes, max_depth: int) -> Any:
    """Parse a JSON body by the rules of this module.

    Raises:
        JsonBodyError: 400 (encoding, syntax, a duplicate key, too deep, a huge integer, a lone surrogate).
    """
    text = decode_text(raw)
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise JsonBodyError(400, f"request body nests deeper than {max_depth} levels") from None
    except JsonBodyError:
        raise
    except ValueError as err:
        if "integer string conversion" in str(err):  # CPython's advice (sys.set_int_max_str_digits) is not the client's
            raise JsonBodyError(
                400,
                f"request body has an integer of more than {sys.get_int_max_str_digits()} digits; send a smaller number",
            ) from None
        raise JsonBodyError(400, f"request body is not valid JSON: {err}") from None
    _walk(value, max_depth)
    return value


def short(key: str | int) -> str:
    """A client's key (a field name) as an error names it: cut to 40 characters (it may be 1 MiB long)."""
    key = str(key)
    return key if len(key) <= 40 else f"{key[:40]}..."


def dotted(path: tuple[str | int, ...], root: str = "body") -> str:
    """``body.a.0.b`` of a path from ``root``, each key :func:`short`: an error never echoes a 1 MiB key (and a
    path is spelled out only for an error, not for every value: see :func:`_walk`)."""
    return ".".join((root, *map(short, path)))


# Where a value sits: ``(parent link, key)`` back to the body (None). A link is two words; the dotted path is
# rebuilt from the links only for an error (:func:`path_of`).
Link = tuple["Link | None", str | int] | None


def path_of(link: Link) -> tuple[str | int, ...]:
    """The keys from the body down to where ``link`` points."""
    keys: list[str | int] = []
    while link is not None:
        link, key = link
        keys.append(key)
    return tuple(reversed(keys))


def entries(value: Any) -> Iterator[tuple[Link, str | int, Any, int]]:
    """Every ``(link of its container, key, child, depth of the child)`` under ``value`` (whose own depth is 1),
    depth first. The stack holds one iterator per level of the current path, so checking a body costs memory
    by its depth, not its size: a path per value made a 20 kB key over 40 000 zeros take 800 MiB, a path tuple
    per value 490 000 zeros 29 deep 183 MB, and one stack entry per container 350 000 ``{}`` 77 MiB."""
    if not isinstance(value, (dict, list)):
        return
    stack: list[tuple[Iterator[tuple[Any, Any]], Link, int]] = [(_children(value), None, 2)]
    while stack:
        children, link, depth = stack[-1]
        for key, child in children:
            yield link, key, child, depth
            if isinstance(child, (dict, list)):
                stack.append((_children(child), (link, key), depth + 1))
                break
        else:
            stack.pop()


def _children(item: dict | list) -> Iterator[tuple[Any, Any]]:
    return iter(item.items()) if isinstance(item, dict) else enumerate(item)


def _walk(value: Any, max_depth: int) -> None:
    if isinstance(value, str):
        _check_text(value, None)
    _check_object(value, None)
    for link, key, child, depth in entries(value):
        if isinstance(key, str):
            _check_text(key, link)
        if isinstance(child, str):
            _check_text(child, (link, key))
        elif isinstance(child, (dict, list)):
            if depth > max_depth:  # before the walk goes into it
                where = dotted(path_of((link, key)))
                raise JsonBodyError(400, f"request body nests deeper than {max_depth} levels (at {where})", where)
            _check_object(child, (link, key))


def _check_object(item: Any, link: Link) -> None:
    if isinstance(item, _TwiceKeyed):
        where = dotted(path_of(link))
        raise JsonBodyError(
            400,
            f"request body has the key {short(item.twice)!r} twice in one object (at {where}); send each key once",
            where,
        )


def _check_text(text: str, link: Link) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        where = dotted(path_of(link))
        raise JsonBodyError(
            400,
            f"request body has text that is not valid Unicode at {where}: {err.reason} at position "
            f"{err.start} (a lone surrogate such as \\ud800?)",
            where,
        ) from None
