"""Errors raised by the trainer package.

One root, :class:`TrainerError`; subclasses also inherit the matching
built-in type.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Root of every error raised by ``trainer``."""


class ModelStoreError(TrainerError, RuntimeError):
    """A base model could not be materialised or failed its integrity check."""


class UnknownModelError(TrainerError, KeyError):
    """A model name is neither a known packaged model nor an existing folder."""
