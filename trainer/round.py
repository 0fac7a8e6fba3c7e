"""The candidates of one round: one resident base, K candidate adapters, one rollout engine.

Read it top to bottom: :func:`run_round` is the round, and every step it calls
is a named function below it that returns its result and its metrics:
:func:`~trainer.plan.plan_round` (once per round, per candidate: its config, algorithm,
reward mix, prompt pool and start point; the prompts' token ids are cached for
the round), the reward model (:mod:`trainer.reward_model.phase`),
:func:`train_candidates`, :func:`evaluate_and_gate`, :func:`keep_adapters`.
Phase boundaries are reported to the caller through typed hooks
(:class:`~trainer.types.PhaseBoundary`).

Folder layout under ``out_dir`` (one round)::

    <name>/versions/s<k>/   adapter after k optimizer steps (s0 = start point)
    <name>/adapter/         the final adapter (PEFT folder) -> CandidateResult.adapter_dir

and ``out_dir.parent / "last" / <name>`` holds every candidate's newest final
adapter across rounds; a candidate with ``start = "self"`` starts from there
(fresh when it does not exist yet). ``start = "champion"`` starts from
``champions[served_model]`` (fresh when None).

When the round trains a reward model (``[reward_model]``, see
:mod:`trainer.reward_model.phase`), it is trained first, from the train split
only, and kept as ``<reward model name>/adapter/`` and under ``last`` too.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from rich.progress import Progress

from trainer import timers as profile
from trainer.reward_model import phase as reward_round
from trainer.adapters.store import AdapterStore
from trainer.adapters.registry import make_store
from trainer.model.base import ResidentBase, load_base
from trainer.config import CandidateConfig, ModelConfig, RewardModelConfig, RLConfig, uses_reward_model
from trainer.errors import DataError, RolloutError, TrainerConfigError
from trainer.executors.executor import Executor, Routines, TrainJob
from trainer.executors.local import LocalExecutor
from trainer.evaluation.evaluate import (
    EvalResult,
    auc,
    feedback_labels,
    gate,
    gate_mix,
    greedy_answers,
    kl_to_base,
    reference_logprobs,
    score,
    sequence_logps,
    unusable_reason,
    usable_rows,
)
from trainer.multi_lora.one_pass import train_one_pass
from trainer.plan import CandidatePlan, PromptTokens, RoundPlan, draw_prompts, plan_round
from trainer.reward_model.model import RewardModel
from trainer.rollout.engine import BASE_VERSION, RolloutEngine, RolloutRequest
from trainer.rollout.hf import HFEngine
from trainer.types import Prompt, Sample
from trainer.data import prompts_from_table, split_snapshot
from trainer.types import (
    CandidateResult,
    GateDecision,
    PhaseBoundary,
    PhaseHook,
    RewardModelReport,
    RoundPhase,
    RoundResult,
)
from trainer.algorithms.update import Batch, StepData, fit_after, logged_ids, update_step

log = logging.getLogger(__name__)

__all__ = ["evaluate_and_gate", "make_engine", "plan_round", "run_round", "split_snapshot", "train_candidates"]


# --- the round, top to bottom ---------------------------------------------------------------


def run_round(
    model_cfg: ModelConfig,
    candidates: list[CandidateConfig],
    rl: RLConfig,
    train: pa.Table,
    heldout: pa.Table,
    champions: dict[str, Path | None],
    out_dir: Path,
    *,
    engine: RolloutEngine | None = None,
    progress: bool = True,
    round_id: str | None = None,
    base: ResidentBase | None = None,
    checkpoint: PhaseHook | None = None,
    reward_cfg: RewardModelConfig | None = None,
    reward_champion: Path | None = None,
    executor: Executor | None = None,
) -> RoundResult:
    """Train K candidates on one resident base, evaluate them against their champions, gate.

    Args:
        train, heldout: buffer snapshot tables (see :mod:`trainer.tasks`), e.g.
            from :func:`split_snapshot`.
        champions: served model -> champion adapter folder (None: the base is champion).
        engine: a rollout engine (e.g. a :class:`~trainer.rollout.vllm.VLLMEngine`);
            default from ``rl.rollout_engine`` / ``rl.rollout_url``.
        base: an already resident base to reuse (loaded from ``model_cfg`` otherwise);
            its adapters are removed again at the end.
        reward_cfg: the ``[reward_model]`` section (defaults when None).
        reward_champion: the current reward champion's folder (adapter + head), re-measured
            on this round's held-out rows and, with ``start = "self"``, the start when
            there is no previous round's reward model.
        checkpoint: called at each :class:`~trainer.types.PhaseBoundary`: before every
            reward-model step (``RoundPhase.REWARD_MODEL``) and every training step
            (``RoundPhase.TRAIN``, with the step), when evaluation starts (``RoundPhase.EVALUATE``)
            and between evaluation batches (``RoundPhase.EVALUATE`` with a ``part``). It may
            raise (e.g. to cancel): the round stops there and its adapters are cleaned up.
        executor: where the candidates train (:mod:`trainer.executors.executor`); default :func:`make_executor`
            from ``rl.executor`` (``ray``: see :mod:`trainer.executors.ray_executor` for its errors).

    Raises:
        TrainerConfigError: duplicate candidates, vLLM without a URL, an adapter that does not fit.
        DataError: unreadable tables, no prompts for a candidate, or a candidate on
            ``reward_model`` and too little labelled feedback to train one.
    """
    started = time.perf_counter()
    check_candidates(candidates)
    round_id = round_id or datetime.now(timezone.utc).strftime("r%Y%m%dT%H%M%S")
    out_dir = Path(out_dir)
    train_prompts, heldout_prompts = prompts_from_table(train), prompts_from_table(heldout)  # fail early on bad data
    if not heldout_prompts:
        raise DataError("the held-out table is empty; widen the window or lower heldout_fraction")
    eval_ids = tuple(p.prompt_id for p in eval_prompts(heldout_prompts, rl))
    reward_cfg = reward_cfg or RewardModelConfig()
    feedback = reward_round.reward_data(train, heldout, candidates, reward_cfg, rl)  # fails before any work
    runner = executor or make_executor(rl)
    # 0. the executor's workers start now (Ray: trainer actors), in parallel with steps 1-5
    runner.prepare(model_cfg, candidates, rl, round_id)
    try:
        base = base or load_base(model_cfg)  # 1. the resident base, loaded once
        plan = plan_round(base, candidates, rl, train_prompts, champions, out_dir)  # 2. what each candidate learns from
        store = make_store(rl.adapter_store, base, rl.seed)  # 3. adapters live here between turns
        engine = engine or make_engine(rl, base, store, [c.name for c in candidates])  # 4. one engine for all
    except BaseException:
        runner.close()
        raise
    phase = reward_round.RewardPhase()
    times = profile.start()  # time/<phase>_s round metrics (trainer.timers)
    try:
        if feedback is not None:  # 5. the reward model, from the train split only, before the candidates
            phase = reward_round.train_phase(
                base, store, reward_cfg, rl, feedback, out_dir, reward_champion, checkpoint
            )
        job = TrainJob(
            model_cfg,
            tuple(candidates),
            tuple(train_prompts),
            rl,
            {c.name: c.start for c in plan.candidates},
            out_dir,
            round_id,
            progress,
            checkpoint,
            phase.model,
            plan=plan,
            reward_cfg=reward_cfg if phase.model is not None else None,
        )
        done = runner.train(job, base, store, engine)  # 6. start points + S steps (trainer.executors.executor)
        trained, rollout_metrics = (
            Trained(history=done.history, versions=done.versions),
            done.rollout_metrics | done.metrics,
        )
        if checkpoint is not None:
            checkpoint(PhaseBoundary(RoundPhase.EVALUATE))
        with profile.phase("time/evaluate_s"):  # 7. candidates and champions on the same held-out rows, then the gate
            results, decisions, eval_metrics = evaluate_and_gate(
                base,
                store,
                engine,
                candidates,
                trained.versions,
                heldout_prompts,
                champions,
                rl,
                round_id,
                reward_model=phase.model,
                reward_report=phase.report,
                checkpoint=checkpoint,
                tokens=plan.tokens,
            )
        reward_result = reward_round.finish(phase, out_dir)
        kept = keep_adapters(store, candidates, trained, results, rl, out_dir)  # 8. final adapters, also kept as "last"
        for version in trained.versions.values():
            engine.unload(version)
    finally:
        profile.stop(times)
        # Shutdown order: 0. unload what a failed or cancelled round left loaded in the engine,
        # 1. drop candidates from the store, 2. remove the store's adapters from the base.
        _unload_leftovers(engine, {c.name for c in candidates})
        for name in list(store.names()):
            store.delete(name)
        store.close()
        runner.close()
    window_start, window_end = _window(train, heldout)
    return RoundResult(
        round_id=round_id,
        base_fingerprint=base.fingerprint,
        window_start=window_start,
        window_end=window_end,
        train_rows=train.num_rows,
        heldout_rows=heldout.num_rows,
        eval_prompt_ids=eval_ids,
        candidates=tuple(kept),
        decisions=decisions,
        metrics={
            **rollout_metrics,
            **eval_metrics,
            **phase.metrics,
            **times.totals,
            "round/wall_s": time.perf_counter() - started,
        },
        reward_model=reward_result,
    )


# --- training ----------------------------------------------------------------------------------


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
    checkpoint: PhaseHook | None = None,
    reward_model: RewardModel | None = None,
) -> tuple[Trained, dict[str, float]]:
    """S steps for every candidate, step-major: one shared rollout call per step, then each candidate's update.

    With ``rl.update_mode = "one_pass"`` the one-pass algorithms' candidates (linear LoRA
    targets only) of a step update together, ``rl.adapters_per_pass`` per forward/backward
    (:func:`trainer.multi_lora.one_pass.train_one_pass`); the others update one at a time first.

    The rollouts of candidates whose reward uses ``reward_model`` are scored by
    ``reward_model`` in one batched pass per step, before any update.

    Returns the per-candidate step metrics and final published versions, and
    round-level rollout metrics (``rollout/s``, ``rollout/tokens``, ``rollout/tokens_per_s``).
    """
    trained = Trained(history={c.name: [] for c in plan.candidates})
    for c in plan.candidates:
        trained.versions[c.name], _ = publish(engine, store, c.name, 0, out_dir, None)
    totals = {"rollout/s": 0.0, "rollout/tokens": 0.0}
    online, joint, tokens = plan.online, plan.one_pass(rl), plan.tokens
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("round", total=rl.steps_per_round * len(plan.candidates))
        for step in range(rl.steps_per_round):
            if checkpoint is not None:
                checkpoint(PhaseBoundary(RoundPhase.TRAIN, step=step))
            # 1. prompts: the same draw for every online candidate (a fair race)
            step_prompts = {c.name: draw_prompts(c.pool, rl.prompts_per_step, rl.seed * 7919 + step) for c in online}
            groups: dict[str, list[list[Sample]]] = {}
            rollout_metrics: dict[str, float] = {}
            if online:
                # 2. rollouts of all online candidates in one engine call (prompts may differ by data_filter)
                with profile.phase("time/rollout_s"):
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
                rm_scores, m = reward_round.score_rollouts(
                    reward_model, {n: tokens.many(step_prompts[n]) for n in scored}, {n: groups[n] for n in scored}
                )
                rollout_metrics = rollout_metrics | m

            def build(c: CandidatePlan) -> tuple[Batch, dict[str, float]]:
                rows: Sequence[Prompt]
                if c.algorithm.online:
                    rows, step_groups = step_prompts[c.name], groups[c.name]
                else:
                    rows, step_groups = (
                        draw_prompts(c.pool, rl.prompts_per_step * rl.group_size, rl.seed * 7919 + step),
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
                # 3. score + update, one candidate at a time on the resident base
                optimizer = store.activate(c.name)
                metrics = {"train/swap_s": store.last_swap_s, "train/step": float(step)}
                batch, m = build(c)
                metrics |= m | rollout_metrics
                metrics |= update_step(base, optimizer, c.config, rl, batch)
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
                    n=rl.group_size,
                    max_new_tokens=rl.max_new_tokens,
                    temperature=rl.temperature,
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


# --- evaluation and the gate -------------------------------------------------------------------


def evaluate_and_gate(
    base: ResidentBase,
    store: AdapterStore,
    engine: RolloutEngine,
    candidates: Sequence[CandidateConfig],
    versions: dict[str, str],
    heldout: Sequence[Prompt],
    champions: dict[str, Path | None],
    rl: RLConfig,
    round_id: str,
    *,
    reward_model: RewardModel | None = None,
    reward_report: RewardModelReport | None = None,
    checkpoint: PhaseHook | None = None,
    tokens: PromptTokens | None = None,
) -> tuple[dict[str, EvalResult], dict[str, GateDecision], dict[str, float]]:
    """Greedy answers of all candidates and champions on the same held-out rows, one yardstick
    (``rl.gate_metric``, see :mod:`trainer.evaluation.evaluate`) per tenant, then one gate per tenant.

    ``reward_model`` / ``reward_report``: the round's reward model (trained on
    the training split) and its held-out report; the ``reward_model`` metric
    promotes nothing without them or when the report's AUC lower bound is <= 0.5.
    No usable held-out row is not an error: every tenant keeps its champion,
    and the decision says why. Returns results per candidate, decisions per
    tenant, and round metrics (``eval/prompts``, ``eval/<metric>/<candidate>``,
    ``eval/<metric>/champion/<tenant>``).

    ``checkpoint`` is called with ``PhaseBoundary(RoundPhase.EVALUATE, part="greedy")`` before
    the greedy answers and ``PhaseBoundary(RoundPhase.EVALUATE, part="score", candidate=name)``
    before each candidate is scored; if it raises, the champions loaded here are unloaded and the
    error propagates.
    """
    check: PhaseHook = checkpoint or (lambda _boundary: None)
    metric = rl.gate_metric
    prompts = eval_prompts(heldout, rl)
    tenants = sorted({c.served_model for c in candidates})
    refusal = unusable_reason(prompts, len(heldout), rl)
    if refusal is None and metric == "reward_model":
        if reward_model is None:
            refusal = "the gate metric is 'reward_model' but this round has no reward model"
        elif reward_report is None or not reward_report.auc_lower_bound > 0.5:
            lb = reward_report.auc_lower_bound if reward_report is not None else float("nan")
            refusal = (
                f"the reward model is not better than chance on held-out feedback (AUC lower bound {lb:.3f} <= 0.5)"
            )
    ids = (tokens or PromptTokens(base, rl)).many(prompts)
    mix = gate_mix(rl) if metric == "verifiable" else None  # the verifiable yardstick, built once
    labels = feedback_labels(prompts) if metric == "feedback" else None
    logged = [fit_after(base, i, logged_ids(base, p)) for i, p in zip(ids, prompts)] if metric == "feedback" else []
    reference = sequence_logps(base, ids, logged, reference=True) if logged else []
    champion_versions, champion_names = _load_champions(store, engine, tenants, champions, round_id)
    try:
        check(PhaseBoundary(RoundPhase.EVALUATE, part="greedy"))
        answers = (
            greedy_answers(engine, [*versions.values(), *sorted(set(champion_versions.values()))], prompts, ids, rl)
            if prompts
            else {}
        )
        rm_scores: dict[str, list[float]] = {}
        if metric == "reward_model" and reward_model is not None and prompts:
            order = list(answers)  # every version's greedy answers in one batched scoring call
            flat = reward_model.score(
                [i for _ in order for i in ids],
                [list(s.token_ids) or [base.tokenizer.eos_token_id] for v in order for s in answers[v]],
            )
            rm_scores = {v: list(flat[k * len(prompts) : (k + 1) * len(prompts)]) for k, v in enumerate(order)}

        def values(version: str) -> tuple[float, ...]:
            """Per-row values of ``version`` (its adapter must be live for ``feedback``)."""
            if not prompts:
                return ()
            if metric == "verifiable":
                assert mix is not None
                return score(answers[version], prompts, mix)
            if metric == "reward_model":
                return tuple(rm_scores.get(version, [float("nan")] * len(prompts)))
            if version == BASE_VERSION:
                return tuple(0.0 for _ in prompts)  # the base's implicit reward against itself
            return tuple(a - b for a, b in zip(sequence_logps(base, ids, logged), reference))

        # the base's log-probs of every candidate's greedy answers: one adapters-off pass, rows by prompt
        kl_versions = list(dict.fromkeys(versions[c.name] for c in candidates if versions[c.name] in answers))
        base_logprobs = reference_logprobs(base, ids, {v: answers[v] for v in kl_versions})
        results: dict[str, EvalResult] = {}
        for c in candidates:
            check(PhaseBoundary(RoundPhase.EVALUATE, part="score", candidate=c.name))
            samples = answers.get(versions[c.name], [])
            store.activate(c.name)
            row_values = values(versions[c.name])
            results[c.name] = EvalResult(
                version=versions[c.name],
                samples=tuple(samples),
                rewards=row_values,
                mean_kl=kl_to_base(samples, base_logprobs[versions[c.name]]) if samples else float("nan"),
                mean_length=sum(len(s.token_ids) for s in samples) / len(samples) if samples else float("nan"),
                value=auc(row_values, labels) if labels is not None else None,
            )
        decisions: dict[str, GateDecision] = {}
        round_metrics = {"eval/prompts": float(len(prompts))}
        for tenant in tenants:
            if tenant in champion_names:
                store.activate(champion_names[tenant])
            champ = values(champion_versions[tenant])
            label = "base" if champion_versions[tenant] == BASE_VERSION else f"champion {champions[tenant]}"
            members = [c for c in candidates if c.served_model == tenant]
            decisions[tenant] = gate(tenant, members, results, champ, label, rl, labels=labels, refusal=refusal)
            round_metrics[f"eval/{metric}/champion/{tenant}"] = decisions[tenant].champion_reward_mean
        round_metrics |= {f"eval/{metric}/{name}": r.metric_value for name, r in results.items()}
        round_metrics = {
            k: v for k, v in round_metrics.items() if math.isfinite(v)
        }  # undefined values are left out, not NaN
    finally:
        for version in champion_versions.values():
            if version != BASE_VERSION:
                engine.unload(version)
        for name in champion_names.values():
            store.delete(name)
    return results, decisions, round_metrics


def eval_prompts(heldout: Sequence[Prompt], rl: RLConfig) -> list[Prompt]:
    """The first ``rl.eval_prompts`` held-out rows the gate metric can use (see
    :func:`trainer.evaluation.evaluate.usable_rows`); may be empty (the gate then promotes nothing)."""
    return usable_rows(heldout, rl)[: rl.eval_prompts]


def _load_champions(
    store: AdapterStore, engine: RolloutEngine, tenants: Sequence[str], champions: dict[str, Path | None], round_id: str
) -> tuple[dict[str, str], dict[str, str]]:
    """Each tenant's champion as an adapter in the store and the engine: tenant -> engine version
    (``BASE_VERSION`` when the base is champion), tenant -> store name (tenants with an adapter only)."""
    versions: dict[str, str] = {}
    names: dict[str, str] = {}
    for i, tenant in enumerate(tenants):
        folder = champions.get(tenant)
        if folder is None:
            versions[tenant] = BASE_VERSION
            continue
        name = f"champion-{i}"
        store.create(name, _champion_candidate(Path(folder), name), init_dir=Path(folder))
        names[tenant] = name
        versions[tenant] = f"{name}-{round_id}"
        engine.load(name, versions[tenant], Path(folder))
    return versions, names


def _champion_candidate(folder: Path, name: str) -> CandidateConfig:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    targets = cfg["target_modules"]
    return CandidateConfig(
        name=name,
        lora_rank=cfg["r"],
        lora_alpha=cfg["lora_alpha"],
        target_modules=sorted(targets) if isinstance(targets, list) else [targets],
        start="fresh",
    )


# --- the round's outputs -----------------------------------------------------------------------


def keep_adapters(
    store: AdapterStore,
    candidates: Sequence[CandidateConfig],
    trained: Trained,
    results: dict[str, EvalResult],
    rl: RLConfig,
    out_dir: Path,
) -> list[CandidateResult]:
    """Save every candidate's final adapter as ``<name>/adapter`` and as its ``last`` (the next round's
    ``start = "self"``); one :class:`~trainer.types.CandidateResult` each, in config order."""
    out = []
    for c in candidates:
        folder = store.save(c.name, out_dir / c.name / "adapter")
        last = out_dir.parent / "last" / c.name
        shutil.rmtree(last, ignore_errors=True)
        shutil.copytree(folder, last)
        r = results[c.name]
        out.append(
            CandidateResult(
                name=c.name,
                served_model=c.served_model,
                recipe=c.model_dump(mode="json"),
                adapter_dir=folder,
                step_metrics=tuple(trained.history[c.name]),
                eval_rewards=r.rewards,
                eval_metrics=r.as_metrics(rl.gate_metric),
            )
        )
    return out


# --- helpers -----------------------------------------------------------------------------------


def make_executor(rl: RLConfig) -> Executor:
    """The executor ``rl.executor`` names (:mod:`trainer.executors.executor`; ``ray`` imports Ray only then),
    running this module's training functions."""
    routines = Routines(train_candidates=train_candidates, make_engine=make_engine, unload_leftovers=_unload_leftovers)
    if rl.executor == "ray":
        from trainer.executors.ray_executor import RayExecutor

        return RayExecutor(routines)
    return LocalExecutor(routines)


