"""``hourglass gateway``: serve the OpenAI-compatible gateway that emits traces.

``pipeline.cli`` calls :func:`register` to add the command. Run standalone with
``python -m pipeline.cli_gateway gateway --config FILE``.

The gateway itself lives in :mod:`connectors.gateway` (which never imports
``pipeline``); this module injects the route lookup: the routes file the
serving controller writes (:func:`pipeline.serving.read_routes`), or, with
``serving.routes_source = "kafka"``, the routes topic it publishes to
(:class:`connectors.route_feed.RouteFollower`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NamedTuple

import typer
from fastapi import FastAPI
from rich.console import Console

from connectors.auth import FeedbackSigner, KeyStore, load_or_create_secret
from connectors.errors import ConnectorError
from connectors.gateway import create_gateway_app, serve_gateway
from connectors.kafka_admin import ensure_topics
from connectors.schema import UserHasher
from pipeline.config import HourglassConfig, load_config
from pipeline.errors import ConfigError
from pipeline.serving import Route, read_routes

console = Console(stderr=True)
KEYS_FILE = "gateway-keys.json"
SIGNING_KEY_FILE = "gateway-feedback.key"


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
    """Public model name -> ``(vLLM served name, adapter version)`` from ``<state_dir>/routes.json``,
    or from ``source`` (e.g. a :class:`connectors.route_feed.RouteFollower`'s ``routes``: ``{model: route dict}``).

    A public name with a route goes to its versioned served name; the configured
    public name without a route goes to the base (``base_served_name``, version
    None); any other name raises ``KeyError``. The routes are re-read at most every
    ``ttl_s`` seconds, so a route flip reaches the gateway within ``ttl_s``.
    """

    def __init__(
        self, state_dir: str | Path | None, public_name: str, base_served_name: str, ttl_s: float = 1.0,
        *, source: Callable[[], dict[str, dict]] | None = None,
    ) -> None:  # fmt: skip
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
                routes = read_routes(self.state_dir) if self.source is None else _from_dicts(self.source())
                routes.setdefault(self.public_name, Route(self.base_served_name, None, ""))  # type: ignore[arg-type]
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


def _from_dicts(entries: dict[str, dict]) -> dict[str, Route]:
    """Route records of the routes topic as ``Route`` objects; unknown fields are ignored (a newer writer)."""
    names = set(Route.__dataclass_fields__)
    out: dict[str, Route] = {}
    for model, entry in entries.items():
        try:
            out[model] = Route(**{k: v for k, v in entry.items() if k in names})
        except TypeError:  # a required field missing: skip it, as the follower skips bad records
            continue
    return out


def route_resolver(cfg: HourglassConfig, *, ttl_s: float = 1.0, ready_wait_s: float = 30.0) -> RouteResolver:
    """The gateway's resolver for ``serving.routes_source``: the routes file, or a follower of ``kafka.routes_topic``
    started now (waiting up to ``ready_wait_s`` to have read the current routes; it keeps following after)."""
    if cfg.serving.routes_source == "file":
        return RouteResolver(cfg.resolve(cfg.state_dir), cfg.serving.model_name, cfg.serving.base_served_name, ttl_s)
    from connectors.route_feed import RouteFollower

    follower = RouteFollower(cfg.kafka)
    if not follower.start(wait_s=ready_wait_s):
        logging.getLogger(__name__).warning(
            "routes topic %s not read within %.0fs (%s); serving the base until routes arrive",
            cfg.kafka.routes_topic, ready_wait_s, follower.last_error or "no answer",
        )  # fmt: skip
    resolver = RouteResolver(None, cfg.serving.model_name, cfg.serving.base_served_name, ttl_s=min(ttl_s, 0.1), source=follower.routes)
    resolver.follower = follower  # type: ignore[attr-defined]  (closed with the app)
    return resolver


def key_store(cfg: HourglassConfig) -> KeyStore:
    """The gateway's API keys: ``<state_dir>/gateway-keys.json`` (0600; `hourglass keys` edits it)."""
    return KeyStore(cfg.resolve(cfg.state_dir) / KEYS_FILE)


def feedback_signer(cfg: HourglassConfig) -> FeedbackSigner:
    """Signs feedback tokens with ``gateway.feedback_signing_key``, or a key generated once into
    ``<state_dir>/gateway-feedback.key`` (0600) when that is not set."""
    configured = cfg.gateway.feedback_signing_key
    if configured is not None:
        return FeedbackSigner(configured.get_secret_value().encode(), cfg.gateway.feedback_token_ttl_s)
    path = cfg.resolve(cfg.state_dir) / SIGNING_KEY_FILE
    try:
        key = load_or_create_secret(path)
    except OSError as err:  # e.g. the gateway's read-only state mount in compose
        raise ConfigError(
            f"gateway.feedback_signing_key is not set and {path} cannot be created ({err}); "
            "set HOURGLASS_GATEWAY__FEEDBACK_SIGNING_KEY (e.g. `openssl rand -hex 32`, the same on every gateway)"
        ) from err
    return FeedbackSigner(key, cfg.gateway.feedback_token_ttl_s)


def upstream_url(cfg: HourglassConfig) -> str:
    """Where the gateway sends requests: ``gateway.upstream_url``, else the first serving replica."""
    return (cfg.gateway.upstream_url or cfg.serving.replicas[0]).rstrip("/")


def build_gateway(cfg: HourglassConfig, *, ttl_s: float = 1.0) -> FastAPI:
    """The gateway app for ``cfg``: upstream = :func:`upstream_url`, routes from :func:`route_resolver`, configured user hashing,
    API keys from the state dir, feedback tokens signed with :func:`feedback_signer`."""
    resolver = route_resolver(cfg, ttl_s=ttl_s)
    hasher = UserHasher(cfg.buffer.user_hash_key.get_secret_value(), cfg.buffer.user_id_keys)
    upstream_key = cfg.serving.api_key.get_secret_value() if cfg.serving.api_key else None
    return create_gateway_app(
        cfg.kafka, upstream_url(cfg), resolver, list_models=resolver.names, user_hasher=hasher, gateway=cfg.gateway,
        keys=key_store(cfg), signer=feedback_signer(cfg), trusted_metadata=cfg.buffer.trusted_metadata,
        reward_spec=cfg.buffer.reward, upstream_api_key=upstream_key,
    )  # fmt: skip


def gateway(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="hourglass.toml (default: built-in embedded settings).")] = None,
) -> None:
    """Serve the OpenAI-compatible gateway on api.host:api.gateway_port (traces go to Kafka)."""
    try:
        cfg = load_config(config)
    except ConfigError as err:
        console.print(f"[red]error:[/red] {err}")
        for problem in getattr(err, "problems", None) or []:
            console.print(f"  - {problem}")
        raise typer.Exit(2) from err
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ensure_topics(cfg.kafka)
    except ConnectorError as err:  # the gateway still serves; traces are counted as errors until Kafka is back
        console.print(f"[yellow]warning:[/yellow] {err}")
    auth = "API keys required" if cfg.gateway.require_api_key else "NO API KEYS (gateway.require_api_key = false)"
    console.print(
        f"gateway on http://{cfg.api.host}:{cfg.api.gateway_port}/v1 -> {upstream_url(cfg)} "
        f"(model {cfg.serving.model_name!r}, traces -> {cfg.kafka.traces_topic}, {auth})"
    )
    try:
        app = build_gateway(cfg)
    except ConfigError as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from err
    serve_gateway(app, cfg.api.host, cfg.api.gateway_port)


def register(app: typer.Typer) -> None:
    """Add the ``gateway`` command to ``app``."""
    app.command("gateway")(gateway)


if __name__ == "__main__":
    _app = typer.Typer(no_args_is_help=True)
    _app.callback()(lambda: None)  # keep `gateway` as a subcommand (typer collapses a single command)
    register(_app)
    _app()
