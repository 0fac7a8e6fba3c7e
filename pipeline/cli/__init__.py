"""The ``hourglass`` command line (typer): :mod:`pipeline.cli.main` holds the app
and the foundation commands; each other module registers one command group.

``app`` is exported here and :func:`main` is the console-script entry
(``pipeline.cli:main``); both import :mod:`pipeline.cli.main` on first use, so
``python -m pipeline.cli.data`` and friends run on their own. Once that module is
imported, the attribute ``pipeline.cli.main`` is the module (Python binds
submodules on their package); code calls ``pipeline.cli.main.main``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typer import Typer

    app: Typer

__all__ = ["app", "main"]


def main() -> None:
    """The ``hourglass`` console script: run the command line (see :func:`pipeline.cli.main.main`)."""
    from pipeline.cli.main import main as run

    run()


def __getattr__(name: str) -> Any:
    if name == "app":
        from pipeline.cli.main import app

        return app
    raise AttributeError(f"module 'pipeline.cli' has no attribute {name!r}")