def make_engine(rl: RLConfig, base: ResidentBase, store: AdapterStore, order: Sequence[str] = ()) -> RolloutEngine:
    """The rollout engine the config asks for (``rl.rollout_engine``); ``order``: the round's candidate
    names, the placement order of a vLLM fleet (:class:`trainer.rollout.fleet.FleetEngine`).

    Raises:
        TrainerConfigError: ``vllm`` without ``rl.rollout_url``.
    """
    if rl.rollout_engine == "hf":
        return HFEngine(base, store)
    urls = list(rl.rollout_urls) or ([rl.rollout_url] if rl.rollout_url else [])
    if not urls:
        raise TrainerConfigError(
            "rollout_engine 'vllm' needs rl.rollout_url (the vLLM server's base URL), or pass engine="
        )
    from trainer.rollout.fleet import make_vllm_engine

    return make_vllm_engine(urls, order=order, adapter_share=rl.adapter_share_uri)  # several URLs: a FleetEngine


def check_candidates(candidates: Sequence[CandidateConfig]) -> None:
    """Raises TrainerConfigError listing every problem: none given, duplicate names."""
    problems = []
    if not candidates:
        problems.append("no candidates given")
    names = [c.name for c in candidates]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"duplicate candidate names {dupes}")
    if problems:
        raise TrainerConfigError("; ".join(problems))


