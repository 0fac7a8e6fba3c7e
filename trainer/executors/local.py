"""The ``local`` executor: every candidate trained in this process, on the round's resident base (the
default, and what each Ray trainer actor runs on its share), by the step loop below.

:meth:`LocalExecutor.train` runs ``rl.steps_per_round`` steps, step-major (every candidate's step ``k``
before any candidate's step ``k + 1``). Each step's numbered phases, each timed under its metric key
(:mod:`trainer.timers`):

1. prompts: the same draw for every online candidate (a fair race);
2. rollouts of all online candidates in one engine call (``time/rollout_s``), then the rollouts of
   candidates whose reward uses ``reward_model`` scored in one batched pass;
3. per candidate its batch and update on the resident base (``time/reference_s``,
   ``time/forward_backward_s``, ``time/optimizer_s``); with ``rl.update.mode = "one_pass"`` the one-pass
   algorithms' candidates of the step update together afterwards
   (:func:`trainer.multi_lora.one_pass.train_one_pass`);
4. each candidate's new weights published to the engine under a new name (``time/publish_s``), the old
   one unloaded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.progress import Progress

from trainer import timers
from trainer.adapters.store import AdapterStore
from trainer.algorithms.batch import Batch, StepData
from trainer.algorithms.update import StartReference, update_step
from trainer.config import CandidateConfig, ModelConfig, RLConfig, uses_reward_model
from trainer.errors import DataError
from trainer.model.base import ResidentBase
from trainer.multi_lora.one_pass import train_one_pass
from trainer.plan import CandidatePlan, PromptTokens, RoundPlan, draw_prompts, plan_round
from trainer.reward_model.model import RewardModel
from trainer.reward_model.phase import score_rollouts
from trainer.rollout.engine import RolloutEngine
from trainer.types import PhaseBoundary, PhaseHook, Prompt, RolloutRequest, RoundPhase, Sample, TrainJob, TrainOutcome


class LocalExecutor:
    """Every candidate in this process, on the round's resident base (the default, and what each Ray actor runs)."""

    keeps_workers = False  # nothing outlives a round

    def warm(self, model_cfg: ModelConfig, candidates: int) -> bool:
        """Nothing to start ahead of a round: training runs in this process."""
        return False

    def release(self) -> None:
        """Nothing kept between rounds."""

    def prepare(self, model_cfg: ModelConfig, candidates: Sequence[CandidateConfig], round_id: str) -> None:
        """Nothing to start: training runs in this process."""

    def close(self) -> None:
        """Nothing to give back."""

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
        """Create every candidate in ``store`` at its start point and run the step loop (module docstring).

        Raises:
            DataError: a candidate uses ``reward_model`` but no reward model is given.
        """
        if plan is None:  # a trainer actor: plan its share on its own base, starting where the job says
            plan = plan_round(base, job.candidates, job.rl, job.train_prompts, {}, job.out_dir)
            if plan.skipped:  # the driver's plan left these out already: the same rows cannot starve them here
                raise DataError(f"candidates with nothing to train on reached a trainer: {dict(plan.skipped)}")
            plan = replace(plan, candidates=tuple(replace(c, start=job.starts.get(c.name)) for c in plan.candidates))
        for c in plan.candidates:
            store.create(c.name, c.config, c.start)
        before = _replica_requests(engine)
        trained, rollout = train_candidates(
            base, store, engine, plan, job.rl, job.out_dir, job.progress, job.on_phase, reward_model=reward_model
        )
        for j, (now, then) in enumerate(zip(_replica_requests(engine), before)):
            rollout[f"rollout/replica{j}/requests"] = float(now - then)
        return TrainOutcome(trained.history, trained.versions, rollout)


@dataclass
class Trained:
    """What :func:`train_candidates` leaves: per candidate its step metrics and its last published version."""

    history: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)


