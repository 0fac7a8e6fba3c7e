"""Where a round's candidates train: the seam between the round and its workers.

:class:`trainer.round.RoundRecipe` hands its training phase (a :class:`~trainer.types.TrainJob`) to an
executor (``rl.executor``, :func:`make_executor`) and evaluates every candidate itself, on its own
resident base, with every candidate together:

- :class:`trainer.executors.local.LocalExecutor` trains every candidate in this process on the
  round's resident base (the step loop: step-major, one shared rollout call per step);
- :class:`trainer.executors.ray_executor.RayExecutor` splits the candidates over trainer actors on a
  Ray cluster; each actor runs :class:`~trainer.executors.local.LocalExecutor` on its share with its
  own resident base and adapter store, and the trained adapters come back through a ``pyarrow.fs``
  URI (:class:`trainer.executors.exchange.Exchange`).

The Ray executor splits candidates over actors by their cost
(:func:`trainer.executors.ray_executor.assign`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from trainer.config import CandidateConfig, ExecutorKind, ModelConfig, RLConfig
from trainer.types import TrainJob, TrainOutcome

if TYPE_CHECKING:
    from trainer.adapters.store import AdapterStore
    from trainer.model.base import ResidentBase
    from trainer.plan import RoundPlan
    from trainer.reward_model.model import RewardModel
    from trainer.rollout.engine import RolloutEngine

__all__ = ["EXECUTORS", "Executor", "make_executor"]


class Executor(Protocol):
    """Trains a round's candidates; afterwards each is live in ``store`` and ``engine`` under ``versions[name]``.

    Around rounds, the round driver calls :meth:`warm` when a round starts (its workers' start-up then
    overlaps the snapshot) and :meth:`release` after it unless the executor :attr:`keeps_workers`; the
    always-on service also warms them after its start and after every round when it keeps them, and
    releases them at its shutdown. Inside a round, the trainer calls :meth:`prepare` first thing (before
    its base load, plan and reward model: an executor may start its workers then, to overlap their
    start-up), :meth:`train` once, and :meth:`close` at its end, whatever happened."""

    @property
    def keeps_workers(self) -> bool:
        """Whether workers stay up between rounds (then the service keeps them warm)."""
        ...

    def warm(self, model_cfg: ModelConfig, candidates: int) -> bool:
        """Start the workers of a round with ``candidates`` candidates now, kept for it; True when some were."""
        ...

    def release(self) -> None:
        """Give back the workers kept between rounds."""
        ...

    def prepare(self, model_cfg: ModelConfig, candidates: Sequence[CandidateConfig], round_id: str) -> None: ...

    def train(
        self,
        job: TrainJob,
        base: ResidentBase,
        store: AdapterStore,
        engine: RolloutEngine,
        *,
        plan: RoundPlan | None = None,
        reward_model: RewardModel | None = None,
    ) -> TrainOutcome:
        """Train ``job``'s candidates. ``plan``: the round's :class:`~trainer.plan.RoundPlan` when the caller
        has one (the driver; None on an actor, which plans its share itself); ``reward_model``: the round's
        reward model, live in ``store``, when candidates are scored with it."""
        ...

    def close(self) -> None: ...


def _local(rl: RLConfig) -> Executor:
    from trainer.executors.local import LocalExecutor  # torch: imported when chosen

    return LocalExecutor()


def _ray(rl: RLConfig) -> Executor:
    from trainer.executors.ray_executor import RayExecutor  # ray: imported when chosen

    return RayExecutor(rl)


EXECUTORS: dict[ExecutorKind, Callable[[RLConfig], Executor]] = {
    ExecutorKind.LOCAL: _local,
    ExecutorKind.RAY: _ray,
}
"""The executors by name (``rl.executor``); each imports its module only when chosen, so that the service and
the round driver may hold an executor without paying for what they do not use."""


def make_executor(rl: RLConfig) -> Executor:
    """The executor ``rl.executor`` names."""
    return EXECUTORS[ExecutorKind(rl.executor)](rl)
