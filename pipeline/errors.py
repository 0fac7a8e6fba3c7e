"""Errors raised by the pipeline package.

One root, :class:`PipelineError`; subclasses also inherit the matching
built-in type.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Root of every error raised by ``pipeline``."""


class ConfigError(PipelineError, ValueError):
    """The configuration file is missing, unreadable or invalid.

    ``problems`` holds one human-readable line per problem found, so a caller
    can print every mistake at once.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


class StackError(PipelineError, RuntimeError):
    """A local service could not be started, checked or stopped."""


class PortInUseError(StackError):
    """A port the local stack needs is already taken by another process."""
