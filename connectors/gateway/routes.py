"""The routes contract: public model name -> the vLLM served name that answers it.

The serving controller (:mod:`pipeline.serving.controller`) is the only writer
(:func:`write_route`); the gateway reads it through :class:`RouteResolver`. The
file is ``<state_dir>/routes.json``: ``{public model name: Route as a JSON
object}``, replaced atomically on every write. With ``serving.routes_source =
"kafka"`` the same JSON objects also travel on the compacted routes topic
(:mod:`connectors.gateway.route_feed`) to gateways on other hosts.

A route whose ``version`` is None names the base model (``served_name`` = the
base's vLLM name): the serving controller writes one only while a model with
no ``@champion`` yet has a version on canary, so that the base keeps the rest
of the traffic; traces answered by the base record ``adapter_version`` null.
Records written before the canary fields existed load with their defaults.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from connectors import atomic
from connectors.errors import ConnectorError

log = logging.getLogger(__name__)
# A gateway lists at most this many refused routes per window, however many entries break and however often the
# file changes: thousands of bad entries, or a file rewritten every second, log a few lines a minute.
_WARN_AT_MOST = 20
_WARN_WINDOW_S = 60.0
# While the routes file does not parse the gateway serves the routes it read last; it says so again this often.
_UNREADABLE_REMINDER_S = 300.0

ROUTES_FILE = "routes.json"
# Far above any real deployment's routes (a route is ~250 bytes), far below what would strain a gateway's memory.
MAX_ROUTES_FILE_BYTES = 16 * 1024 * 1024
# A vLLM served name: one plain name (the serving config's name rule), never a path.
_SERVED_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")
# A model version as MLflow numbers it: digits only, so `<model>-v<version>` names one model's one version.
_VERSION = re.compile(r"\A[0-9]{1,18}\Z")


class RouteRecordError(ConnectorError, ValueError):
    """A route entry (routes file or routes topic) is not a valid ``Route``; the message says which field."""


@dataclass(frozen=True)
class Route:
    """Where the public model name goes now."""

    served_name: str  # the vLLM model name, e.g. "hourglass-v3"; the base's served name when ``version`` is None
    version: str | None  # None: the base model (a canary with no champion yet splits base vs challenger)
    updated_at: str  # ISO 8601, UTC
    # The canary (pipeline.canary): a share `fraction` of routing keys goes to the challenger.
    challenger_served_name: str | None = None
    challenger_version: str | None = None
    fraction: float = 0.0


def route_from_dict(entry: object, model: str | None = None) -> Route:
    """One route entry (a JSON object, as in the routes file or on the routes topic) as a ``Route``.

    Checks: ``served_name`` and both versions plain names (ASCII letters, digits, ``.``, ``_``, ``-``; the gateway
    hashes the challenger's version into every routing decision); ``version`` null only beside a challenger (a
    canary against the base: the base keeps the rest of the traffic; the gateway's resolver also requires the
    served name to be its own base);
    ``updated_at`` a string; the challenger's served name and version both set or both absent;
    ``fraction`` a finite number in [0, 1] (not a boolean). Unknown fields are ignored (a newer writer).
    With ``model`` (the public name the entry routes), every version must be an MLflow version number (ASCII
    digits) and every versioned served name ``<model>-v<version>``, the routes contract: a record cannot point a
    model at another model's adapter (with a version such as ``1-v3``, ``hg-v1-v3`` would be model ``hg-v1``'s).

    Raises:
        RouteRecordError: the entry breaks one of these rules (the message names the field and value).
    """
    if not isinstance(entry, dict):
        raise RouteRecordError(f"a route must be a JSON object, got {type(entry).__name__}")

    def name(field: str, optional: bool) -> str | None:
        value = entry.get(field)
        if value is None and optional:
            return None
        if not isinstance(value, str) or not _SERVED_NAME.match(value) or ".." in value:
            raise RouteRecordError(f"route field {field!r} must be a plain name, got {str(value)[:100]!r}")
        return value

    def text(field: str, optional: bool) -> str | None:
        value = entry.get(field)
        if value is None and optional:
            return None
        if not isinstance(value, str) or len(value) > 200:
            raise RouteRecordError(f"route field {field!r} must be a string, got {str(value)[:100]!r}")
        return value

    served, version = name("served_name", False), name("version", True)
    challenger, challenger_version = name("challenger_served_name", True), name("challenger_version", True)
    fraction = entry.get("fraction", 0.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:  # NaN too
        raise RouteRecordError(f"route field 'fraction' must be a number in [0, 1], got {str(fraction)[:100]!r}")
    if (challenger is None) != (challenger_version is None):
        raise RouteRecordError("route fields 'challenger_served_name' and 'challenger_version' go together")
    if version is None and challenger is None:
        raise RouteRecordError(
            "route field 'version' is null (the base) without a challenger; only a canary against the base has one"
        )
    if model is not None:
        for got, ver in ((served, version), (challenger, challenger_version)):
            if ver is not None and not _VERSION.match(ver):  # "1-v3" would make hg-v1-v3 model hg-v1's version 3
                raise RouteRecordError(f"route of {model!r} has version {ver!r}; a model version is its MLflow number")
            if got is not None and ver is not None and got != f"{model}-v{ver}":
                raise RouteRecordError(f"route of {model!r} names {got!r} for version {ver!r}; expected {model}-v{ver}")
    return Route(served, version, text("updated_at", False), challenger, challenger_version, float(fraction))  # type: ignore[arg-type]


def read_routes(
    state_dir: str | Path, refused: dict[str | None, str] | None = None, *, strict: bool = False
) -> dict[str, Route]:
    """The routes file ``<state_dir>/routes.json`` as ``{public model name: Route}`` ({} when absent; an entry
    that is not a valid route is left out, see :func:`route_from_dict`). A file that exists and does not parse
    as a JSON object (not a regular file, over ``MAX_ROUTES_FILE_BYTES``, not JSON, not an object) reads as {}
    too, or raises :class:`RouteRecordError` with ``strict`` (the writers: a route written over a file that
    did not parse would drop every other model's route). With ``refused``, each reason is recorded there:
    ``{model: why}``, and under None why a file that exists did not parse as a JSON object."""
    try:
        data = _entries(Path(os.path.expanduser(str(state_dir))))
    except RouteRecordError as err:
        if strict:
            raise
        if refused is not None:
            refused[None] = str(err)
        return {}
    return routes_from_dicts(data, refused)


def _load(path: Path) -> dict:
    """The routes file's JSON object. Raises FileNotFoundError, or RouteRecordError naming why it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there must not block the reader
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # what was opened, not what the path names by now
            os.close(fd)
            raise RouteRecordError(f"routes file {path} is not a regular file")
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_ROUTES_FILE_BYTES + 1)
        if len(raw) > MAX_ROUTES_FILE_BYTES:
            raise RouteRecordError(f"routes file {path} is larger than {MAX_ROUTES_FILE_BYTES} bytes")
        data = json.loads(raw)
    except (FileNotFoundError, RouteRecordError):
        raise
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: JSON nested deeper than the parser goes
        why = "nested too deep" if isinstance(err, RecursionError) else str(err)[:200]
        raise RouteRecordError(f"routes file {path} unreadable ({why})") from None
    if not isinstance(data, dict):
        raise RouteRecordError(f"routes file {path} is not a JSON object")
    return data


