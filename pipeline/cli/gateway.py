"""``hourglass gateway``: serve the OpenAI-compatible gateway that emits traces.

``pipeline.cli.main`` calls :func:`register` to add the command. Run standalone with
``python -m pipeline.cli.gateway gateway --config FILE``.

The gateway itself lives in :mod:`connectors.gateway.app` (which never imports
``pipeline``); this module injects the route lookup: a
:class:`connectors.gateway.routes.RouteResolver` over the routes file the
serving controller writes, or, with ``serving.routes_source = "kafka"``, over
the routes topic it publishes to (:class:`connectors.gateway.route_feed.RouteFollower`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from connectors.errors import ConnectorError
from pipeline.config import HourglassConfig, load_config
from pipeline.errors import ConfigError

# The gateway's packages (fastapi, kafka-python, itsdangerous: the `gateway` extra) are imported where the gateway is
# built: `hourglass --help` needs only the core dependencies (tests/test_role_imports.py).
if TYPE_CHECKING:
    from fastapi import FastAPI

    from connectors.gateway.auth import FeedbackSigner, KeyStore
    from connectors.gateway.routes import RouteResolver

console = Console(stderr=True)
KEYS_FILE = "gateway-keys.json"
SIGNING_KEY_FILE = "gateway-feedback.key"


def route_resolver(cfg: HourglassConfig, *, ttl_s: float = 1.0, ready_wait_s: float = 30.0) -> RouteResolver:
    """The gateway's resolver for ``serving.routes_source``: the routes file, or a follower of ``kafka.routes_topic``
    started now (waiting up to ``ready_wait_s`` to have read the current routes; it keeps following after, and is
    the resolver's ``follower`` attribute). Only the configured public names (``serving.model_name`` and the
    candidates' ``served_model``) are routed; a route for any other name is ignored."""
    from connectors.gateway.routes import RouteResolver

    served = {c.served_model for c in cfg.candidates} | {cfg.serving.model_name}
    if cfg.serving.routes_source == "file":
        return RouteResolver(
            cfg.resolve(cfg.state_dir), cfg.serving.model_name, cfg.serving.base_served_name, ttl_s, models=served
        )
    from connectors.gateway.route_feed import RouteFollower

    follower = RouteFollower(cfg.kafka)
    if not follower.start(wait_s=ready_wait_s):
        logging.getLogger(__name__).warning(
            "routes topic %s not read within %.0fs (%s); serving the base until routes arrive",
            cfg.kafka.routes_topic,
            ready_wait_s,
            follower.last_error or "no answer",
        )
    resolver = RouteResolver(
        None,
        cfg.serving.model_name,
        cfg.serving.base_served_name,
        ttl_s=min(ttl_s, 0.1),
        source=follower.routes,
        models=served,
    )
    resolver.follower = follower  # type: ignore[attr-defined]
    return resolver


def key_store(cfg: HourglassConfig) -> KeyStore:
    """The gateway's API keys: ``<state_dir>/gateway-keys.json`` (0600; `hourglass keys` edits it)."""
    from connectors.gateway.auth import KeyStore

    return KeyStore(cfg.resolve(cfg.state_dir) / KEYS_FILE)


def feedback_signer(cfg: HourglassConfig) -> FeedbackSigner:
    """Signs feedback tokens with ``gateway.feedback_signing_key``, or a key generated once into
    ``<state_dir>/gateway-feedback.key`` (0600) when that is not set."""
    from connectors.gateway.auth import FeedbackSigner, load_or_create_secret

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
    from connectors.gateway.app import create_gateway_app
    from connectors.schema import UserHasher

    resolver = route_resolver(cfg, ttl_s=ttl_s)
    hasher = UserHasher(cfg.buffer.user_hash_key.get_secret_value(), cfg.buffer.user_id_keys)
    upstream_key = cfg.serving.api_key.get_secret_value() if cfg.serving.api_key else None
    return create_gateway_app(
        cfg.kafka,
        upstream_url(cfg),
        resolver,
        list_models=resolver.names,
        user_hasher=hasher,
        gateway=cfg.gateway,
        keys=key_store(cfg),
        signer=feedback_signer(cfg),
        trusted_metadata=cfg.buffer.trusted_metadata,
        reward_spec=cfg.buffer.reward,
        max_correction_chars=cfg.buffer.max_correction_chars,
        upstream_api_key=upstream_key,
        max_model_len=cfg.serving.max_model_len,
    )


def gateway(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="hourglass.toml (default: built-in embedded settings).")
    ] = None,
) -> None:
    """Serve the OpenAI-compatible gateway on api.host:api.gateway_port (traces go to Kafka)."""
    from connectors.gateway.app import serve_gateway
    from connectors.kafka_admin import ensure_topics

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
    serve_gateway(app, cfg.api.host, cfg.api.gateway_port, gateway=cfg.gateway)


def register(app: typer.Typer) -> None:
    """Add the ``gateway`` command to ``app``."""
    app.command("gateway")(gateway)


if __name__ == "__main__":
    _app = typer.Typer(no_args_is_help=True)
    _app.callback()(lambda: None)  # keep `gateway` as a subcommand (typer collapses a single command)
    register(_app)
    _app()
