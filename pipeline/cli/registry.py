"""CLI commands for the registry: ``promote``, ``rollback`` and ``models list``.

Wire them in with :func:`register`. The logic lives in
:mod:`pipeline.registry.aliases` (``promote``, ``rollback``, ``describe_model``) so the
ops API can call the same functions.
"""

from __future__ import annotations

from typing import Annotated

import httpx
import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from pipeline.cli.common import ConfigOpt, JsonOpt, emit, fail, load
from pipeline.config import HourglassConfig
from pipeline.errors import PipelineError

# MLflow, the registry and the serving replicas are imported by the commands that use them: `hourglass --help`
# and the commands of the other roles run without the service's packages (tests/test_role_imports.py).

ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Public model name (default: serving.model_name).")]


def replica_state(cfg: HourglassConfig) -> dict[str, object]:
    """``{replica url: names it serves}``, or ``"unreachable: ..."`` per replica."""
    from pipeline.serving.replica import Replica, ReplicaRefusedError, ReplicaUnreachableError

    state: dict[str, object] = {}
    for url in cfg.serving.replicas:
        replica = Replica(url, timeout_s=5.0)
        try:
            state[url] = replica.models()
        except (ReplicaUnreachableError, ReplicaRefusedError) as err:
            state[url] = f"unreachable: {err}"
        finally:
            replica.close()
    return state


def list_models(cfg: HourglassConfig, models: list[str] | None = None) -> dict:
    """Everything ``models list`` shows: per model its versions, aliases, lineage tags and
    route; per replica what it serves. Models not yet registered are listed with no versions."""
    from mlflow.exceptions import MlflowException

    from connectors.gateway.routes import read_routes
    from pipeline.registry import aliases
    from pipeline.registry.models import make_client

    client = make_client(cfg)
    routes = read_routes(cfg.resolve(cfg.state_dir))
    names = models or sorted({m.name for m in client.search_registered_models()} | {cfg.serving.model_name})
    out = []
    for name in names:
        try:
            entry = aliases.describe_model(client, name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            entry = {"model": name, "aliases": {}, "champion_history": [], "versions": []}
        route = routes.get(name)
        entry["route"] = vars(route) if route else None
        out.append(entry)
    return {"models": out, "replicas": replica_state(cfg)}


def require_mlflow(cfg: HourglassConfig) -> None:
    """Exit with a clear message when an HTTP tracking server does not answer within 5 s
    (MLflow's own client would retry for minutes, printing urllib3 warnings)."""
    uri = cfg.registry.tracking_uri
    if not uri.startswith(("http://", "https://")):
        return
    try:
        httpx.get(f"{uri.rstrip('/')}/health", timeout=5.0)  # any HTTP answer means a server is there
    except httpx.TransportError as err:
        fail(
            f"no MLflow tracking server answers at {uri} ({type(err).__name__}); start it with `hourglass up` or set registry.tracking_uri"
        )


def register(app: typer.Typer, models_app: typer.Typer) -> None:
    """Add ``promote`` and ``rollback`` to ``app`` and ``list`` to ``models_app``."""

    def run(fn, *args, **kwargs):
        from mlflow.exceptions import MlflowException

        try:
            return fn(*args, **kwargs)
        except (PipelineError, MlflowException) as err:
            fail(str(err))

    @app.command("promote")
    def promote_cmd(
        version: Annotated[str, typer.Argument(help="The model version to serve.")],
        model: ModelOpt = None,
        config: ConfigOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Move @champion to VERSION; the serving controller hot-loads it."""
        from pipeline.registry import aliases

        cfg = load(config)
        require_mlflow(cfg)
        result = run(aliases.promote, cfg, model or cfg.serving.model_name, version, reason="cli promote")
        emit(
            result,
            as_json,
            f"[green]{result['model']}[/]: @{cfg.registry.champion_alias} -> v{result['version']} "
            f"(was {'v' + result['previous'] if result['previous'] else 'the base model: no champion'})",
        )

    @app.command("rollback")
    def rollback_cmd(
        to: Annotated[
            str | None, typer.Option("--to", help="Version to return to (default: the previous champion).")
        ] = None,
        model: ModelOpt = None,
        config: ConfigOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Move @champion back to the previous champion (or --to VERSION)."""
        from pipeline.registry import aliases

        cfg = load(config)
        require_mlflow(cfg)
        result = run(aliases.rollback, cfg, model or cfg.serving.model_name, to)
        emit(
            result,
            as_json,
            f"[yellow]{result['model']}[/]: @{cfg.registry.champion_alias} -> v{result['version']} "
            f"(was {result['previous']})",
        )

    @models_app.command("resign")
    def resign_cmd(
        version: Annotated[str, typer.Argument(help="The model version to re-sign.")],
        model: ModelOpt = None,
        adopt: Annotated[
            bool, typer.Option("--adopt", help="Sign a version with no valid signature (you vouch for it).")
        ] = False,
        config: ConfigOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Re-sign VERSION with the current registry.signing_key (after a key rotation)."""
        from pipeline.registry.models import make_client
        from pipeline.registry.signing import resign

        cfg = load(config)
        require_mlflow(cfg)
        result = run(resign, cfg, make_client(cfg), model or cfg.serving.model_name, version, adopt=adopt)
        emit(
            result,
            as_json,
            f"[green]{result['model']}[/] v{result['version']}: signed with key {result['now']} (was {result['was']})",
        )

    @models_app.command("list")
    def list_cmd(
        model: ModelOpt = None,
        config: ConfigOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Registered versions, aliases, lineage, and what each replica serves."""
        cfg = load(config)
        require_mlflow(cfg)
        data = run(list_models, cfg, [model] if model else None)
        emit(data, as_json, _table(data))


def _table(data: dict) -> Table:
    from pipeline.registry.aliases import TAG_SERVE_ERROR

    table = Table("model", "version", "aliases", "round", "base", "serve error")
    for entry in data["models"]:
        for v in entry["versions"]:
            tags = v["tags"]
            table.add_row(  # plain text: MLflow tags are written by anyone with MLflow access, never Rich markup
                Text(entry["model"]),
                Text(str(v["version"])),
                Text(",".join(v["aliases"])),
                Text(tags.get("hourglass.round_id", "")),
                Text(tags.get("hourglass.base_fingerprint", "")[:12]),
                Text(tags.get(TAG_SERVE_ERROR, "")[:60]),
            )
    for url, served in data["replicas"].items():
        table.caption = (table.caption or "") + escape(f"{url}: {served}") + "\n"
    return table