def write_route(state_dir: str | Path, model: str, route: Route) -> None:
    """Set one model's route; the file is replaced atomically (:func:`connectors.atomic.write_text`). The other
    models' entries are kept as they are, even one a reader refuses (a hand-edit to fix, not this writer's to drop).

    Raises:
        RouteRecordError: the routes file exists and does not parse (fix or remove it by hand: rewriting it
            from nothing would drop the other models' routes).
    """
    folder = Path(os.path.expanduser(str(state_dir)))
    folder.mkdir(parents=True, exist_ok=True)
    entries = _entries(folder)
    entries[model] = asdict(route)
    _write_all(folder, entries)


def _entries(folder: Path) -> dict:
    """The routes file's entries as written ({} when absent). Raises RouteRecordError when it does not parse."""
    try:
        return _load(folder / ROUTES_FILE)
    except FileNotFoundError:
        return {}


def _write_all(folder: Path, entries: dict) -> None:
    atomic.write_text(folder / ROUTES_FILE, json.dumps(entries, indent=2))


def remove_route(state_dir: str | Path, model: str) -> None:
    """Remove one model's route (the gateway then serves the configured public name by the base, as
    before any route existed); nothing happens when it has none. Replaced atomically like :func:`write_route`,
    the other models' entries kept as they are."""
    folder = Path(os.path.expanduser(str(state_dir)))
    entries = _entries(folder)
    if model not in entries:
        return
    del entries[model]  # whatever it holds: a null or broken entry of this model goes too
    _write_all(folder, entries)


