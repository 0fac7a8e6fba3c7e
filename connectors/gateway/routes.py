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
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

ROUTES_FILE = "routes.json"


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


def read_routes(state_dir: str | Path) -> dict[str, Route]:
    """The routes file ``<state_dir>/routes.json`` as ``{public model name: Route}`` ({} when absent)."""
    path = Path(os.path.expanduser(str(state_dir))) / ROUTES_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return routes_from_dicts(data) if isinstance(data, dict) else {}


def write_route(state_dir: str | Path, model: str, route: Route) -> None:
    """Set one model's route; the file is replaced atomically (write temp, fsync, rename)."""
    folder = Path(os.path.expanduser(str(state_dir)))
    folder.mkdir(parents=True, exist_ok=True)
    routes = {name: asdict(r) for name, r in read_routes(folder).items()}
    routes[model] = asdict(route)
    _write_all(folder, routes)


def _write_all(folder: Path, routes: dict[str, dict]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".routes.", dir=folder)
    with os.fdopen(fd, "w") as handle:
        json.dump(routes, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / ROUTES_FILE)


def remove_route(state_dir: str | Path, model: str) -> None:
    """Remove one model's route (the gateway then serves the configured public name by the base, as
    before any route existed); nothing happens when it has none. Replaced atomically like :func:`write_route`."""
    folder = Path(os.path.expanduser(str(state_dir)))
    routes = {name: asdict(r) for name, r in read_routes(folder).items()}
    if routes.pop(model, None) is None:
        return
    _write_all(folder, routes)


def routes_from_dicts(entries: dict[str, dict]) -> dict[str, Route]:
    """``{model: route dict}`` (a JSON object per route, as on the routes topic) as ``{model: Route}``.
    Unknown fields are ignored (a newer writer); an entry without ``served_name``/``version``/``updated_at`` is left out."""
    names = set(Route.__dataclass_fields__)
    out: dict[str, Route] = {}
    for model, entry in entries.items():
        if not isinstance(entry, dict):
            continue
        try:
            out[model] = Route(**{k: v for k, v in entry.items() if k in names})
        except TypeError:
            continue
    return out


def canary_bucket(key: str) -> int:
    """A routing key's bucket in [0, 10000): the first 8 bytes of its SHA-256, mod 10000 (the same in every process)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 10000


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
    ``ttl_s`` seconds, so a route flip reaches the gateway within ``ttl_s``.

    ``source``: instead of the file, a callable returning ``{model: route dict}``
    (e.g. :meth:`connectors.gateway.route_feed.RouteFollower.routes`, the routes topic).
    """

    def __init__(
        self,
        state_dir: str | Path | None,
        public_name: str,
        base_served_name: str,
        ttl_s: float = 1.0,
        *,
        source: Callable[[], dict[str, dict]] | None = None,
    ) -> None:
        if state_dir is None and source is None:
            raise ValueError("RouteResolver needs a state_dir (the routes file) or a source (e.g. the routes topic)")
        self.state_dir = state_dir
        self.source = source
        self.public_name = public_name
        self.base_served_name = base_served_name
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._routes: dict[str, Route] = {}
        self._read_at = float("-inf")

    def _current(self) -> dict[str, Route]:
        with self._lock:
            if time.monotonic() - self._read_at >= self.ttl_s:
                routes = read_routes(self.state_dir) if self.source is None else routes_from_dicts(self.source())  # type: ignore[arg-type]
                routes.setdefault(self.public_name, Route(self.base_served_name, None, ""))
                self._routes, self._read_at = routes, time.monotonic()
            return self._routes

    def __call__(self, public_name: str) -> tuple[str, str | None]:
        """The champion's ``(served name, version)``. Raises KeyError for a name that is neither routed
        nor the configured public name."""
        served, version, _ = self.route(public_name, None)
        return served, version

    def route(self, public_name: str, key: str | None) -> Resolved:
        """Like ``__call__``, with the canary split: when a challenger is routed, the routing ``key``
        (the hashed user id, else the trace id) goes to it when ``canary_bucket(key) < fraction * 10000``,
        so a user stays on one side. Raises KeyError for an unknown name."""
        try:
            route = self._current()[public_name]
        except KeyError:
            raise KeyError(f"unknown model {public_name!r}") from None
        if route.challenger_served_name is None:
            return Resolved(route.served_name, route.version, None)
        if key is not None and canary_bucket(key) < route.fraction * 10000:
            return Resolved(route.challenger_served_name, route.challenger_version, True)
        return Resolved(route.served_name, route.version, False)

    def names(self) -> list[str]:
        """The public model names, sorted."""
        return sorted(self._current())
