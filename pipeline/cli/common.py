"""Options and output helpers shared by every ``hourglass`` command module."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline.config import HourglassConfig, load_config
from pipeline.errors import ConfigError
from pipeline.redact import redact  # noqa: F401  (re-exported: the commands mask URIs with it)

console = Console(stderr=True, soft_wrap=True)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="hourglass.toml (default: built-in embedded default).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]


def emit(data: Any, as_json: bool, human: str | Table | None = None) -> None:
    """Print ``data`` as JSON on stdout, or the human form on the console."""
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    elif human is not None:
        Console(soft_wrap=True).print(human)


def print_error(message: str) -> None:
    """``error: message`` on stderr, credentials in URIs masked."""
    console.print(f"[bold red]error:[/] {escape(redact(message))}")


def fail(message: str, code: int = 1) -> None:
    """Print ``error: message`` (see :func:`print_error`) and exit with ``code``."""
    print_error(message)
    raise typer.Exit(code)


def load(config: Path | None) -> HourglassConfig:
    """Load the config or exit 2 listing every problem."""
    try:
        return load_config(config)
    except ConfigError as err:
        console.print(f"[bold red]error:[/] {escape(str(err))}")
        for problem in err.problems:
            console.print(f"  - {escape(problem)}")
        raise typer.Exit(2) from err
