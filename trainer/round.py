"""One round of multi-LoRA RL on one resident base: a recipe, read it top to bottom.

    recipe = RoundRecipe(spec, inputs, out_dir)       # what to train, from what, where
    result = recipe.run()                             # setup → train → evaluate → save, then close

- :meth:`RoundRecipe.setup` builds the round's components, one ``_setup_*`` each, in dependency order
  (the executor, the resident base, the plan, the adapter store, the rollout engine, the reward model);
- :meth:`RoundRecipe.train` trains the reward model (when the round has one), then every candidate
  through the executor's step loop (:mod:`trainer.executors.local`);
- :meth:`RoundRecipe.evaluate` measures every candidate and champion on the same held-out rows
  (:mod:`trainer.evaluation.evaluate`); the gate that decides on it is a pure function the caller runs
  (:func:`trainer.evaluation.gate.gate_round`; the pipeline's ``gate`` state);
- :meth:`RoundRecipe.save` keeps every final adapter; :meth:`RoundRecipe.close` gives everything back.

Each numbered phase is timed under its metric key (:mod:`trainer.timers`: ``time/<phase>_s``), and
phase boundaries are reported to the caller through typed hooks (:class:`~trainer.types.PhaseBoundary`).

Folder layout under ``out_dir`` (one round)::

    <name>/versions/s<k>/   adapter after k optimizer steps (s0 = start point)
    <name>/adapter/         the final adapter (PEFT folder) -> CandidateResult.adapter_dir

and ``out_dir.parent / "last" / <name>`` holds every candidate's newest final adapter across rounds; a
candidate with ``start = "self"`` starts from there (fresh when it does not exist yet); ``start =
"champion"`` starts from ``inputs.champions[served_model]`` (fresh when None). The reward model
(when the round trains one) is kept as ``<reward model name>/adapter/`` and under ``last`` too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from trainer import timers
from trainer.adapters.store import keep_as_last, make_store
from trainer.evaluation.evaluate import Contestants, evaluate, load_suites
from trainer.executors.executor import make_executor
from trainer.model.base import load_base
from trainer.plan import plan_round
from trainer.reward_model import phase as reward_phase
from trainer.rollout.engine import make_engine, unload_versions
from trainer.types import (
    CandidateResult,
    PhaseBoundary,
    PhaseHook,
    RewardModelResult,
    RoundInputs,
    RoundPhase,
    RoundResult,
    RoundSpec,
    TrainJob,
    TrainOutcome,
)

if TYPE_CHECKING:  # the components' types; a reader meets each where the round builds it
    from trainer.adapters.store import AdapterStore
    from trainer.config import CandidateConfig
    from trainer.evaluation.evaluate import Evaluation
    from trainer.executors.executor import Executor
    from trainer.model.base import KeptBase, ResidentBase
    from trainer.plan import RoundPlan
    from trainer.reward_model.model import RewardModel
    from trainer.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)

__all__ = ["RoundParts", "RoundRecipe", "run_round"]


@dataclass(frozen=True)
class RoundParts:
    """Components a caller already has, each optional: a resident base to reuse (its adapters are
    removed again at the end), a rollout engine, an executor. Tests and benchmarks pass them; a
    round builds whatever is missing from its spec. ``kept_base``: where the always-on service keeps
    its base between rounds (``rl.keep_base``; :class:`~trainer.model.base.KeptBase`), used when
    ``base`` is None."""

    base: ResidentBase | None = None
    engine: RolloutEngine | None = None
    executor: Executor | None = None
    kept_base: KeptBase | None = None


def run_round(
    spec: RoundSpec,
    inputs: RoundInputs,
    out_dir: Path,
    *,
    round_id: str | None = None,
    on_phase: PhaseHook | None = None,
    progress: bool = False,
    parts: RoundParts = RoundParts(),
) -> RoundResult:
    """Train ``spec``'s candidates on one resident base and evaluate them against their champions
    (:class:`RoundRecipe`); the result carries one :class:`~trainer.types.TenantEvaluation` per served
    model for the gate (:func:`trainer.evaluation.gate.gate_round`), and no decisions yet.

    ``on_phase`` is called at each :class:`~trainer.types.PhaseBoundary`: before every reward-model step
    (``RoundPhase.REWARD_MODEL``) and every training step (``RoundPhase.TRAIN``, with the step), when
    evaluation starts (``RoundPhase.EVALUATE``) and between evaluation batches (``RoundPhase.EVALUATE``
    with a ``part``). It may raise (e.g. to cancel): the round stops there and its adapters are cleaned up.

    Raises:
        TrainerConfigError: duplicate candidates, vLLM without a URL, an adapter that does not fit, LoRA
            target_modules the base's architecture lacks (or its tied LM head).
        DataError: unreadable tables, no candidate with training prompts, or too little labelled feedback to
            train a reward model when every candidate learns from one. A candidate with nothing to learn from
            (no prompts, or no reward model) while others have sits the round out: ``RoundResult.skipped``.
        SuiteError: a regression suite (``[[rl.regression]]``) cannot be read, or its check fails on an answer.
        ExecutorError, ExecutorUnavailableError, PlacementTimeoutError: the ``ray`` executor's
            (:mod:`trainer.executors.ray_executor`).
    """
    return RoundRecipe(
        spec, inputs, out_dir, round_id=round_id, on_phase=on_phase, progress=progress, parts=parts
    ).run()


class RoundRecipe:
    """One round: :meth:`setup`, :meth:`train`, :meth:`evaluate`, :meth:`save`, and always :meth:`close`
    (:meth:`run` calls them in that order). Config and data problems are refused at construction,
    before any model work."""

    def __init__(
        self,
        spec: RoundSpec,
        inputs: RoundInputs,
        out_dir: Path,
        *,
        round_id: str | None = None,
        on_phase: PhaseHook | None = None,
        progress: bool = False,
        parts: RoundParts = RoundParts(),
    ) -> None:
        self.spec, self.inputs, self.out_dir, self.parts = spec, inputs, Path(out_dir), parts
        self.round_id = round_id or datetime.now(timezone.utc).strftime("r%Y%m%dT%H%M%S")
        self.on_phase, self.progress = on_phase, progress
        # the reward model's feedback (None: this round trains none); without enough of it the candidates that
        # learn from the reward model sit the round out (``skipped``), and the round is refused when none is left
        self.skipped: dict[str, str] = {}
        self.feedback, skipped = reward_phase.reward_data(inputs.data, spec.candidates, spec.rl.reward_model, spec.rl)
        self._sit_out(skipped)
        # the regression suites' prompts ([[rl.regression]]), read now: a missing or broken file fails the round here
        self.suites = load_suites(spec.rl)
        # the components, built by setup(); None until then (and after a setup that failed part-way)
        self.executor: Executor | None = None
        self.base: ResidentBase | None = None
        self.plan: RoundPlan | None = None
        self.store: AdapterStore | None = None
        self.engine: RolloutEngine | None = None
        self.reward_model: RewardModel | None = None
        self.base_reused = False  # the base was already resident (parts.base, or kept from the last round)
        # what the phases produce
        self.reward = reward_phase.RewardPhase()
        self.trained: TrainOutcome | None = None
        self.evaluation: Evaluation | None = None
        self.reward_result: RewardModelResult | None = None

    # --- the round, top to bottom --------------------------------------------------------------------

    def run(self) -> RoundResult:
        """setup → train → evaluate → save; :meth:`close` whatever happened. Returns the round's result."""
        started = time.perf_counter()
        collection = timers.start()  # time/<phase>_s round metrics
        ok = closed = False
        try:
            with reward_phase.naming_skipped(self.skipped):  # a later data refusal names those that sat out too
                self.setup()
                self.train()
                self.evaluate()
                candidates = self.save()
            ok = True
        finally:
            timers.stop(collection)
            try:
                self.close()
                closed = True
            finally:  # a kept base stays for the next round only when this one succeeded and left it clean
                if self.parts.kept_base is not None:
                    self.parts.kept_base.release(ok and closed)
        times = {
            **collection.totals,
            "round/wall_s": time.perf_counter() - started,
            "round/base_reused": float(self.base_reused),
        }
        return self._result(candidates, times)

    def setup(self) -> None:
        """Build the round's components in dependency order, one ``_setup_*`` each."""
        with timers.phase("time/setup_s"):
            # 0. the executor first: its workers (Ray trainer actors) start now, so their start-up overlaps 1-5
            self.executor = self._setup_executor()
            # 1. the resident base: every component below lives on it
            self.base = self._setup_base()
            # 2. the plan: per candidate its algorithm, reward mix, prompt pool and start point; it needs the
            #    base's tokenizer (each prompt's ids, cached for the round) and the champions (start points)
            self.plan = self._setup_plan(self.base)
            # 3. the adapter store: the candidates' and the reward model's LoRA weights, on the base
            self.store = self._setup_adapter_store(self.base)
            # 4. the rollout engine: serves the store's adapters (transformers) or their saved folders (vLLM)
            self.engine = self._setup_engine(self.base, self.store)
            # 5. the reward model: an adapter in the store plus a scalar head, at its start point
            self.reward_model = self._setup_reward_model(self.base, self.store)

    def train(self) -> TrainOutcome:
        """1. the reward model, from the train split only; 2. every candidate: start points + S steps."""
        assert self.executor and self.base and self.plan and self.store and self.engine, "setup() first"
        spec, data = self.spec, self.inputs.data
        if self.reward_model is not None and self.feedback is not None:
            with timers.phase("time/reward_model_s"):  # 1.
                self.reward = reward_phase.train_phase(
                    self.reward_model,
                    spec.rl.reward_model,
                    spec.rl,
                    self.feedback,
                    self.inputs.reward_champion,
                    self.on_phase,
                )
        job = TrainJob(  # 2. the executor's step loop times its own phases (rollout, reference, ..., publish)
            spec.model,
            spec.candidates,
            data.train,
            spec.rl,
            {c.name: c.start for c in self.plan.candidates},
            self.out_dir,
            self.round_id,
            self.progress,
            self.on_phase,
            reward_cfg=spec.rl.reward_model if self.reward.model is not None else None,
        )
        self.trained = self.executor.train(
            job, self.base, self.store, self.engine, plan=self.plan, reward_model=self.reward.model
        )
        return self.trained

    def evaluate(self) -> Evaluation:
        """Every candidate and every served model's champion on the same held-out rows (the gate's input)."""
        assert self.base and self.plan and self.store and self.engine and self.trained, "train() first"
        if self.on_phase is not None:
            self.on_phase(PhaseBoundary(RoundPhase.EVALUATE))
        with timers.phase("time/evaluate_s"):
            self.evaluation = evaluate(
                self.base,
                self.store,
                self.engine,
                Contestants(self.spec.candidates, self.trained.versions, self.inputs.champions),
                self.inputs.data.heldout,
                self.spec.rl,
                round_id=self.round_id,
                reward=self.reward,
                tokens=self.plan.tokens,
                on_phase=self.on_phase,
                suites=self.suites,
            )
        return self.evaluation

    def save(self) -> list[CandidateResult]:
        """Every candidate's final adapter as ``<name>/adapter`` and as its ``last`` (the next round's
        ``start = "self"``), the reward model's too; one :class:`~trainer.types.CandidateResult` per
        candidate, in config order. The trained versions leave the engine."""
        assert self.store and self.engine and self.trained and self.evaluation, "evaluate() first"
        with timers.phase("time/save_s"):
            out = []
            for c in self.spec.candidates:
                folder = self.store.save(c.name, self.out_dir / c.name / "adapter")
                keep_as_last(folder, self.out_dir, c.name)
                r = self.evaluation.results[c.name]
                out.append(
                    CandidateResult(
                        name=c.name,
                        served_model=c.served_model,
                        recipe=c.model_dump(mode="json"),
                        adapter_dir=folder,
                        step_metrics=tuple(self.trained.history[c.name]),
                        eval_rewards=r.rewards,
                        eval_metrics=r.as_metrics(str(self.spec.rl.gate.metric))
                        | self.evaluation.monitor_metrics.get(c.name, {})
                        | self._suite_metrics(c),
                    )
                )
            self.reward_result = reward_phase.finish(self.reward, self.out_dir)
            for version in self.trained.versions.values():
                self.engine.unload(version)
        return out

    def close(self) -> None:
        """Give everything back, whatever happened. Shutdown order: 1. unload what a failed or cancelled
        round left loaded in the engine, 2. drop the round's adapters from the store, 3. remove the store's
        adapters from the base, 4. the executor's workers (kept or freed, :meth:`Executor.close`)."""
        try:
            if self.engine is not None:  # 1.
                unload_versions(self.engine, {c.name for c in self.spec.candidates})
            if self.store is not None:
                for name in list(self.store.names()):  # 2.
                    self.store.delete(name)
                self.store.close()  # 3.
        finally:
            if self.executor is not None:  # 4.
                self.executor.close()

    # --- one component each, in dependency order -----------------------------------------------------

    def _setup_executor(self) -> Executor:
        executor = self.parts.executor or make_executor(self.spec.rl)
        executor.prepare(self.spec.model, self.spec.candidates, self.round_id)
        return executor

    def _setup_base(self) -> ResidentBase:
        kept = self.parts.kept_base
        self.base_reused = self.parts.base is not None or (kept is not None and kept.holds(self.spec.model))
        if self.parts.base is not None:
            base = self.parts.base
        elif kept is not None:
            base = kept.get(self.spec.model)  # the last round's, when it is still right; else loaded now
        else:
            base = load_base(self.spec.model)
        # every candidate's (and the reward model's) LoRA targets exist in this base's architecture, all at once
        targets = {c.name: c.target_modules for c in self.spec.candidates}
        if self.feedback is not None:
            targets["rl.reward_model"] = self.spec.rl.reward_model.target_modules
        base.check_targets(targets)
        return base

    def _setup_plan(self, base: ResidentBase) -> RoundPlan:
        plan = plan_round(
            base, self.spec.candidates, self.spec.rl, self.inputs.data.train, self.inputs.champions, self.out_dir
        )
        self._sit_out(plan.skipped)  # nothing to learn from this window, like those without a reward model
        rm = self.spec.rl.reward_model
        if self.feedback is not None and not reward_phase.check_config(self.spec.candidates, rm, self.spec.rl):
            # the candidates that learn from the reward model sat out, and nothing else reads it: none is trained
            log.info("no reward model this round: no candidate left learns from it (%s)", ", ".join(plan.skipped))
            self.feedback = None
        return plan

    def _sit_out(self, skipped: Mapping[str, str]) -> None:
        """These candidates (name -> why) sit the round out: named in ``RoundResult.skipped``, left out of
        everything after."""
        if skipped:
            self.skipped.update(skipped)
            self.spec = replace(self.spec, candidates=tuple(c for c in self.spec.candidates if c.name not in skipped))

    def _setup_adapter_store(self, base: ResidentBase) -> AdapterStore:
        return make_store(self.spec.rl.adapter_store, base, self.spec.rl.seed)

    def _setup_engine(self, base: ResidentBase, store: AdapterStore) -> RolloutEngine:
        return self.parts.engine or make_engine(self.spec.rl, base, store, [c.name for c in self.spec.candidates])

    def _setup_reward_model(self, base: ResidentBase, store: AdapterStore) -> RewardModel | None:
        if self.feedback is None:
            return None
        return reward_phase.create(
            base, store, self.spec.rl.reward_model, self.spec.rl, self.out_dir, self.inputs.reward_champion
        )

    def _suite_metrics(self, candidate: CandidateConfig) -> dict[str, float]:
        """``regression/<suite>``: the candidate's mean score on each regression suite of its served model."""
        assert self.evaluation is not None
        tenant = self.evaluation.tenants.get(candidate.served_model)
        if tenant is None:
            return {}
        return {
            f"regression/{name}": float(sum(scores.candidates[candidate.name]) / len(scores.candidates[candidate.name]))
            for name, scores in tenant.regression.items()
            if scores.candidates.get(candidate.name)
        }

    # --- the result --------------------------------------------------------------------------------------

    def _result(self, candidates: list[CandidateResult], times: dict[str, float]) -> RoundResult:
        assert self.base and self.trained and self.evaluation
        data, trained, evaluation = self.inputs.data, self.trained, self.evaluation
        return RoundResult(
            round_id=self.round_id,
            base_fingerprint=self.base.fingerprint,
            window_start=data.window_start,
            window_end=data.window_end,
            train_rows=len(data.train),
            heldout_rows=len(data.heldout),
            eval_prompt_ids=evaluation.prompt_ids,
            candidates=tuple(candidates),
            decisions={},
            metrics={
                **data.metrics,
                **trained.rollout_metrics,
                **trained.metrics,
                **evaluation.metrics,
                **self.reward.metrics,
                **times,
            },
            reward_model=self.reward_result,
            evaluations=evaluation.tenants,
            skipped=dict(self.skipped),
        )
