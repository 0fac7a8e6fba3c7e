"""The ``ray`` executor: a round's candidates trained by actors on a Ray cluster.

What runs where (one round):

- the round driver (the service, or ``hourglass round``) connects to the
  cluster (``rl.ray.address``; a clear :class:`ExecutorUnavailableError`
  after ``rl.ray.connect_timeout_s``) and, as soon as the round starts
  (:meth:`RayExecutor.prepare`, before the base load, the plan, the prompts'
  tokenisation and the reward model), requests one placement group bundle per
  trainer actor (``rl.ray.actor_cpus`` CPUs and, on GPU clusters, 1 GPU each)
  and submits the actors into it, so their start-up overlaps the driver's own
  work; :meth:`RayExecutor.train` then waits for the placement at most
  ``rl.ray.placement_timeout_s`` (:class:`PlacementTimeoutError` with the
  cluster's free resources) and for the actors' start-up
  (:mod:`trainer.executors.ray_pool`);
- each :class:`TrainerActor` loads its own resident base, makes its own
  adapter store and rollout engine (``rl.rollout.engine``: the vLLM fleet from
  config, placed by the round's candidate order so that candidate ``i`` uses
  replica ``i mod N`` whichever actor trains it, or transformers on the actor),
  and trains its share of the candidates (:func:`assign`, cost rule below) with
  :class:`trainer.executors.local.LocalExecutor` — the local code path, unchanged;
- the round's reward model (trained by the driver, like the local round
  does) goes out once, as its adapter folder plus scalar head, and each actor
  whose share has a candidate on ``reward_model`` loads it onto its own
  resident base and scores its rollouts with it;
- start adapters and the reward model go out and trained adapters and
  per-actor results come back through ``<rl.ray.storage_uri>/<round_id>/``
  (:class:`trainer.executors.exchange.Exchange`, any ``pyarrow.fs`` filesystem):
  ``start/<candidate>/``, ``reward_model/``, ``adapters/<candidate>/``,
  ``results/actor-<i>.json``;
- the driver loads every trained adapter into its own store and engine, and
  the round evaluates and gates all candidates together, as with ``local``.

Whatever happens (success, an actor killed mid-round, a cancel, a timeout),
the round's actors are killed, its placement group is removed and its
exchange folder is deleted before :meth:`RayExecutor.train` returns or raises
— except that with ``rl.ray.keep_actors`` (on in the service) a *successful*
round, or one that failed before training, keeps its actors (resident bases
loaded) for the next round of this process, which then skips the start-up.
Cost rule (:func:`estimate_cost`, :func:`assign`): a candidate's cost is the tokens it pushes through the
base per round, ``steps_per_round × prompts_per_step × group_size × max_new_tokens``, doubled for online
algorithms (``grpo`` / ``ppo_clip``: the rollouts generate those tokens and the update scores them again);
candidates go to actors greedy longest-first (the costliest candidate to the least-loaded actor, ties by
name and actor index).

Upstream API: https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from trainer.executors import ray_pool
from trainer.adapters.store import AdapterStore
from trainer.config import ALGORITHM_TRAITS, CandidateConfig, ModelConfig, RLConfig, uses_reward_model
from trainer.errors import DataError, ExecutorError, TrainerConfigError, TrainerError
from trainer.executors.exchange import Exchange, local_scratch
from trainer.executors.ray_actor import TrainerActor
from trainer.executors.ray_pool import actor_count, connect, release_kept_actors
from trainer.model.base import ResidentBase
from trainer.plan import RoundPlan
from trainer.reward_model.model import RewardModel
from trainer.rollout.engine import RolloutEngine
from trainer.types import PhaseBoundary, RoundPhase, TrainJob, TrainOutcome

log = logging.getLogger(__name__)

__all__ = ["RayExecutor", "TrainerActor", "actor_count", "connect", "release_kept_actors"]

POLL_S = ray_pool.POLL_S  # how often the driver checks actors, progress and a cancel


class RayExecutor:
    """Trains a round's candidates on trainer actors of a Ray cluster (see the module docstring); each
    actor runs :class:`~trainer.executors.local.LocalExecutor` on its share.

    One instance serves one round: :meth:`prepare` (optional, early), :meth:`train`, :meth:`close`;
    between rounds, :meth:`warm` and :meth:`release` manage the actors kept for the next one.
    """

    def __init__(self, rl: RLConfig) -> None:
        self.rl = rl
        self._pool: ray_pool.Pool | None = None
        self._size = 0
        self._metrics: dict[str, float] = {}
        self._keep = False

    @property
    def keeps_workers(self) -> bool:
        """``rl.ray.keep_actors``: the trainer actors (placement group and resident bases) stay between rounds."""
        return bool(self.rl.ray.keep_actors)

    def warm(self, model_cfg: ModelConfig, candidates: int) -> bool:
        """Start (place and load) the trainer actors of a round with ``candidates`` candidates now and keep them
        for it (unless kept ones fit); returns at once after connecting. False when a round holds them (nothing done).

        Raises:
            ExecutorUnavailableError: the cluster does not answer.
        """
        return ray_pool.warm(self.rl, model_cfg, candidates)

    def release(self) -> None:
        """Kill the trainer actors kept between rounds and free their placement group."""
        ray_pool.release_kept_actors()

    def prepare(self, model_cfg: ModelConfig, candidates: Sequence[CandidateConfig], round_id: str) -> None:
        """Start the round's trainer actors now (placement requested, bases loading) so that their start-up
        overlaps the driver's own work before training; :meth:`train` waits for them.

        Raises:
            ExecutorUnavailableError: the cluster does not answer (the round fails at its start).
        """
        rl = self.rl
        if self._pool is None:
            self._keep = bool(rl.ray.keep_actors)
            self._pool, self._size, self._metrics = ray_pool.acquire(
                rl, model_cfg, len(candidates), f"hourglass-{round_id}"
            )

    def close(self) -> None:
        """Give back actors :meth:`prepare` started that :meth:`train` never used (the round failed or was
        cancelled before training): kept with ``rl.ray.keep_actors`` (they are healthy), else killed."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            ray_pool.release(pool, keep=self._keep)

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
        """Each actor plans its own share (``plan`` is not shipped); ``reward_model`` goes to the actors whose
        candidates need it, as files.

        Raises:
        ExecutorUnavailableError: the cluster does not answer.
        PlacementTimeoutError: the actors could not all be placed in time.
        ExecutorError: an actor could not start, died or failed; nothing of the round is kept.
        DataError: a candidate uses ``reward_model`` but the round has no reward model.
        A :class:`~trainer.errors.TrainerError` an actor raised (e.g. ``DataError``) is re-raised as is.
        """
        import ray

        rl = job.rl
        scored = [c.name for c in job.candidates if uses_reward_model(c)]
        if scored and (reward_model is None or job.reward_cfg is None):
            raise DataError(f"candidates {scored} use reward 'reward_model' but the round has no reward model")
        self.prepare(job.model_cfg, job.candidates, job.round_id)
        pool, metrics = self._pool, dict(self._metrics)
        assert pool is not None
        shares = [s for s in assign(job.candidates, rl, self._size) if s]
        exchange = Exchange(rl.ray.storage_uri or str((job.out_dir / "exchange").resolve()), job.round_id)
        kept = False
        try:
            remote_starts = []
            for name, folder in job.starts.items():
                if folder is not None:
                    exchange.put_dir(folder, "start", name)
                    remote_starts.append(name)
            if scored:
                assert reward_model is not None
                _ship_reward_model(job, reward_model, exchange)

            def who(i: int) -> str:
                return f"trainer actor {i} (candidates {[c.name for c in shares[i]] if i < len(shares) else []})"

            metrics["executor/actors_reused"] = float(pool.rounds > 0)
            metrics["executor/placement_wait_s"] = ray_pool.wait_placed(pool, rl, f"round {job.round_id}", job.on_phase)
            metrics["executor/start_wait_s"] = ray_pool.wait_started(pool, len(shares), who, job.on_phase)
            started = time.perf_counter()
            prompts = ray.put(job.train_prompts)
            order = [c.name for c in job.candidates]
            refs = {}
            for i, share in enumerate(shares):
                sub = replace(
                    job,
                    candidates=tuple(share),
                    train_prompts=(),
                    starts={},
                    on_phase=None,
                    progress=False,
                )
                needs_rm = any(uses_reward_model(c) for c in share)
                refs[
                    pool.actors[i].train.remote(
                        sub,
                        prompts,
                        exchange.uri,
                        [n for n in remote_starts if n in {c.name for c in share}],
                        i,
                        order,
                        job.reward_cfg if needs_rm else None,
                    )
                ] = i
            paths = _await(job, pool.actors, who, refs)
            wall = time.perf_counter() - started
            outcome = _collect(job, exchange, paths, shares, store, engine, metrics, wall)
            pool.rounds += 1
            kept = self._keep
            return outcome
        finally:
            self._pool = None
            ray_pool.release(pool, keep=kept)
            exchange.remove()


