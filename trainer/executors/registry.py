"""The executors by name (``rl.executor``): where a round's candidates train."""

from __future__ import annotations

from trainer.config import RLConfig
from trainer.executors.executor import Executor
from trainer.executors.local import LocalExecutor


def make_executor(rl: RLConfig) -> Executor:
    """The executor ``rl.executor`` names (``ray`` imports Ray only when it trains)."""
    if rl.executor == "ray":
        from trainer.executors.ray_executor import RayExecutor

        return RayExecutor(rl)
    return LocalExecutor()
