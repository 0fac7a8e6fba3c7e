"""The main job on the embedded default (the README's first command).

Brings the local stack up (broker, MLflow, vLLM on the base model) and
reports health. Stop it with ``hourglass down``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from pipeline.cli import app


def main(config: Path = typer.Option(Path("deploy/hourglass.toml"), "--config", "-c")) -> None:
    """Start the local stack and show its health."""
    sys.argv = ["hourglass", "up", "--config", str(config)]
    app()


if __name__ == "__main__":
    typer.run(main)