def routes_from_dicts(entries: dict[str, dict], refused: dict[str | None, str] | None = None) -> dict[str, Route]:
    """``{model: route dict}`` (a JSON object per route, as on the routes topic) as ``{model: Route}``.
    Unknown fields are ignored (a newer writer); an entry that :func:`route_from_dict` refuses for its model (a
    versioned served name other than ``<model>-v<version>`` included) is left out, and its reason recorded in
    ``refused`` (``{model: why}``) when given."""
    out: dict[str, Route] = {}
    for model, entry in entries.items():
        try:
            if not isinstance(entry, dict):
                raise RouteRecordError("not a JSON object")
            out[model] = route_from_dict(entry, model)
        except RouteRecordError as err:
            if refused is not None:
                refused[model] = f"route of {model[:100]!r}: {str(err)[:200]}"
    return out


def canary_bucket(key: str) -> int:
    """A routing key's bucket in [0, 10000): the first 8 bytes of its SHA-256, mod 10000 (the same in every process)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 10000


def _left_out(why: str) -> str:
    return f"route left out: {why}; its requests are answered as if it had no route"


class Resolved(NamedTuple):
    """Where one request goes: vLLM served name, adapter version (None: base), and whether it is
    a canary request (None when no challenger is routed for that model)."""

    served_name: str
    version: str | None
    canary: bool | None


class RouteResolver:
    """Public model name -> ``(vLLM served name, adapter version)`` from ``<state_dir>/routes.json``.

    A public name with a route goes to its versioned served name; the configured
    public name without a route goes to the base (``base_served_name``, version
    None); any other name raises ``KeyError``. The routes are re-read at most every
    ``ttl_s`` seconds, so a route flip reaches the gateway within ``ttl_s``. A routes
    file that exists and does not parse as a JSON object (a hand-edit with a stray
    comma) changes nothing: the resolver keeps the routes it read last (none before its
    first good read) and logs why, so a broken file does not send every model to the base.

    ``source``: instead of the file, a callable returning ``{model: route dict}``
    (e.g. :meth:`connectors.gateway.route_feed.RouteFollower.routes`, the routes topic).
    ``models``: the public names this deployment serves; routes for any other name (a record
    produced to the routes topic by someone else) are ignored. None: every routed name.
    """

    def __init__(
        self,
        state_dir: str | Path | None,
        public_name: str,
        base_served_name: str,
        ttl_s: float = 1.0,
        *,
        source: Callable[[], dict[str, dict]] | None = None,
        models: Iterable[str] | None = None,
    ) -> None:
        if state_dir is None and source is None:
            raise ValueError("RouteResolver needs a state_dir (the routes file) or a source (e.g. the routes topic)")
        self.state_dir = state_dir
        self.source = source
        self.public_name = public_name
        self.base_served_name = base_served_name
        self.ttl_s = ttl_s
        self.models = None if models is None else frozenset(models) | {public_name}
        self._lock = threading.Lock()
        self._routes: dict[str, Route] = {public_name: Route(base_served_name, None, "")}  # until the first read
        self._read_at = float("-inf")
        self._warned: set[str] = set()  # reasons listed and still true, so a bad entry warns once, not per read
        self._window_at, self._window_lines = float("-inf"), 0
        # (since, last logged) while the routes file exists and does not parse; its reads forget no warning
        self._file_broken: tuple[float, float] | None = None

    def _current(self) -> dict[str, Route]:
        with self._lock:
            if time.monotonic() - self._read_at >= self.ttl_s:
                refused: dict[str | None, str] = {}  # the routes topic's follower already warned about its records
                routes = (
                    read_routes(self.state_dir, refused)  # type: ignore[arg-type]
                    if self.source is None
                    else routes_from_dicts(self.source())
                )
                unreadable = refused.pop(None, None)
                if unreadable is not None:  # the file exists and does not parse: keep what was read last
                    self._file_unreadable(unreadable)
                    self._read_at = time.monotonic()
                    return self._routes
                if self._file_broken is not None:
                    log.info("routes file parses again after %.0f s", time.monotonic() - self._file_broken[0])
                    self._file_broken = None
                if self.models is not None:
                    routes = {m: r for m, r in routes.items() if m in self.models}
                    refused = {m: why for m, why in refused.items() if m in self.models}
                # a base-side route (a canary against the base) may name only this gateway's base
                for m, r in routes.items():
                    if r.version is None and r.served_name != self.base_served_name:
                        refused[m] = f"route of {m[:100]!r} names base {r.served_name!r}, not {self.base_served_name!r}"
                routes = {
                    m: r for m, r in routes.items() if r.version is not None or r.served_name == self.base_served_name
                }
                self._warn({_left_out(why) for why in refused.values()})
                routes.setdefault(self.public_name, Route(self.base_served_name, None, ""))
                self._routes, self._read_at = routes, time.monotonic()
            return self._routes

    def _file_unreadable(self, why: str) -> None:
        """Log a routes file that does not parse when it breaks, then every ``_UNREADABLE_REMINDER_S`` while it
        stays so (its error may change on every read: a file being edited in place)."""
        now = time.monotonic()
        if self._file_broken is None:
            self._file_broken = (now, now)
            log.warning("%s; the gateway keeps the routes it read last until it parses", why)
        elif now - self._file_broken[1] >= _UNREADABLE_REMINDER_S:
            self._file_broken = (self._file_broken[0], now)
            log.warning("%s, for %.0f s; the gateway keeps the routes it read last", why, now - self._file_broken[0])

    def _warn(self, refused: set[str]) -> None:
        """Log each newly refused route once (its model then goes to its base, or is unknown), at most
        ``_WARN_AT_MOST`` lines a window; a reason left unlisted is listed in a later window if still true."""
        now = time.monotonic()
        if now - self._window_at >= _WARN_WINDOW_S:
            self._window_at, self._window_lines = now, 0
        new = sorted(refused - self._warned)
        listed = new[: max(0, _WARN_AT_MOST - self._window_lines)]
        for why in listed:
            log.warning("%s", why)
        self._window_lines += len(listed)
        if len(new) > len(listed) and self._window_lines <= _WARN_AT_MOST:  # one summary line a window
            log.warning(
                "%d more routes left out; listed within %.0f s if still so", len(new) - len(listed), _WARN_WINDOW_S
            )
            self._window_lines += 1
        self._warned = (self._warned & refused) | set(listed)

    def __call__(self, public_name: str) -> tuple[str, str | None]:
        """The champion's ``(served name, version)``. Raises KeyError for a name that is neither routed
        nor the configured public name."""
        served, version, _ = self.route(public_name, None)
        return served, version

    def route(self, public_name: str, key: str | None) -> Resolved:
        """Like ``__call__``, with the canary split: when a challenger is routed, the routing ``key``
        (a keyed hash of the hashed user id, else of the trace id) goes to it when
        ``canary_bucket(key + "\\x00" + challenger_version) < fraction * 10000``, so a user stays on one side for
        the whole canary, and each challenger draws its own side: the same users are not the canary's half every
        time, and a half that happens to hold the stricter raters does not weigh on every canary the same way.
        Raises KeyError for an unknown name."""
        try:
            route = self._current()[public_name]
        except KeyError:
            raise KeyError(f"unknown model {public_name!r}") from None
        if route.challenger_served_name is None:
            return Resolved(route.served_name, route.version, None)
        if key is not None and canary_bucket(f"{key}\x00{route.challenger_version}") < route.fraction * 10000:
            return Resolved(route.challenger_served_name, route.challenger_version, True)
        return Resolved(route.served_name, route.version, False)

    def names(self) -> list[str]:
        """The public model names, sorted."""
        return sorted(self._current())
