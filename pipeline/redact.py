"""Credentials out of everything Hourglass stores, serves or logs.

A URI may carry a secret in two places: its userinfo
(``http://alice:S3cretPW@mlflow:5000``) and its query string
(``https://bucket/x?X-Amz-Signature=...&token=...``). :func:`redact` rewrites
both wherever they appear in a text::

    http://alice:S3cretPW@host/x?token=abc&page=2  ->  http://***@host/x?token=***&page=2

:func:`redact_data` applies it to every string of a JSON-like value (the
``/status`` and ``/rounds`` payloads, round records before they are stored),
and :func:`install_log_redaction` makes every log record of the process go
through it (a ``logging`` record factory, so records from any logger and to
any handler are covered, including handlers added later).
"""

from __future__ import annotations

import logging
import re
from typing import Any

MASK = "***"

# scheme://userinfo@ -> scheme://***@   (userinfo: anything up to @ without / or whitespace)
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s?#]+@")
# ?name=value / &name=value where the name looks like a secret.
_SECRET_PARAM = re.compile(
    r"([?&;](?:[a-z0-9_.-]*(?:password|passwd|pwd|secret|token|api[_-]?key|apikey|access[_-]?key|signature|sig|auth|credential)"
    r"[a-z0-9_.-]*)=)[^&#\s'\"]+",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with URI userinfo and password-like query values replaced by ``***``.

    Idempotent; text without a URI is returned unchanged.
    """
    if "://" not in text and "=" not in text:
        return text
    return _SECRET_PARAM.sub(rf"\1{MASK}", _USERINFO.sub(rf"\1{MASK}@", text))


def redact_data(value: Any) -> Any:
    """A copy of a JSON-like value (dicts, lists, tuples, strings) with every string redacted.

    Dict keys are redacted too (``/readyz`` names checks after replica URLs).
    """
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact(k) if isinstance(k, str) else k: redact_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_data(v) for v in value]
    return value


_installed = False


def install_log_redaction() -> None:
    """Redact every log record created from now on in this process (idempotent).

    Wraps the ``logging`` record factory: the formatted message (``msg % args``)
    and the traceback text of ``exc_info`` are redacted when the record is
    made, before any handler or filter sees it.
    """
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: let the handler report it as usual
            return record
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            clean_text = redact(text)
            if clean_text != text:
                record.exc_text = clean_text
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
