"""The ``local`` executor: every candidate trained in this process, on the round's resident base (the default,
and what each Ray trainer actor runs on its share)."""

from __future__ import annotations

from dataclasses import replace

from trainer.executors.executor import Routines, TrainJob, TrainOutcome, replica_requests
from trainer.plan import plan_round
from trainer.config import CandidateConfig, ModelConfig, RLConfig
from collections.abc import Sequence


class LocalExecutor:
    """Every candidate in this process, on the round's resident base (the default, and what each Ray actor runs)."""

    def __init__(self, routines: Routines) -> None:
        self.routines = routines

    def prepare(
        self, model_cfg: ModelConfig, candidates: Sequence[CandidateConfig], rl: RLConfig, round_id: str
    ) -> None:
        """Nothing to start: training runs in this process."""

    def close(self) -> None:
        """Nothing to give back."""

    def train(self, job: TrainJob, base: object, store: object, engine: object) -> TrainOutcome:
        plan = job.plan
        if plan is None:  # a trainer actor: plan its share on its own base, starting where the job says
            plan = plan_round(base, job.candidates, job.rl, job.train_prompts, {}, job.out_dir)  # type: ignore[arg-type]
            plan = replace(plan, candidates=tuple(replace(c, start=job.starts.get(c.name)) for c in plan.candidates))
        for c in plan.candidates:
            store.create(c.name, c.config, c.start)  # type: ignore[attr-defined]
        before = replica_requests(engine)
        trained, rollout = self.routines.train_candidates(
            base, store, engine, plan, job.rl, job.out_dir, job.progress, job.checkpoint, reward_model=job.reward_model
        )
        for j, (now, then) in enumerate(zip(replica_requests(engine), before)):
            rollout[f"rollout/replica{j}/requests"] = float(now - then)
        return TrainOutcome(trained.history, trained.versions, rollout)