def _ship_reward_model(job: TrainJob, reward_model: RewardModel, exchange: Exchange) -> None:
    """The round's reward model (adapter folder + ``reward_head.safetensors``) to ``reward_model/`` of the exchange."""
    scratch = local_scratch(f"hourglass-{job.round_id}-reward-")
    try:
        folder = reward_model.save(scratch / "reward_model")
        exchange.put_dir(folder, "reward_model")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _await(job: TrainJob, actors: list, who: Any, refs: dict) -> dict[int, str]:
    """Results of every actor; a cancel (``job.on_phase``) is checked every :data:`POLL_S`.

    Raises ExecutorError on an actor's death, or re-raises a TrainerError it raised."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

    pending, paths, step = dict(refs), {}, 0
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        for ref in ready:
            i = pending.pop(ref)
            try:
                paths[i] = ray.get(ref)
            except RayActorError as err:
                raise ExecutorError(
                    f"{who(i)} died mid-round: {ray_pool._first_line(err)}; the round keeps nothing it trained"
                ) from err
            except RayTaskError as err:
                if isinstance(err.cause, TrainerError):
                    raise err.cause from err
                raise ExecutorError(f"{who(i)} failed: {type(err.cause).__name__}: {err.cause}") from err
            except RayError as err:  # e.g. OutOfMemoryError: Ray's memory monitor killed the worker
                raise ExecutorError(
                    f"{who(i)} was lost mid-round: {type(err).__name__}: {ray_pool._first_line(err)}; the round keeps "
                    "nothing it trained"
                ) from err
        if pending and job.on_phase is not None:
            try:
                phases = ray.get([actors[i].progress.remote() for i in pending.values()], timeout=POLL_S)
                step = min([int(p.split(":")[1]) for p in phases if p.startswith("train:")], default=step)
            except (RayError, GetTimeoutError):
                pass  # still starting, or dead (its train() reference says so)
            job.on_phase(PhaseBoundary(RoundPhase.TRAIN, step=step))  # a cancel takes effect here
    return paths


def _collect(
    job: TrainJob,
    exchange: Exchange,
    paths: dict[int, str],
    shares: list,
    store: AdapterStore,
    engine: RolloutEngine,
    metrics: dict[str, float],
    wall: float,
) -> TrainOutcome:
    """Read every actor's results, load every trained adapter into the driver's store and engine.

    Rollout metrics are summed over actors, ``rollout/replica<j>/requests`` too (the requests
    the actors sent to vLLM replica ``j`` of ``rl.rollout.urls``; fleets only)."""
    history: dict[str, Any] = {}
    versions: dict[str, Any] = {}
    rollout = {"rollout/s": 0.0, "rollout/tokens": 0.0}
    for i in sorted(paths):
        result = json.loads(exchange.get_text(paths[i]))
        history |= result["history"]
        versions |= result["versions"]
        for key, value in result["rollout"].items():
            if key in ("rollout/s", "rollout/tokens") or key.startswith("rollout/replica"):
                rollout[key] = rollout.get(key, 0.0) + value
        metrics |= {
            f"executor/actor{i}/busy_s": result["busy_s"],
            f"executor/actor{i}/load_s": result["load_s"],
            f"executor/actor{i}/utilisation": result["busy_s"] / max(wall, 1e-9),
        }
    rollout["rollout/tokens_per_s"] = rollout["rollout/tokens"] / max(rollout["rollout/s"], 1e-9)
    for share in shares:
        for c in share:
            folder = exchange.get_dir(
                job.out_dir / c.name / "versions" / versions[c.name].rsplit("-", 1)[1], "adapters", c.name
            )
            store.create(c.name, c, folder)
            engine.load(c.name, versions[c.name], folder)
    metrics |= {"executor/actors": float(len(shares)), "executor/train_wall_s": wall}
    return TrainOutcome(history, versions, rollout, metrics)


def estimate_cost(candidate: CandidateConfig, rl: RLConfig) -> int:
    """Base-token work of one candidate per round (:func:`assign`); a relative unit."""
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
