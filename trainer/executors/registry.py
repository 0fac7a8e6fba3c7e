"""The executors by name (``rl.executor``): where a round's candidates train.

Each entry builds its executor from ``[rl]``, importing its module only when chosen (the local one
pulls in torch; the Ray one, Ray), so that the service and the round driver may hold an executor
without paying for what they do not use.
"""

from __future__ import annotations

from collections.abc import Callable

from trainer.config import ExecutorKind, RLConfig
from trainer.executors.executor import Executor


def _local(rl: RLConfig) -> Executor:
    from trainer.executors.local import LocalExecutor

    return LocalExecutor()


def _ray(rl: RLConfig) -> Executor:
    from trainer.executors.ray_executor import RayExecutor

    return RayExecutor(rl)


EXECUTORS: dict[ExecutorKind, Callable[[RLConfig], Executor]] = {
    ExecutorKind.LOCAL: _local,
    ExecutorKind.RAY: _ray,
}


def make_executor(rl: RLConfig) -> Executor:
    """The executor ``rl.executor`` names."""
    return EXECUTORS[ExecutorKind(rl.executor)](rl)
