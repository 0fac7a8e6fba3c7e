"""``hourglass canary status|promote|abort``: the canary of each served model.

The logic lives in :mod:`pipeline.canary.ops` (shared with the ops API). The
commands talk to MLflow and read the buffer directly; a running service's
reconcile loop applies an alias move within ``serving.reconcile_interval_s``.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from pipeline.cli.common import ConfigOpt, JsonOpt, emit, fail, load
from pipeline.errors import PipelineError

ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Public model name (default: every served model).")]
canary_app = typer.Typer(
    help="Canary of a round's winner on live traffic: status, promote, abort.", no_args_is_help=True
)


def _models(cfg, model: str | None) -> list[str]:
    return [model] if model else sorted({c.served_model for c in cfg.candidates} | {cfg.serving.model_name})


def _run(fn, *args, **kwargs):
    from mlflow.exceptions import MlflowException  # here: `hourglass --help` runs without MLflow

    try:
        return fn(*args, **kwargs)
    except (PipelineError, MlflowException) as err:
        fail(str(err))


def _fmt(value) -> str:
    return "" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


@canary_app.command("status")
def status_cmd(model: ModelOpt = None, config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Each model's canary: version, share, live counts and rates, interval, decision so far."""
    from pipeline.canary.ops import canary_status
    from pipeline.cli.registry import require_mlflow

    cfg = load(config)
    require_mlflow(cfg)
    data = _run(canary_status, cfg, _models(cfg, model))
    emit(data, as_json, status_table(data))


def status_table(data: dict) -> Table:
    """The human form of ``canary status``; every cell is plain text (a model name or reason such as
    ``[/x]`` is never read as Rich markup)."""
    table = Table(
        "model",
        "challenger",
        "champion",
        "share",
        "started",
        "n (chall/champ)",
        "rate (chall/champ)",
        "interval",
        "decision",
    )
    for name, entry in data.items():
        view = entry["canary"]
        if view is None:
            table.add_row(Text(name), "-", "", "", "", "", "", "", "no canary")
            continue
        chall, champ = view.get("challenger") or {}, view.get("champion") or {}
        interval = f"[{_fmt(view.get('lower'))}, {_fmt(view.get('upper'))}]" if view.get("lower") is not None else ""
        table.add_row(
            Text(name),
            f"v{view['version']}",
            "base (no champion)" if view.get("control") == "base" else f"v{view.get('champion_version')}",
            f"{view['fraction']:.0%}",
            view.get("started_at") or "",
            f"{chall.get('n', 0)}/{champ.get('n', 0)}",
            f"{_fmt(chall.get('mean'))}/{_fmt(champ.get('mean'))}",
            interval,
            Text(f"{view['decision']}: {view.get('reason', '')}"),
        )
    return table


ReasonOpt = Annotated[str | None, typer.Option("--reason", help="Why, recorded with the decision on the version.")]


def _end(decision: str, model: str | None, config, as_json: bool, reason: str | None) -> None:
    from pipeline.canary.ops import end_canary
    from pipeline.cli.registry import require_mlflow

    cfg = load(config)
    require_mlflow(cfg)
    name = model or cfg.serving.model_name
    out = _run(end_canary, cfg, name, decision, who="cli", note=reason)
    colour = "green" if decision == "promote" else "yellow"
    emit(out, as_json, f"[{colour}]{escape(name)}[/]: canary of v{out['version']} ended: {decision}")


@canary_app.command("promote")
def promote_cmd(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Public model name (default: serving.model_name).")
    ] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    reason: ReasonOpt = None,
) -> None:
    """Promote the challenger now: @champion moves to it (its first champion when the base was the
    other side), @challenger is dropped."""
    _end("promote", model, config, as_json, reason)


@canary_app.command("abort")
def abort_cmd(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Public model name (default: serving.model_name).")
    ] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    reason: ReasonOpt = None,
) -> None:
    """Abort the canary now: @challenger is dropped and the version tagged; @champion does not move
    (with no champion, the base serves everything again)."""
    _end("abort", model, config, as_json, reason)


def register(app: typer.Typer) -> None:
    """Add the ``canary`` command group to ``app``."""
    app.add_typer(canary_app, name="canary")
