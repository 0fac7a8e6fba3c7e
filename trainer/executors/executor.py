"""Where a round's candidates train: the seam between the round and its workers.

:class:`trainer.round.RoundRecipe` hands its training phase to an executor (``rl.executor``,
:func:`trainer.executors.registry.make_executor`) and evaluates every candidate itself, on its own
resident base, with every candidate together:

- :class:`trainer.executors.local.LocalExecutor` trains every candidate in this process on the
  round's resident base (the step loop: step-major, one shared rollout call per step);
- :class:`trainer.executors.ray_executor.RayExecutor` splits the candidates over trainer actors on a
  Ray cluster; each actor runs :class:`~trainer.executors.local.LocalExecutor` on its share with its
  own resident base and adapter store, and the trained adapters come back through a ``pyarrow.fs``
  URI (:class:`trainer.executors.exchange.Exchange`).

Cost rule (:func:`estimate_cost`, :func:`assign`): a candidate's cost is the
tokens it pushes through the base per round, ``steps_per_round ×
prompts_per_step × group_size × max_new_tokens``, doubled for online
algorithms (``grpo`` / ``ppo_clip``: the rollouts generate those tokens and the
update scores them again); candidates go to actors greedy longest-first (the
costliest candidate to the least-loaded actor, ties by name and actor index).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trainer.config import ALGORITHM_TRAITS, CandidateConfig, ModelConfig, RewardModelConfig, RLConfig
from trainer.errors import TrainerConfigError
from trainer.types import PhaseHook, Prompt

if TYPE_CHECKING:
    from trainer.adapters.store import AdapterStore
    from trainer.model.base import ResidentBase
    from trainer.plan import RoundPlan
    from trainer.reward_model.model import RewardModel
    from trainer.rollout.engine import RolloutEngine

__all__ = ["Executor", "TrainJob", "TrainOutcome", "assign", "estimate_cost", "replica_requests"]


@dataclass(frozen=True)
class TrainJob:
    """The training phase of one round, as an executor receives it.

    ``starts``: candidate name -> the folder its adapter starts from (None:
    fresh), resolved by the round (champion, ``last``, or nothing).
    ``on_phase``: called with ``PhaseBoundary(RoundPhase.TRAIN, step=k)`` before every
    step; may raise to cancel. ``reward_model``: the round's reward model (live in the
    driver's store) and ``reward_cfg`` its ``[reward_model]`` settings (the Ray executor ships
    the model to the actors that need it and rebuilds it there with them). ``plan``: the round's
    :class:`trainer.plan.RoundPlan` when the caller has one (the driver); None on an actor, which
    plans its share itself.
    """

    model_cfg: ModelConfig
    candidates: tuple[CandidateConfig, ...]
    train_prompts: tuple[Prompt, ...]
    rl: RLConfig
    starts: dict[str, Path | None]
    out_dir: Path
    round_id: str
    progress: bool = False
    on_phase: PhaseHook | None = None
    reward_model: RewardModel | None = None
    plan: RoundPlan | None = None
    reward_cfg: RewardModelConfig | None = None


@dataclass
class TrainOutcome:
    """What training left behind: per-candidate step metrics, the final published version name
    of each candidate (live in the caller's engine and store), rollout metrics, and the
    executor's own metrics (``executor/...``)."""

    history: dict[str, list[dict[str, float]]]
    versions: dict[str, str]
    rollout_metrics: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)


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

    def train(self, job: TrainJob, base: ResidentBase, store: AdapterStore, engine: RolloutEngine) -> TrainOutcome: ...

    def close(self) -> None: ...


def replica_requests(engine: object) -> list[int]:
    """Requests a vLLM fleet engine sent to each of its replicas so far (``FleetEngine.requests_per_replica``);
    empty for other engines."""
    counts = getattr(engine, "requests_per_replica", None)
    return list(counts()) if callable(counts) else []


def estimate_cost(candidate: CandidateConfig, rl: RLConfig) -> int:
    """Base-token work of one candidate per round (see the module docstring); a relative unit."""
    tokens = rl.steps_per_round * rl.prompts_per_step * rl.rollout.group_size * rl.rollout.max_new_tokens
    return 2 * tokens if ALGORITHM_TRAITS[candidate.algorithm].online else tokens


def assign(candidates: Sequence[CandidateConfig], rl: RLConfig, actors: int) -> list[list[CandidateConfig]]:
    """Candidates split over ``actors`` workers, greedy longest-first by :func:`estimate_cost`.

    Returns one list per actor (in the candidates' configured order within each);
    an actor may get none when there are fewer candidates than actors.

    Raises:
        TrainerConfigError: ``actors`` < 1.
    """
    if actors < 1:
        raise TrainerConfigError(f"need at least one trainer actor, got {actors}")
    loads = [0] * actors
    shares: list[set[str]] = [set() for _ in range(actors)]
    for c in sorted(candidates, key=lambda c: (-estimate_cost(c, rl), c.name)):
        target = min(range(actors), key=lambda i: (loads[i], i))
        loads[target] += estimate_cost(c, rl)
        shares[target].add(c.name)
    return [[c for c in candidates if c.name in share] for share in shares]