def train_candidates(
    base: ResidentBase,
    store: AdapterStore,
    engine: RolloutEngine,
    plan: RoundPlan,
    rl: RLConfig,
    out_dir: Path,
    progress: bool,
    on_phase: PhaseHook | None = None,
    reward_model: RewardModel | None = None,
) -> tuple[Trained, dict[str, float]]:
    """S steps for every candidate, step-major: the numbered phases of the module docstring.

    Returns the per-candidate step metrics and final published versions, and
    round-level rollout metrics (``rollout/s``, ``rollout/tokens``, ``rollout/tokens_per_s``).
    """
    trained = Trained(history={c.name: [] for c in plan.candidates})
    starts: dict[str, StartReference] = {}  # reference = "start": each such adapter's weights before its first step
    for c in plan.candidates:
        trained.versions[c.name], _ = publish(engine, store, c.name, 0, out_dir, None)
    totals = {"rollout/s": 0.0, "rollout/tokens": 0.0}
    online, joint, tokens = plan.online, plan.one_pass(rl), plan.tokens
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("round", total=rl.steps_per_round * len(plan.candidates))
        for step in range(rl.steps_per_round):
            if on_phase is not None:
                on_phase(PhaseBoundary(RoundPhase.TRAIN, step=step))
            # 1. prompts: the same draw for every online candidate (a fair race)
            step_prompts = {c.name: draw_prompts(c.pool, rl.prompts_per_step, rl.seed * 7919 + step) for c in online}
            groups: dict[str, list[list[Sample]]] = {}
            rollout_metrics: dict[str, float] = {}
            if online:
                # 2. rollouts of all online candidates in one engine call (prompts may differ by data_filter)
                with timers.phase("time/rollout_s"):
                    groups, rollout_metrics = rollout_step(
                        engine, tokens, {c.name: trained.versions[c.name] for c in online}, step_prompts, rl, step
                    )
                totals["rollout/s"] += rollout_metrics["rollout/s"]
                totals["rollout/tokens"] += rollout_metrics["rollout/tokens"]
            rm_scores: dict[str, list[list[dict[str, float]]]] = {}
            scored = [c.name for c in online if uses_reward_model(c.config)]
            if scored:
                if reward_model is None:
                    raise DataError(f"candidates {scored} use reward 'reward_model' but the round has no reward model")
                rm_scores, m = score_rollouts(
                    reward_model, {n: tokens.many(step_prompts[n]) for n in scored}, {n: groups[n] for n in scored}
                )
                rollout_metrics = rollout_metrics | m

            def build(c: CandidatePlan) -> tuple[Batch, dict[str, float]]:
                rows: Sequence[Prompt]
                if c.algorithm.online:
                    rows, step_groups = step_prompts[c.name], groups[c.name]
                else:
                    rows, step_groups = (
                        draw_prompts(c.pool, rl.prompts_per_step * rl.rollout.group_size, rl.seed * 7919 + step),
                        None,
                    )
                return c.algorithm.build_batch(
                    StepData(c.config, rows, tokens.many(rows), step_groups, base, c.reward, rm_scores.get(c.name))
                )

            def finish(c: CandidatePlan, metrics: dict[str, float]) -> None:
                # 4. publish under a new name; the old one is unloaded
                trained.versions[c.name], m = publish(
                    engine, store, c.name, step + 1, out_dir, trained.versions[c.name]
                )
                metrics |= m
                trained.history[c.name].append(metrics)
                bar.update(
                    task, advance=1, description=f"{c.name} s{step + 1} reward {metrics['train/reward_mean']:.3f}"
                )

            pending: list[tuple[CandidatePlan, Batch, dict[str, float]]] = []
            for c in plan.candidates:
                if c.name in joint:  # one_pass mode: batches now, one forward/backward for all of them below
                    batch, m = build(c)
                    pending.append((c, batch, {"train/step": float(step)} | m | rollout_metrics))
                    continue
                # 3. batch + update, one candidate at a time on the resident base
                optimizer = store.activate(c.name)
                metrics = {"train/swap_s": store.last_swap_s, "train/step": float(step)}
                batch, m = build(c)
                metrics |= m | rollout_metrics
                if c.config.reference == "start" and c.name not in starts:
                    starts[c.name] = StartReference(optimizer)
                metrics |= update_step(base, optimizer, c.config, rl, batch, starts.get(c.name))
                finish(c, metrics)
            if pending:
                joint_metrics = train_one_pass(base, store, [(c.config, b) for c, b, _ in pending], rl)
                for c, _, metrics in pending:
                    finish(c, metrics | joint_metrics[c.name])
    totals["rollout/tokens_per_s"] = totals["rollout/tokens"] / max(totals["rollout/s"], 1e-9)
    return trained, totals


def rollout_step(
    engine: RolloutEngine,
    tokens: PromptTokens,
    versions: dict[str, str],
    prompts_by_name: dict[str, list[Prompt]],
    rl: RLConfig,
    step: int,
) -> tuple[dict[str, list[list[Sample]]], dict[str, float]]:
    """G samples per prompt for every online candidate, all in one engine call (vLLM batches them together)."""
    started = time.perf_counter()
    requests, owners = [], []
    for name, version in versions.items():
        for p in prompts_by_name[name]:
            ids = tokens(p)
            requests.append(
                RolloutRequest(
                    version=version,
                    prompt_id=p.prompt_id,
                    prompt_token_ids=tuple(ids),
                    n=rl.rollout.group_size,
                    max_new_tokens=rl.rollout.max_new_tokens,
                    temperature=rl.rollout.temperature,
                    seed=rl.seed * 1000 + step,
                )
            )
            owners.append(name)
    groups = engine.generate(requests)
    by_candidate: dict[str, list[list[Sample]]] = {name: [] for name in versions}
    for owner, group in zip(owners, groups):
        by_candidate[owner].append(group)
    elapsed = time.perf_counter() - started
    generated = sum(len(s.token_ids) for g in groups for s in g)
    return by_candidate, {
        "rollout/s": elapsed,
        "rollout/tokens": float(generated),
        "rollout/tokens_per_s": generated / max(elapsed, 1e-9),
    }


def publish(
    engine: RolloutEngine, store: AdapterStore, candidate: str, step: int, out_dir: Path, previous: str | None
) -> tuple[str, dict[str, float]]:
    """Save the live weights as ``<name>-s<step>``, load that new name, unload the previous one."""
    started = time.perf_counter()
    version = f"{candidate}-s{step}"
    with timers.phase("time/publish_s"):
        folder = store.save(candidate, out_dir / candidate / "versions" / f"s{step}")
        engine.load(candidate, version, folder)
        if previous is not None:
            engine.unload(previous)
    return version, {"train/publish_s": time.perf_counter() - started}


def _replica_requests(engine: object) -> list[int]:
    """Requests a vLLM fleet engine sent to each of its replicas so far (``FleetEngine.requests_per_replica``);
    empty for other engines."""
    counts = getattr(engine, "requests_per_replica", None)
    return list(counts()) if callable(counts) else []