def publish(
    base_engine: RolloutEngine, store: AdapterStore, candidate: str, step: int, out_dir: Path, previous: str | None
) -> tuple[str, dict[str, float]]:
    """Save the live weights as ``<name>-s<step>``, load that new name, unload the previous one."""
    started = time.perf_counter()
    version = f"{candidate}-s{step}"
    with profile.phase("time/publish_s"):
        folder = store.save(candidate, out_dir / candidate / "versions" / f"s{step}")
        base_engine.load(candidate, version, folder)
        if previous is not None:
            base_engine.unload(previous)
    return version, {"train/publish_s": time.perf_counter() - started}


def _window(train: pa.Table, heldout: pa.Table) -> tuple[datetime, datetime]:
    """Oldest and newest ``ts`` over both tables."""
    chunks = [chunk for t in (train, heldout) if "ts" in t.column_names for chunk in t.column("ts").chunks]
    stamps = pa.chunked_array(chunks, type=chunks[0].type) if chunks else None
    if stamps is None or len(stamps) == 0:
        now = datetime.now(timezone.utc)
        return now, now
    return pc.min(stamps).as_py(), pc.max(stamps).as_py()


def _unload_leftovers(engine: RolloutEngine, names: set[str]) -> None:
    """Unload every version of these candidates the engine still has (after an error or a cancel)."""
    loaded = getattr(engine, "versions", {})
    for version in [v for v, candidate in list(loaded.items()) if candidate in names]:
        try:
            engine.unload(version)
        except RolloutError as err:  # cleanup must not hide the round's own error
            log.warning("could not unload %s after the round: %s", version, err)
