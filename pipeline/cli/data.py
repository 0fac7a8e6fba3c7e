"""Data-path commands: ``ingest``, ``produce``, ``replay``, ``buffer stats``, ``dlq list``.

``pipeline.cli.main`` calls :func:`register` to add them to the ``hourglass`` app.
Run standalone with ``python -m pipeline.cli.data COMMAND ...`` (same commands).
Every command takes ``--config FILE`` (``hourglass.toml``; relative paths in it
are relative to the current directory) and ``--json`` for machine output.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from connectors.config import check_topic_name
from connectors.errors import ConnectorError
from pipeline.cli.common import fail, print_error
from pipeline.config import HourglassConfig, load_config
from pipeline.errors import ConfigError

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="hourglass.toml (default: built-in embedded settings).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]

console = Console(stderr=True)


def _config(path: Path | None) -> HourglassConfig:
    try:
        return load_config(path)
    except ConfigError as err:
        problems = getattr(err, "problems", None) or []
        console.print(f"[red]error:[/red] {err}")
        for problem in problems:
            console.print(f"  - {problem}")
        raise typer.Exit(2) from err


def _emit(as_json: bool, data: dict[str, Any], title: str) -> None:
    if as_json:
        typer.echo(json.dumps(data, default=str))
        return
    table = Table(title=title, show_header=False)
    for key, value in data.items():  # Text: values may quote traffic or errors; never read as Rich markup
        table.add_row(
            Text(str(key)), Text(json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value))
        )
    Console().print(table)


def _fail(err: ConnectorError) -> typer.Exit:
    print_error(str(err))
    return typer.Exit(1)


def ingest(config: ConfigOpt = None, as_json: JsonOpt = False) -> None:
    """Run an ingest worker in the foreground until Ctrl-C / SIGTERM (Kafka -> reward buffer)."""
    from connectors.ingest import IngestWorker

    cfg = _config(config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = IngestWorker(cfg.kafka, cfg.buffer, otel=cfg.otel)
    stop = threading.Event()
    # Shutdown order: 1. the signal sets `stop`, 2. the worker finishes the batch in hand
    # (durable write, offset commit), 3. it closes the consumer (leaves the group), 4. we print stats.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    console.print(f"ingesting {cfg.kafka.traces_topic}, {cfg.kafka.feedback_topic} -> {cfg.buffer.root} (Ctrl-C stops)")
    try:
        worker.run(stop)
    except ConnectorError as err:
        raise _fail(err) from err
    _emit(as_json, worker.stats().as_metrics(), "ingest")


def _readable_file(path: Path) -> None:
    """Exit with a clear message unless ``path`` is a readable regular file (checked before any broker call)."""
    if not path.is_file():
        fail(f"{path}: no such file" if not path.exists() else f"{path}: not a regular file")
    try:
        path.open("rb").close()
    except OSError as err:
        fail(f"{path}: cannot be read: {err.strerror}")


def produce(
    file: Annotated[Path, typer.Argument(help="JSON-lines file, one event per line (sent verbatim).")],
    topic: Annotated[
        str | None, typer.Option("--topic", "-t", help="Target topic (default: the traces topic).")
    ] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Backfill: send a JSON-lines file to a topic and wait for every acknowledgement."""
    from connectors.kafka_admin import ensure_topics
    from connectors.sink import produce_jsonl

    cfg = _config(config)
    _readable_file(file)
    if topic is not None:
        try:
            check_topic_name(topic)
        except ValueError as err:
            fail(f"--topic: {err}")
        if topic == cfg.kafka.routes_topic:  # routes are the serving controller's alone (verified versions only)
            fail(
                f"--topic: {topic!r} is the routes topic, written only by the serving controller; "
                "to change what is served, move the alias (`hourglass promote VERSION` or `hourglass rollback`)"
            )
    try:
        ensure_topics(cfg.kafka)
        acked = produce_jsonl(cfg.kafka, topic or cfg.kafka.traces_topic, file)
    except ConnectorError as err:
        raise _fail(err) from err
    _emit(as_json, {"topic": topic or cfg.kafka.traces_topic, "acknowledged": acked}, "produce")


