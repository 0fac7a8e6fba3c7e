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


class TrainerConfigError(TrainerError, ValueError):
    """Candidates or RL settings that cannot work together (e.g. duplicate names)."""


class AdapterStoreError(TrainerError, KeyError):
    """A candidate is unknown to the adapter store, or created twice."""


class RewardError(TrainerError, ValueError):
    """A reward function is unknown, cannot be imported, or got unusable input."""


class RolloutError(TrainerError, RuntimeError):
    """A rollout engine failed: an HTTP error from vLLM, or a malformed answer."""


class DataError(TrainerError, ValueError):
    """A snapshot table lacks a column, or a row holds unreadable JSON."""
