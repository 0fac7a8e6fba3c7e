"""A replay's ``until`` (``POST /rounds``, ``hourglass retrain --until``): a round over the window that ended
then, instead of the one ending now. Parsed and checked here, with no dependency beyond the standard library,
so the CLI refuses what the API would before any call."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

_ISO_UNTIL = re.compile(  # [0-9], not \d: \d matches "٣" too
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,3})?)?([Zz]|[+-][0-9]{2}:[0-9]{2})"
)


def parse_until(text: str) -> datetime:
    """A replay's ``until`` as written by a user (API or CLI): ISO 8601 ``YYYY-MM-DDTHH:MM[:SS[.mmm]]`` with a
    time zone (``Z`` or ``+HH:MM``), to the millisecond like the buffer's timestamps.

    Raises:
        ValueError: anything else (a bare number of seconds, a date alone, no time zone), quoting it bounded.
    """
    if not _ISO_UNTIL.fullmatch(text):
        raise ValueError(
            f"until {text[:60]!r} is not an ISO 8601 time with a time zone, to the millisecond at most "
            "(e.g. 2026-12-06T14:00:00Z or 2026-12-06T15:00:00.250+01:00)"
        )
    try:
        return datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError as err:  # 2026-02-30, 25:00, an offset of +24:00
        raise ValueError(f"until {text[:60]!r} is no valid time: {err}") from None


def check_until(until: datetime, span: timedelta) -> None:
    """Refuse an ``until`` a round cannot replay: without a time zone, in the future, or so early that its
    window (``span`` long) would start before year 1.

    Raises:
        ValueError: naming ``until`` and what is wrong with it.
    """
    if until.tzinfo is None or until.utcoffset() is None:
        raise ValueError(f"until {until.isoformat()!r} has no time zone; give one, e.g. 2026-12-06T14:00:00Z")
    try:
        utc = until.astimezone(timezone.utc)
        utc - span
    except OverflowError:
        raise ValueError(
            f"until {until.isoformat()!r}: it or its window's start lies outside years 1 to 9999"
        ) from None
    if utc > datetime.now(timezone.utc):
        raise ValueError(f"until {until.isoformat()!r} is in the future; a round replays a window that has ended")