def replay(
    sharegpt: Annotated[
        int | None, typer.Option("--sharegpt", help="Publish at most this many ShareGPT conversations.")
    ] = None,
    sharegpt_file: Annotated[
        Path | None,
        typer.Option(
            "--sharegpt-file", help="ShareGPT file to replay (a JSON array or JSON lines; default: the shipped dump)."
        ),
    ] = None,
    jsonl: Annotated[
        Path | None, typer.Option("--jsonl", help="Publish validated trace events from this file.")
    ] = None,
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Replay ShareGPT conversations or a trace JSON-lines file into the traces topic.

    A ShareGPT record that is not a usable conversation is dead-lettered with its reason (see
    ``hourglass dlq list``); the command prints how many were replayed and dead-lettered by reason.
    """
    from connectors.dead_letter import DeadLetterStore
    from connectors.kafka_admin import ensure_topics
    from connectors.replay import read_trace_jsonl, replay_sharegpt
    from connectors.sink import TraceSink, produce_events

    cfg = _config(config)
    use_sharegpt = sharegpt is not None or sharegpt_file is not None
    if use_sharegpt == (jsonl is not None):
        console.print("[red]error:[/red] give --sharegpt N and/or --sharegpt-file FILE, or --jsonl FILE")
        raise typer.Exit(2)
    if sharegpt is not None and sharegpt < 1:
        fail(f"--sharegpt must be at least 1, got {sharegpt}")
    for path in (sharegpt_file, jsonl):
        if path is not None:
            _readable_file(path)
    try:
        ensure_topics(cfg.kafka)
        if use_sharegpt:
            report = replay_sharegpt(cfg.kafka, sharegpt, sharegpt_file, DeadLetterStore(cfg.buffer.dead_letter_root))
            result = {"topic": cfg.kafka.traces_topic, "acknowledged": report.replayed, **report.as_dict()}
        else:
            with TraceSink(cfg.kafka) as sink:
                acked = produce_events(sink, read_trace_jsonl(jsonl))  # type: ignore[arg-type]
            result = {"topic": cfg.kafka.traces_topic, "acknowledged": acked}
    except ConnectorError as err:
        raise _fail(err) from err
    _emit(as_json, result, "replay")


buffer_app = typer.Typer(help="Inspect the Arrow reward buffer.", no_args_is_help=True)
dlq_app = typer.Typer(help="Inspect the dead-letter store.", no_args_is_help=True)


@buffer_app.command("stats")
def buffer_stats(
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    lag: Annotated[bool, typer.Option("--lag/--no-lag", help="Ask the broker for the consumer-group lag.")] = True,
) -> None:
    """Rows, partitions, bytes, reward coverage and consumer lag of the buffer."""
    from connectors.buffer import RewardBuffer
    from connectors.kafka_admin import consumer_group_lag

    cfg = _config(config)
    buffer = RewardBuffer(cfg.buffer)
    stats = buffer.stats().as_dict()
    snap = buffer.snapshot()
    rewarded = snap.num_rows - snap["reward"].null_count
    stats |= {
        "unique_traces": snap.num_rows,
        "rewarded_traces": rewarded,
        "reward_coverage": rewarded / snap.num_rows if snap.num_rows else 0.0,
    }
    if lag:
        try:
            stats["lag_records"] = consumer_group_lag(cfg.kafka)
        except ConnectorError as err:
            stats["lag_records"] = None
            stats["lag_error"] = str(err)
    _emit(as_json, stats, f"buffer {cfg.buffer.root}")


@dlq_app.command("list")
def dlq_list(
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    limit: Annotated[int | None, typer.Option(help="Show at most this many.")] = None,
    reason: Annotated[str | None, typer.Option(help="Only this reason code (e.g. invalid_json).")] = None,
) -> None:
    """Dead-lettered records with reason and Kafka coordinates (oldest first)."""
    from connectors.dead_letter import DeadLetterStore

    cfg = _config(config)
    store = DeadLetterStore(cfg.buffer.dead_letter_root)
    rows = store.list(limit=limit, reason=reason)
    if store.skipped_lines:
        console.print(
            f"[yellow]warning:[/yellow] skipped {store.skipped_lines} damaged line(s) in {cfg.buffer.dead_letter_root}"
        )
    if as_json:
        typer.echo(json.dumps({"count": len(rows), "skipped_lines": store.skipped_lines, "dead_letters": rows}))
        return
    table = Table("reason", "topic", "partition", "offset", "detail", title=f"dead letters ({len(rows)})")
    for row in rows:
        # Text cells: details quote traffic (a ShareGPT role, a field value); never read as Rich markup
        table.add_row(
            *(Text(str(row.get(k))) for k in ("reason", "topic", "partition", "offset")),
            Text(str(row.get("detail"))[:100]),
        )
    Console().print(table)


def register(app: typer.Typer) -> None:
    """Add ``ingest``, ``produce``, ``replay`` and the ``buffer`` / ``dlq`` sub-apps to ``app``."""
    app.command("ingest")(ingest)
    app.command("produce")(produce)
    app.command("replay")(replay)
    app.add_typer(buffer_app, name="buffer")
    app.add_typer(dlq_app, name="dlq")


if __name__ == "__main__":
    _app = typer.Typer(no_args_is_help=True)
    register(_app)
    _app()
