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


class SuiteError(TrainerError, ValueError):
    """A regression suite (``[[rl.regression]]``) cannot be read or scored: its file is missing or outside the
    working directory, a line is not a prompt, or its check cannot be imported or fails on an answer."""


class DataError(TrainerError, ValueError):
    """A snapshot table lacks a column, or a row holds unreadable JSON."""


class NotEnoughDataError(DataError):
    """The round's window holds too little of what it needs (held-out rows, training prompts a candidate can use,
    labelled feedback for the reward model): the round ends ``no_winner`` with this reason, not ``failed``."""


class ExecutorError(TrainerError, RuntimeError):
    """A trainer worker of a distributed round failed (e.g. a Ray actor died mid-round)."""


class ExecutorUnavailableError(TrainerError, ConnectionError):
    """The cluster a round's executor needs (``rl.ray.address``) did not answer in time."""


class PlacementTimeoutError(TrainerError, TimeoutError):
    """The cluster could not reserve every trainer actor of a round within ``rl.ray.placement_timeout_s``."""
