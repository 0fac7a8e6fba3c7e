"""Where a round's wall time goes: phase timers that add up into round metrics.

``with phase("time/rollout_s"): ...`` adds the block's wall time to the
metric ``time/rollout_s`` of the :func:`collect` block it runs in (a no-op
outside one). The metric key is the timer's name. Phases do not nest: a
phase started inside another one is counted in the outer one only, so the
phase totals never sum to more than the wall time of the ``collect`` block.

Phase keys of a training round (seconds, summed over steps and candidates), as the
round's code names them (:mod:`trainer.round` and the step loop of :mod:`trainer.executors.local`):
``time/setup_s`` (the components: executor, base, plan, adapter store, engine, reward model),
``time/reward_model_s`` (training and measuring the round's reward model), ``time/rollout_s``,
``time/reference_s`` (adapters-off forward passes of the update), ``time/forward_backward_s``,
``time/optimizer_s`` (clip + AdamW step, and in ``one_pass`` mode the weight and state copies to
and from the adapter store), ``time/publish_s`` (adapter save + rollout engine load),
``time/evaluate_s``, ``time/save_s`` (the final adapters kept); the round job adds ``time/register_s``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass

PHASES = (
    "time/setup_s",
    "time/reward_model_s",
    "time/rollout_s",
    "time/reference_s",
    "time/forward_backward_s",
    "time/optimizer_s",
    "time/publish_s",
    "time/evaluate_s",
    "time/save_s",
)

_totals: ContextVar[dict[str, float] | None] = ContextVar("hourglass_phase_totals", default=None)
_open: ContextVar[bool] = ContextVar("hourglass_phase_open", default=False)


@dataclass
class Collection:
    """Phase totals being collected (``totals``: every key of :data:`PHASES`, seconds)."""

    totals: dict[str, float]
    token: Token


def start() -> Collection:
    """Start collecting phase times in this context; pair with :func:`stop` (or use :func:`collect`)."""
    totals = dict.fromkeys(PHASES, 0.0)
    return Collection(totals, _totals.set(totals))


def stop(collection: Collection) -> dict[str, float]:
    """Stop collecting; returns the totals (also in ``collection.totals``)."""
    _totals.reset(collection.token)
    return collection.totals


@contextlib.contextmanager
def collect() -> Iterator[dict[str, float]]:
    """Collect phase times of the block into the yielded dict (every key of :data:`PHASES` present, seconds)."""
    collection = start()
    try:
        yield collection.totals
    finally:
        stop(collection)


@contextlib.contextmanager
def phase(key: str) -> Iterator[None]:
    """Add the block's wall time (``time.perf_counter``, seconds) to ``key`` of the current collection.

    Inside another phase, or outside :func:`collect`, the block is not counted.
    """
    totals = _totals.get()
    if totals is None or _open.get():
        yield
        return
    token = _open.set(True)
    started = time.perf_counter()
    try:
        yield
    finally:
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - started
        _open.reset(token)
