"""The ``hourglass`` command line (typer): :mod:`.main` holds the app, the
foundation commands and the console-script entry (``pipeline.cli.main:main``);
each other module registers one command group. ``app`` is exported here
(imported on first use, so ``python -m pipeline.cli.data`` and friends run alone)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typer import Typer

    app: Typer

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    if name == "app":
        from pipeline.cli.main import app

        return app
    raise AttributeError(f"module 'pipeline.cli' has no attribute {name!r}")
